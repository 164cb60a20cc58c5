"""docs/extending.md's worked examples, run as written there: a score registered from
outside the package trains, its loss falls, and its checkpoint captions."""

import json
import re
from pathlib import Path

import pytest
import torch

import captioning
from captioning import objectives
from captioning.config import load_config
from captioning.models import attention, encoder, scores
from captioning.training.train import fit

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def registries():
    """Every registry as it was before the test: a name a test registers goes with it."""
    kept = [
        (registry, dict(registry))
        for registry in (
            scores.SCORES,
            attention.ATTENTIONS,
            encoder.ENCODERS,
            objectives.OBJECTIVES,
        )
    ]
    yield
    for registry, entries in kept:
        registry.clear()
        registry.update(entries)


def code_blocks(section: str) -> list[str]:
    """The Python blocks of one ``## section`` of docs/extending.md, in order."""
    text = (ROOT / "docs" / "extending.md").read_text()
    body = text.split(f"## {section}\n", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```python\n(.*?)```", body, re.S)


def test_a_score_registered_from_a_file_of_its_own_trains(tiny_shapes, tmp_path, monkeypatch):
    define, train = code_blocks("A score function")
    namespace: dict = {}
    exec(compile(define, "extending.md", "exec"), namespace)
    assert "distance" in scores.SCORES
    monkeypatch.chdir(ROOT)
    run = {"shapes": tiny_shapes, "out": tmp_path / "run"}
    exec(compile(train, "extending.md", "exec"), run)
    checkpoint = torch.load(tmp_path / "run" / "last.pt", weights_only=True)
    assert checkpoint["config"]["model"]["score"] == "distance"
    assert any(k.endswith("score.key_proj.weight") for k in checkpoint["model"])
    history = checkpoint["history"]
    assert history[-1]["loss"] < history[0]["loss"]  # it learns
    caption = captioning.load(tmp_path / "run" / "best.pt", device="cpu").caption(
        str(next((tiny_shapes / "images" / "test").iterdir()))
    )
    assert caption.words and caption.alphas.shape[0] == len(caption.words)


def test_a_score_name_taken_twice_or_unknown_is_refused():
    with pytest.raises(ValueError, match="'dot' is already registered"):
        scores.register_score("dot", lambda sizes: None)
    with pytest.raises(captioning.errors.ConfigError, match="model.score must be one of"):
        scores.make_score("no_such_score", 4, 4, 4)


def test_an_objective_registered_from_a_file_of_its_own_trains(tiny_shapes, tmp_path, monkeypatch):
    define, train = code_blocks("An objective")
    namespace: dict = {}
    exec(compile(define, "extending.md", "exec"), namespace)
    assert "word_mean" in objectives.OBJECTIVES
    calls = []
    cls = namespace["WordMeanObjective"]
    real_loss = cls.loss
    monkeypatch.setattr(
        cls, "loss", lambda self, *a, **k: calls.append(1) or real_loss(self, *a, **k)
    )
    monkeypatch.chdir(ROOT)
    exec(compile(train, "extending.md", "exec"), {"shapes": tiny_shapes, "out": tmp_path / "run"})
    assert calls  # training went through the registered objective
    checkpoint = torch.load(tmp_path / "run" / "last.pt", weights_only=True)
    assert checkpoint["config"]["train"]["objective"] == "word_mean"
    history = checkpoint["history"]
    assert history[-1]["nll_per_token"] < history[0]["nll_per_token"]  # it learns
    caption = captioning.load(tmp_path / "run" / "best.pt", device="cpu").caption(
        str(next((tiny_shapes / "images" / "test").iterdir()))
    )
    assert caption.words


def test_an_objective_name_taken_twice_or_unknown_is_refused(tiny_shapes, tmp_path):
    with pytest.raises(ValueError, match="'xe' is already registered"):
        objectives.register_objective("xe", lambda context: None)
    cfg = load_config(
        ROOT / "configs" / "test_tiny.yaml", [f"data.root={tiny_shapes}", "train.objective=nope"]
    )
    with pytest.raises(
        captioning.errors.ConfigError,
        match="one of scst, xe, got .nope.; objectives.register_objective adds",
    ):
        fit(cfg, out_dir=tmp_path / "run")


def trained(section, shapes, out, monkeypatch):
    """Run a section's two blocks (define, then train) and return the last checkpoint."""
    define, train = code_blocks(section)
    exec(compile(define, "extending.md", "exec"), {})
    monkeypatch.chdir(ROOT)
    exec(compile(train, "extending.md", "exec"), {"shapes": shapes, "out": out})
    return torch.load(out / "last.pt", weights_only=True)


def test_an_attention_registered_from_a_file_of_its_own_trains(tiny_shapes, tmp_path, monkeypatch):
    checkpoint = trained("An attention", tiny_shapes, tmp_path / "run", monkeypatch)
    assert checkpoint["config"]["model"]["attention"] == "top4"
    history = checkpoint["history"]
    assert history[-1]["nll_per_token"] < history[0]["nll_per_token"]  # it learns
    model = captioning.load(tmp_path / "run" / "best.pt", device="cpu")
    image = str(next((tiny_shapes / "images" / "test").iterdir()))
    caption = model.caption(image, beam_size=3)
    alpha = caption.alphas.flatten(1)  # (T, rows * cols)
    assert caption.words and caption.alphas.shape == (len(caption.words), *model.grid_shape)
    assert ((alpha > 0).sum(dim=1) <= 4).all()  # four cells at most, every word
    torch.testing.assert_close(alpha.sum(dim=1), torch.ones(len(alpha)))


def test_an_encoder_registered_from_a_file_of_its_own_trains(tiny_shapes, tmp_path, monkeypatch):
    checkpoint = trained("An encoder", tiny_shapes, tmp_path / "run", monkeypatch)
    assert checkpoint["config"]["model"]["encoder"] == "patches"
    assert "encoder.stages.0.0.weight" in checkpoint["model"]
    history = checkpoint["history"]
    assert history[-1]["nll_per_token"] < history[0]["nll_per_token"]  # it learns
    model = captioning.load(tmp_path / "run" / "best.pt", device="cpu")
    assert model.grid_shape == (6, 6)  # 48 px in 8 px patches
    caption = model.caption(str(next((tiny_shapes / "images" / "test").iterdir())))
    assert caption.words


def test_an_attention_or_encoder_name_taken_twice_is_refused():
    with pytest.raises(ValueError, match="'soft' is already registered"):
        attention.register_attention("soft", lambda cfg, sizes: None)
    with pytest.raises(ValueError, match="'small_cnn' is already registered"):
        encoder.register_encoder("small_cnn", lambda cfg: None)


def test_a_study_written_as_the_guide_says_trains_records_and_reuses_its_runs(
    tiny_shapes, tmp_path, monkeypatch
):
    [module] = code_blocks("A study")
    study: dict = {"__name__": "dropout_study"}
    exec(compile(module, "extending.md", "exec"), study)
    monkeypatch.chdir(ROOT)
    out = tmp_path / "dropout"
    argv = ["--out", str(out), "--seeds", "0-1", "--set", f"data.root={tiny_shapes}"]
    argv += ["--set", "train.epochs=1", "--set", "data.max_images=12"]
    assert study["main"](argv) == 0
    rows = json.loads((out / "rows.json").read_text())
    assert sorted((r["variant"], r["seed"]) for r in rows) == [
        ("half", 0),
        ("half", 1),
        ("none", 0),
        ("none", 1),
    ]
    for row in rows:
        assert 0 <= row["CIDEr"] and row["train_seconds"] > 0 and row["commit"]
        assert row["command"].startswith("python -m tools.dropout_study --out OUT")
        assert str(tmp_path) not in row["command"].replace(str(tiny_shapes), "")
    stamps = {p: p.stat().st_mtime_ns for p in out.glob("*/last.pt")}
    assert len(stamps) == 4
    assert study["main"](argv) == 0  # finished runs are reused, not trained again
    assert {p: p.stat().st_mtime_ns for p in out.glob("*/last.pt")} == stamps
    assert study["main"]([*argv[:2], "--seeds", "x"]) == 2  # a user's error: one line, exit 2
