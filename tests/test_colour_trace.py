"""tools.colour_trace's arguments, and the step hook of ``fit`` it probes through."""

import pytest

import tools.colour_trace
from captioning.data.shapes import generate_shapes
from captioning.training.train import fit
from lab import ROOT

from .test_train import tiny


@pytest.fixture(scope="module")
def shapes(tmp_path_factory):
    root = tmp_path_factory.mktemp("shapes")
    generate_shapes(root, num_train=24, num_val=6, num_test=6, seed=0, image_size=48)
    return root


def test_fit_calls_on_step_before_every_step(shapes, tmp_path):
    seen = []
    summary = fit(
        tiny(shapes),
        out_dir=tmp_path / "run",
        on_step=lambda run: seen.append((run.progress.step, run.model.training)),
    )
    assert [step for step, _ in seen] == list(range(summary["steps"]))
    assert all(training for _, training in seen)


def test_bad_arguments_are_one_line_errors(tmp_path, capsys):
    trace = tools.colour_trace
    common = ["--out", str(tmp_path / "out"), "--variant", "v"]
    assert trace.main([*common, "--data-root", str(tmp_path / "none")]) == 2
    assert "no shapes data under" in capsys.readouterr().err
    assert trace.main([*common, "--steps", "0,fifty"]) == 2
    assert "--steps wants steps such as 0,50,100" in capsys.readouterr().err
    assert trace.main([*common, "--set", "train.seed=4"]) == 2
    assert "the trace sets this itself" in capsys.readouterr().err


def test_the_first_words_map_is_as_peaked_as_its_scores_are_large():
    import math

    import torch

    from captioning.config import load_config
    from captioning.models import build_model

    torch.manual_seed(0)
    cfg = load_config(
        ROOT / "configs" / "test_tiny.yaml", ["model.score=general", "model.grid_layers=0"]
    )
    model = build_model(cfg.model, vocab_size=12).eval()
    grid = torch.randn(5, 16, model.decoder.attention.score.query_proj.out_features)
    with torch.no_grad():
        before = tools.colour_trace.first_word_map(model, grid)
        model.decoder.attention.score.query_proj.weight.mul_(1000.0)
        after = tools.colour_trace.first_word_map(model, grid)
    assert 1 / 16 <= before["first_peak"] < after["first_peak"] <= 1.0
    assert math.log(16) >= before["first_entropy"] > after["first_entropy"] >= 0.0
    assert after["first_score_sd"] > 100 * before["first_score_sd"] > 0
    model.decoder.attention = torch.nn.Identity()  # a kind without one score: nothing to read
    assert tools.colour_trace.first_word_map(model, grid) == {}
