"""The ``runtime`` section: how a trained model runs (decoding precision, batch and seed, and
the speed switches), apart from how it was trained. Its nulls follow the train section, so
configs and checkpoints from before it decode as they did; set, it decides alone."""

import pytest
import torch

from captioning.checkpoint import load_checkpoint, save_checkpoint
from captioning.config import config_from_dict, config_to_dict, load_config
from captioning.errors import CheckpointError, ConfigError
from captioning.evaluate import evaluate_checkpoint
from captioning.inference import caption as inference
from captioning.inference.caption import load_model
from captioning.training.run_state import check_resume_config


def test_runtime_keys_follow_the_train_section_until_set():
    cfg = load_config(None, ["train.precision=bf16", "train.batch_size=7", "train.seed=3"])
    assert (cfg.runtime.precision, cfg.runtime.batch_size, cfg.runtime.seed) == ("bf16", 7, 3)
    cfg = load_config(
        None,
        [
            "train.precision=bf16",
            "train.batch_size=7",
            "train.seed=3",
            "runtime.precision=fp32",
            "runtime.batch_size=2",
            "runtime.seed=9",
        ],
    )
    assert (cfg.runtime.precision, cfg.runtime.batch_size, cfg.runtime.seed) == ("fp32", 2, 9)
    assert (cfg.train.precision, cfg.train.batch_size, cfg.train.seed) == ("bf16", 7, 3)
    # stored resolved: written and read back, it no longer follows train
    saved = config_to_dict(cfg)
    saved["train"]["precision"] = "fp16"
    assert config_from_dict(saved).runtime.precision == "fp32"
    # a config from before the section: every runtime value is the train section's
    old = config_to_dict(load_config(None, ["train.precision=fp16", "train.batch_size=5"]))
    del old["runtime"]
    runtime = config_from_dict(old).runtime
    assert (runtime.precision, runtime.batch_size, runtime.seed) == ("fp16", 5, 0)
    assert runtime.channels_last and runtime.parallel_decoder
    with pytest.raises(ConfigError, match="runtime.batch_size must be at least 1, got 0"):
        load_config(None, ["runtime.batch_size=0"])
    with pytest.raises(
        ConfigError,
        match=r"runtime.precision must be 'fp32' \| 'bf16' \| "
        r"'fp16' \| 'auto' \| null, got 'fp8'",
    ):
        load_config(None, ["runtime.precision=fp8"])


def test_the_speed_switches_reach_the_model(tiny_checkpoint, tmp_path):
    payload = load_checkpoint(tiny_checkpoint)
    payload["config"]["runtime"].update(channels_last=False, parallel_decoder=False)
    save_checkpoint(payload, tmp_path / "plain.pt")
    model, _, _ = load_model(tmp_path / "plain.pt")
    assert model.decoder.parallel is False and model.encoder.channels_last is False
    model, _, _ = load_model(tiny_checkpoint)
    assert model.decoder.parallel is True and model.encoder.channels_last is True


def rewrite(checkpoint, path, train=None, runtime=None, decode=None):
    """``checkpoint`` with its config changed: ``runtime`` None drops the section, as a
    checkpoint from before it has none."""
    payload = load_checkpoint(checkpoint)
    config = payload["config"]
    config["train"].update(train or {})
    config["decode"].update(decode or {})
    if runtime is None:
        del config["runtime"]
    else:
        config["runtime"].update(runtime)
    save_checkpoint(payload, path)
    return path


@pytest.mark.parametrize(
    "train,runtime,expected",
    [
        # a checkpoint from before the section decodes as train.* says, as it always did
        ({"precision": "bf16", "batch_size": 2}, None, ("bf16", 2)),
        # with the section, it alone decides
        (
            {"precision": "fp32", "batch_size": 64},
            {"precision": "bf16", "batch_size": 4},
            ("bf16", 4),
        ),
        (
            {"precision": "bf16", "batch_size": 2},
            {"precision": "fp32", "batch_size": 3},
            ("fp32", 3),
        ),
    ],
)
def test_evaluate_decodes_with_the_runtime_settings(
    tiny_checkpoint, tmp_path, monkeypatch, train, runtime, expected
):
    path = rewrite(tiny_checkpoint, tmp_path / "ckpt.pt", train, runtime)
    seen = []
    real = inference.caption_batch

    def spy(model, decode_cfg, precision, images=None, grid=None, encode_batch=None):
        seen.append((precision, len(images if images is not None else grid)))
        return real(model, decode_cfg, precision, images, grid, encode_batch)

    monkeypatch.setattr(inference, "caption_batch", spy)
    metrics = evaluate_checkpoint(path, split="val", meteor=False, progress=False, device="cpu")
    precision, batch = expected
    assert metrics["decoding"]["precision"] == precision
    assert {p for p, _ in seen} == {precision}
    assert max(n for _, n in seen) == batch and sum(n for _, n in seen) == metrics["num_images"]


def test_sampled_decoding_is_seeded_by_runtime_seed(tiny_checkpoint, tmp_path):
    sample = {"strategy": "sample"}
    captions = {}
    for name, train_seed, runtime_seed in (("a", 0, 7), ("b", 5, 7), ("c", 0, 8)):
        path = rewrite(
            tiny_checkpoint,
            tmp_path / f"{name}.pt",
            {"seed": train_seed},
            {"seed": runtime_seed},
            sample,
        )
        evaluate_checkpoint(
            path, split="val", meteor=False, progress=False, device="cpu", out_dir=tmp_path / name
        )
        captions[name] = (tmp_path / name / "predictions.json").read_text()
    assert captions["a"] == captions["b"]  # train.seed plays no part
    assert captions["a"] != captions["c"]


def test_a_resumed_run_may_change_the_runtime_section(tiny_checkpoint):
    payload = load_checkpoint(tiny_checkpoint)
    saved = config_to_dict(config_from_dict(payload["config"]))
    changed = {
        **saved,
        "runtime": {
            **saved["runtime"],
            "batch_size": 1,
            "precision": "bf16",
            "channels_last": False,
            "parallel_decoder": False,
        },
    }
    check_resume_config(config_from_dict(changed), payload, str(tiny_checkpoint))
    other_seed = {**saved, "train": {**saved["train"], "seed": saved["train"]["seed"] + 1}}
    with pytest.raises(CheckpointError, match="train.seed is 0 in the checkpoint and 1 here"):
        check_resume_config(config_from_dict(other_seed), payload, str(tiny_checkpoint))
    assert torch.is_tensor(next(iter(payload["model"].values())))
