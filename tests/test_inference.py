"""The inference side: one decode path for validation, evaluate and caption; one rule for
which words a figure shows; checkpoints of the previous format still load."""

import json
from pathlib import Path

import pytest
import torch

import captioning.training.train as train_module
from captioning.checkpoint import FORMAT_VERSION, load_checkpoint
from captioning.cli import main
from captioning.config import load_config, replace_section
from captioning.data import CaptionDataset, load_splits
from captioning.data.shapes import generate_shapes
from captioning.data.vocab import Vocabulary
from captioning.errors import CheckpointError, ConfigError
from captioning.evaluate import evaluate_checkpoint
from captioning.inference.caption import (
    Caption,
    caption_files,
    decode_dataset,
    load_model,
    with_decoding,
)
from captioning.inference.decoding import Decoded
from captioning.models.trace import AttentionTrace
from captioning.training.train import fit, validate

from .test_train import CONFIG, tiny

DATA = Path(__file__).resolve().parent / "data"


@pytest.fixture(scope="module")
def shapes(tmp_path_factory):
    root = tmp_path_factory.mktemp("shapes")
    generate_shapes(root, num_train=24, num_val=6, num_test=6, seed=0, image_size=48)
    return root


@pytest.fixture(scope="module")
def bf16_run(shapes, tmp_path_factory):
    run = tmp_path_factory.mktemp("bf16")
    fit(tiny(shapes, "train.precision=bf16", "train.epochs=1"), out_dir=run)
    return run / "best.pt"


def test_validation_evaluate_and_caption_decode_alike(shapes, bf16_run, tmp_path):
    """A bf16 model's captions are the same whichever command produces them."""
    model, cfg, vocab = load_model(bf16_run)
    val = load_splits(cfg.data)["val"]
    dataset = CaptionDataset(val, vocab, model.encoder.transform)
    _, validated, _ = validate(model, dataset, cfg, torch.device("cpu"))
    evaluated = evaluate_checkpoint(bf16_run, split="val", out_dir=tmp_path, progress=False)
    predictions = json.loads((tmp_path / "predictions.json").read_text())
    assert {p["image_id"]: p["caption"] for p in predictions} == validated
    assert evaluated["decoding"]["precision"] == "bf16"
    results = caption_files([r.path for r in val], model, vocab, cfg, torch.device("cpu"))
    assert [r.caption for r in results] == [validated[r.image_id] for r in val]


def test_caption_verb_decodes_under_the_run_precision(shapes, bf16_run, monkeypatch, capsys):
    seen = []
    real = torch.autocast

    def spy(*args, **kwargs):
        seen.append(kwargs.get("dtype"))
        return real(*args, **kwargs)

    monkeypatch.setattr(torch, "autocast", spy)
    image = sorted((shapes / "images" / "test").glob("*.png"))[0]
    assert main(["caption", str(image), "--checkpoint", str(bf16_run), "--quiet"]) == 0
    assert seen == [torch.bfloat16]


def test_a_figure_shows_the_words_of_the_caption_and_not_end():
    vocab = Vocabulary(["<pad>", "<start>", "<end>", "<unk>", "red", "circle"])
    alphas = torch.softmax(torch.randn(4, 6), dim=1)  # (T, L): red, circle, <end>, pad
    decoded = Decoded(
        tokens=torch.tensor([4, 5, 0, 0]),
        lengths=torch.tensor(2),
        scores=torch.tensor(-1.0),
        trace=AttentionTrace(alphas, cell=torch.tensor([3, 1, 0, 0])),
    )
    result = Caption.from_decoded("x.png", decoded, vocab)
    assert result.caption == "red circle" and result.words == ["red", "circle"]
    assert torch.equal(result.alphas, alphas[:2]) and result.cells == [3, 1]
    assert result.heads is None and result.centres is None
    heads = torch.softmax(torch.randn(4, 2, 6), dim=2)  # (T, H, L)
    centres = torch.rand(4, 2) * 3  # (T, 2)
    decoded.trace = AttentionTrace(alphas, heads=heads.double(), centre=centres)
    result = Caption.from_decoded("x.png", decoded, vocab, grid=(2, 3))
    assert result.alphas.shape == (2, 2, 3) and result.cells is None
    assert result.heads.dtype == torch.float32
    torch.testing.assert_close(result.heads, heads[:2].view(2, 2, 2, 3).float())
    assert torch.equal(result.centres, centres[:2])
    with pytest.raises(AttributeError, match="'Caption' object has no attribute 'glance'"):
        _ = result.glance


