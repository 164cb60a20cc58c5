"""The feature cache: extract-features writes float16 grids; training reads them."""

import json
import os
import shutil

import numpy as np
import pytest
import torch

from captioning.checkpoint import load_checkpoint
from captioning.cli import main
from captioning.config import load_config
from captioning.data.build import load_splits
from captioning.data.feature_cache import (
    FeatureCache,
    cache_folder,
    encoder_fingerprint,
    extract_features,
    find_cache,
)
from captioning.data.images import load_image
from captioning.data.shapes import generate_shapes
from captioning.errors import DataError
from captioning.models import build_encoder
from captioning.runtime import seed_everything
from captioning.training.train import fit

CONFIG = os.path.join(os.path.dirname(__file__), "..", "configs", "test_tiny.yaml")
FROZEN = ["model.fine_tune=none", "model.dropout=0", "train.epochs=2", "train.precision=fp32"]


@pytest.fixture
def shapes(tmp_path):
    root = tmp_path / "shapes"
    generate_shapes(root, num_train=16, num_val=4, num_test=4, seed=0, image_size=48)
    return root


def frozen(shapes, *extra):
    return load_config(CONFIG, [f"data.root={shapes}", *FROZEN, *extra])


def the_encoder(cfg):
    seed_everything(cfg.train.seed)
    return build_encoder(cfg.model)


def test_cache_holds_the_backbone_grid_in_float16(shapes):
    cfg = frozen(shapes)
    summary = extract_features(cfg, "train", progress=False)
    encoder = the_encoder(cfg).eval()
    folder = cache_folder(cfg, encoder)
    assert summary["folder"] == str(folder) and summary["images"] == 16
    array = np.load(folder / "train.npy", mmap_mode="r")
    assert isinstance(array, np.memmap) and array.dtype == np.float16
    assert array.shape == (16, encoder.num_cells, encoder.out_channels)
    meta = json.loads((folder / "train.json").read_text())
    cache = FeatureCache(folder, "train")
    record = load_splits(cfg.data)["train"][5]
    with torch.no_grad():
        expected = encoder.backbone(encoder.transform(load_image(record.path))[None])[0]
    got = cache.grid(record.image_id).float()  # (L, D)
    assert record.image_id in meta["image_ids"]
    # extraction folds the BatchNorms, but records the weights as training builds them
    assert meta["fingerprint"] == encoder_fingerprint(encoder)
    # float16 keeps 11 significant bits: relative error below 2^-11 of each value
    assert torch.allclose(got, expected, rtol=2**-10, atol=1e-4)


def test_ctrl_c_as_the_grids_are_renamed_waits_for_their_index(shapes, monkeypatch):
    """A stopped extraction leaves the grids and their index, or neither: Ctrl-C arriving the
    moment the grids take their place is held back until the index is written too."""
    import signal

    from captioning import files

    cfg = frozen(shapes)
    replace = os.replace

    def replace_then_ctrl_c(src, dst):
        replace(src, dst)
        if str(dst).endswith("train.npy"):
            os.kill(os.getpid(), signal.SIGINT)

    monkeypatch.setattr(files.os, "replace", replace_then_ctrl_c)
    with pytest.raises(KeyboardInterrupt):
        extract_features(cfg, "train", progress=False)
    folder = cache_folder(cfg, the_encoder(cfg))
    assert sorted(p.name for p in folder.glob("train*")) == ["train.json", "train.npy"]
    assert (
        FeatureCache(folder, "train").grid(load_splits(cfg.data)["train"][0].image_id) is not None
    )


def test_training_reads_the_cache_and_never_opens_an_image(shapes, tmp_path, caplog):
    cfg = frozen(shapes, "data.check_images=false", "train.figure_every_epoch=false")
    fit(cfg, out_dir=tmp_path / "images")
    for split in ("train", "val"):
        extract_features(cfg, split, progress=False)
    shutil.rmtree(shapes / "images")  # only the cache is left
    caplog.clear()
    fit(cfg, out_dir=tmp_path / "cached")
    assert "reading cached train grids" in caplog.text
    assert "reading cached val grids" in caplog.text
    # The same training run, up to the float16 rounding of the inputs.
    from_images = load_checkpoint(tmp_path / "images" / "last.pt")
    from_cache = load_checkpoint(tmp_path / "cached" / "last.pt")
    assert from_cache["step"] == from_images["step"] == 4
    for a, b in zip(from_images["history"], from_cache["history"]):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-3)


def test_learned_positions_still_train_on_cached_grids(shapes, tmp_path):
    cfg = frozen(shapes, "model.positional=learned", "train.figure_every_epoch=false")
    extract_features(cfg, "train", progress=False)
    fit(cfg, out_dir=tmp_path / "run")
    payload = load_checkpoint(tmp_path / "run" / "last.pt")
    start = the_encoder(cfg).positions
    assert not torch.allclose(payload["model"]["encoder.positions"], start)


def test_another_encoder_does_not_read_the_cache(shapes):
    cfg = frozen(shapes)
    extract_features(cfg, "train", progress=False)
    assert find_cache(cfg, the_encoder(cfg), "train") is not None
    other = frozen(shapes, "train.seed=1")  # another random frozen CNN
    assert find_cache(other, the_encoder(other), "train") is None
    trained = frozen(shapes, "model.fine_tune=all")  # its grid changes while training
    assert find_cache(trained, the_encoder(trained), "train") is None


def test_a_cache_missing_images_says_so(shapes):
    cfg = frozen(shapes, "data.max_images=8")
    extract_features(cfg, "train", progress=False)
    encoder = the_encoder(cfg)
    cache = FeatureCache(cache_folder(cfg, encoder), "train")
    records = load_splits(frozen(shapes).data)["train"]
    with pytest.raises(DataError, match="lacks 8 of the 16 train images"):
        cache.check(records)


def test_cli_extract_features_and_its_errors(shapes, capsys):
    args = ["extract-features", "--config", CONFIG, "--split", "val", "--quiet"]
    args += [arg for item in (f"data.root={shapes}", *FROZEN) for arg in ("--set", item)]
    assert main(args) == 0
    assert "cached 4 val grids" in capsys.readouterr().out
    assert main(args) == 2  # already there
    assert "--overwrite" in capsys.readouterr().err
    assert main([*args, "--overwrite"]) == 0
    capsys.readouterr()
    assert main([*args, "--set", "model.fine_tune=all"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: model.fine_tune=all trains the encoder") and "\n" not in err
