import importlib.util
import json
import logging
import os
import signal
from pathlib import Path
from types import ModuleType

import pytest
from PIL import Image

ROOT = Path(__file__).resolve().parents[1]

if os.environ.get("PYTEST_XDIST_WORKER"):
    # `make test` runs one worker per core: a worker's torch threads would only contend
    import torch

    torch.set_num_threads(1)
# a shapes model small enough to train a few steps in about a second
TINY_SETTINGS = [
    "model.hidden_dim=32",
    "model.embed_dim=16",
    "model.attention_dim=16",
    "model.cnn_channels=[8,16]",
    "model.grid_layers=0",
    "train.batch_size=8",
    "train.epochs=1",
    "train.warmup_steps=0",
    "train.figure_every_epoch=false",
]


def load_tool(name: str) -> ModuleType:
    """The module ``tools.NAME`` (the lab's scripts run as ``python -m tools.NAME``)."""
    return importlib.import_module(f"tools.{name}")


def write_json(path: Path, data) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data))
    return path


CATEGORIES = [{"id": 1, "name": "dog"}, {"id": 2, "name": "cat"}, {"id": 3, "name": "car"}]
# image id -> categories of its objects
OBJECTS = {1: ["dog"], 2: ["cat", "car"], 3: ["car"], 4: [], 5: ["dog", "cat"], 6: ["car"]}


def make_coco(root: Path, split_name: str, image_ids, image_dir: str, with_files=True) -> None:
    """A tiny COCO captions + instances pair for ``split_name`` (e.g. train2014)."""
    images = [
        {"id": i, "file_name": f"{image_dir}_{i:012d}.jpg", "width": 40, "height": 30}
        for i in image_ids
    ]
    captions = [
        {"id": i * 10 + k, "image_id": i, "caption": f"Image {i} caption {k}."}
        for i in image_ids
        for k in range(2)
    ]
    cat_ids = {c["name"]: c["id"] for c in CATEGORIES}
    instances = [
        {
            "id": i * 100 + k,
            "image_id": i,
            "category_id": cat_ids[name],
            "bbox": [1.0, 2.0, 10.0, 8.0],
            "area": 80.0,
            "iscrowd": 0,
        }
        for i in image_ids
        for k, name in enumerate(OBJECTS[i])
    ]
    info = {"description": "test"}
    write_json(
        root / "annotations" / f"captions_{split_name}.json",
        {"info": info, "images": images, "annotations": captions, "licenses": []},
    )
    write_json(
        root / "annotations" / f"instances_{split_name}.json",
        {
            "info": info,
            "images": images,
            "annotations": instances,
            "categories": CATEGORIES,
            "licenses": [],
        },
    )
    if with_files:
        (root / image_dir).mkdir(parents=True, exist_ok=True)
        for image in images:
            Image.new("RGB", (40, 30), (i := image["id"] * 20, 0, 0)).save(
                root / image_dir / image["file_name"]
            )
            del i


@pytest.fixture
def coco2014(tmp_path) -> Path:
    root = tmp_path / "coco"
    make_coco(root, "train2014", [1, 2, 3, 4], "train2014")
    make_coco(root, "val2014", [5, 6], "val2014")
    return root


@pytest.fixture(autouse=True)
def _captioning_logs(caplog):
    caplog.set_level(logging.INFO, logger="captioning")


def signal_dispositions() -> dict[str, object]:
    """Ctrl-C's and SIGTERM's Python handlers, and whether the kernel has each ignored or
    caught (a disposition set from C, or inherited, shows only there)."""
    dispositions: dict[str, object] = {}
    masks = {}
    status = Path("/proc/self/status")
    if status.is_file():
        for line in status.read_text().splitlines():
            key, _, value = line.partition(":")
            if key in ("SigIgn", "SigCgt"):
                masks[key] = int(value, 16)
    for signum in (signal.SIGINT, signal.SIGTERM):
        dispositions[signum.name] = signal.getsignal(signum)
        for key, mask in masks.items():
            dispositions[f"{signum.name} {key}"] = bool(mask >> (signum - 1) & 1)
    return dispositions


@pytest.fixture(autouse=True)
def _signals_restored(request):
    """Every test leaves Ctrl-C and SIGTERM as it found them: a handler or an ignored signal
    left behind would be inherited by the next test's child processes."""
    before = signal_dispositions()
    yield
    after = signal_dispositions()
    assert after == before, (
        f"{request.node.nodeid} changed signal dispositions: {before} -> {after}"
    )


@pytest.fixture(scope="session")
def tiny_shapes(tmp_path_factory) -> Path:
    """A few dozen 48 px shapes images (COCO layout), shared by the API and server tests."""
    from captioning.data.shapes import generate_shapes

    root = tmp_path_factory.mktemp("tiny_shapes")
    generate_shapes(root, num_train=24, num_val=6, num_test=6, seed=0, image_size=48)
    return root


def _tiny_run(root: Path, out: Path, *overrides: str) -> Path:
    from captioning.config import load_config
    from captioning.training.train import fit

    config = Path(__file__).resolve().parent.parent / "configs" / "test_tiny.yaml"
    fit(load_config(config, [f"data.root={root}", "train.epochs=1", *overrides]), out_dir=out)
    return out / "best.pt"


@pytest.fixture(scope="session")
def tiny_checkpoint(tiny_shapes, tmp_path_factory) -> Path:
    """A soft-attention checkpoint trained for one epoch on ``tiny_shapes`` (seconds)."""
    return _tiny_run(tiny_shapes, tmp_path_factory.mktemp("tiny_soft"))


@pytest.fixture(scope="session")
def tiny_hard_checkpoint(tiny_shapes, tmp_path_factory) -> Path:
    """As ``tiny_checkpoint``, with hard attention."""
    return _tiny_run(tiny_shapes, tmp_path_factory.mktemp("tiny_hard"), "model.attention=hard")


@pytest.fixture(scope="session")
def tiny_local_checkpoint(tiny_shapes, tmp_path_factory) -> Path:
    """As ``tiny_checkpoint``, with local attention (a predicted centre per word)."""
    return _tiny_run(tiny_shapes, tmp_path_factory.mktemp("tiny_local"), "model.attention=local")


@pytest.fixture(scope="session")
def tiny_heads_checkpoint(tiny_shapes, tmp_path_factory) -> Path:
    """As ``tiny_checkpoint``, with two attention heads."""
    return _tiny_run(tiny_shapes, tmp_path_factory.mktemp("tiny_heads"), "model.heads=2")