def test_epoch_figures_follow_the_caption_rule(shapes, tmp_path, monkeypatch):
    drawn = []
    real = train_module.draw_attention

    def spy(result, grid_shape, out_dir, stem, **kwargs):
        drawn.append((result, stem))
        return real(result, grid_shape, out_dir, stem, **kwargs)

    monkeypatch.setattr(train_module, "draw_attention", spy)
    fit(
        tiny(shapes, "train.epochs=1", "decode.min_length=2", "train.figure_every_epoch=true"),
        out_dir=tmp_path / "run",
    )
    ((result, stem),) = drawn
    assert stem == "epoch_001" and (tmp_path / "run" / "figures" / "epoch_001.png").is_file()
    assert "<end>" not in result.words and len(result.words) == result.alphas.shape[0]
    model, cfg, vocab = load_model(tmp_path / "run" / "last.pt")
    first = load_splits(cfg.data)["val"][0]
    (captioned,) = caption_files([first.path], model, vocab, cfg, torch.device("cpu"))
    assert captioned.words == result.words
    # batch of 1 vs 6: rounding
    torch.testing.assert_close(captioned.trace.alpha, result.trace.alpha)


def test_with_decoding_turns_a_beam_size_into_a_strategy():
    cfg = load_config(CONFIG)
    assert with_decoding(cfg).decode == cfg.decode
    assert with_decoding(cfg, beam_size=1).decode.strategy == "greedy"
    beam = with_decoding(cfg, beam_size=4, hard_context="argmax").decode
    assert (beam.strategy, beam.beam_size, beam.hard_context) == ("beam", 4, "argmax")


def test_a_version_1_checkpoint_loads_and_decodes_as_before(shapes, tmp_path):
    """tests/data/checkpoint_v1.pt was written by the code before the format-2 rename (a hard
    model with train.doubly_stochastic=0.5 and decode.hard_decode=argmax); its captions
    were decoded by that code."""
    payload = load_checkpoint(DATA / "checkpoint_v1.pt")
    assert payload["format_version"] == FORMAT_VERSION
    assert payload["config"]["train"]["doubly_stochastic_weight"] == 0.5
    assert payload["config"]["decode"]["hard_context"] == "argmax"
    assert isinstance(payload["rng"], list) and len(payload["rng"]) == 1
    model, cfg, vocab = load_model(DATA / "checkpoint_v1.pt")
    assert cfg.decode.hard_context == "argmax" and cfg.model.attention == "hard"
    assert not cfg.decode.allow_unk  # its decode.suppress_unk=false is retired on load
    test = load_splits(load_config(CONFIG, [f"data.root={shapes}"]).data)["test"]
    dataset = CaptionDataset(test, vocab, model.encoder.transform)
    cpu = torch.device("cpu")
    before = json.loads((DATA / "checkpoint_v1_captions.json").read_text())
    # that code let decoding choose <unk>; with it allowed, the captions are the same
    allowed = replace_section(cfg, "decode", allow_unk=True)
    captions, _ = decode_dataset(model, dataset, allowed, cpu)
    assert {str(k): v for k, v in captions.items()} == before
    captions, _ = decode_dataset(model, dataset, cfg, cpu)
    assert not any("<unk>" in c for c in captions.values())
    assert any("<unk>" in c for c in before.values())
    # and a run resumes from it
    resume_cfg = load_config(
        CONFIG,
        [
            f"data.root={shapes}",
            "model.attention=hard",
            "model.gate=none",
            "train.epochs=2",
            "train.doubly_stochastic_weight=0.5",
            "model.cnn_block=plain",  # its plain blocks
        ],
    )
    summary = fit(resume_cfg, out_dir=tmp_path / "run", resume=str(DATA / "checkpoint_v1.pt"))
    assert summary["epochs"] == 2 and summary["steps"] == 6


def test_old_config_key_names_say_what_they_became(tmp_path):
    with pytest.raises(ConfigError, match="renamed to train.doubly_stochastic_weight"):
        load_config(CONFIG, ["train.doubly_stochastic=0.5"])
    old = tmp_path / "old.yaml"
    old.write_text("decode:\n  hard_decode: argmax\n")
    with pytest.raises(ConfigError, match="decode.hard_decode was renamed to decode.hard_context"):
        load_config(old)


def test_train_writes_to_runs_named_after_the_config(shapes, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    args = [
        "train",
        "--config",
        CONFIG,
        "--set",
        f"data.root={shapes}",
        "--set",
        "train.epochs=1",
        "--quiet",
    ]
    assert main(args) == 0
    assert (tmp_path / "runs" / "test_tiny" / "last.pt").is_file()


@pytest.mark.parametrize(
    ("version", "block", "old_keys"),
    [
        (3, "plain", {}),  # version 3 knew only plain blocks, and no key for them
        (4, "plain", {"cnn_residual": False}),
        (4, "residual", {"cnn_residual": True}),
    ],
)
def test_older_checkpoints_rebuild_their_small_cnn(tmp_path, version, block, old_keys):
    """Version 3 had only plain conv-BN-ReLU blocks and version 4 said plain or residual
    with ``cnn_residual``; each loads with its own blocks and the same weights, while a new
    run's blocks are pre-activation ones."""
    from captioning.config import config_to_dict
    from captioning.models import build_model
    from captioning.models.encoder import PreActBlock, ResidualBlock

    cfg = load_config(CONFIG, [f"model.cnn_block={block}"])
    vocab = Vocabulary.build([["a", "red", "circle"]], min_count=1)
    torch.manual_seed(0)
    original = build_model(cfg.model, len(vocab))
    saved = config_to_dict(cfg)
    del saved["model"]["cnn_block"]  # neither version knew the key
    saved["model"].update(old_keys)
    torch.save(
        {
            "format_version": version,
            "model": original.state_dict(),
            "config": saved,
            "vocab": vocab.to_list(),
            "epoch": 1,
            "step": 1,
        },
        tmp_path / "old.pt",
    )
    model, loaded_cfg, _ = load_model(tmp_path / "old.pt")
    assert loaded_cfg.model.cnn_block == block
    residual_blocks = sum(isinstance(m, ResidualBlock) for m in model.modules())
    assert residual_blocks == (2 if block == "residual" else 0)
    for name, tensor in original.state_dict().items():
        assert torch.equal(model.state_dict()[name], tensor), name
    fresh = build_model(load_config(CONFIG).model, len(vocab))  # cnn_channels: [8, 16, 32]
    assert sum(isinstance(m, PreActBlock) for m in fresh.modules()) == 2


def test_the_retired_cnn_residual_key_names_its_successor():
    with pytest.raises(ConfigError, match="model.cnn_residual was replaced by model.cnn_block"):
        load_config(CONFIG, ["model.cnn_residual=false"])


@pytest.mark.parametrize("encoder", ["small_cnn", "mobilenet_v2"])
def test_init_and_resume_ignore_small_cnn_keys_of_another_encoder(tmp_path, encoder):
    """A version-4 checkpoint says its small CNN's blocks even when its encoder is another
    (``cnn_residual`` upgrades to ``cnn_block``); with another encoder those keys build
    nothing, so --init and --resume accept today's default for them, and refuse it only for
    a small CNN."""
    from captioning.config import config_to_dict
    from captioning.training.run_state import check_resume_config, load_init

    ours = load_config(CONFIG, [f"model.encoder={encoder}", "model.weights=null"])
    saved = config_to_dict(ours)
    del saved["model"]["cnn_block"]
    saved["model"]["cnn_residual"] = False  # upgraded to cnn_block plain
    path = tmp_path / "old.pt"
    torch.save(
        {
            "format_version": 4,
            "model": {},
            "config": saved,
            "vocab": ["<pad>"],
            "epoch": 1,
            "step": 1,
            "optimizer": {},
            "scheduler": {},
            "objective": {},
            "rng": {},
        },
        path,
    )
    assert ours.model.cnn_block == "preact"
    if encoder == "small_cnn":
        with pytest.raises(CheckpointError, match="model.cnn_block is 'plain' in the checkpoint"):
            load_init(ours, str(path))
    else:
        assert load_init(ours, str(path))["config"]["model"]["cnn_block"] == "plain"
        check_resume_config(ours, load_checkpoint(path), str(path))
