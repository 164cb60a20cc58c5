"""tools.compare_estimators and tools.estimator_variance: every estimator gets the
settings it needs from the shipped hard config, the rows say which settings differ, one seed
prints no spread, and REINFORCE's variance is measured with the baseline it trains with."""

import importlib
import json
import math

import pytest
import torch

import tools.compare_estimators as compare
import tools.estimator_variance as variance
from captioning.config import load_config
from captioning.models import build_model
from captioning.objectives import Batch
from captioning.objectives.hard_attention import ESTIMATORS
from lab.results import write_results
from tests.conftest import ROOT

HARD = str(ROOT / "configs" / "shapes_hard.yaml")


def test_every_estimator_trains_the_shipped_config_with_the_same_soft_share():
    """configs/shapes_hard.yaml sets exact_soft_p 0.5, which the sampling estimators refuse:
    each gets what it needs, and all train half their minibatches with the expected context."""
    for estimator in ESTIMATORS:
        cfg = compare.estimator_config(HARD, estimator, 1, ["train.epochs=6"], None)
        train = cfg.train
        assert (train.hard_estimator, train.seed, train.epochs) == (estimator, 1, 6)
        assert compare.soft_share_of(cfg) == 0.5
        if estimator == "exact":
            assert train.exact_soft_p == 0.5
        else:
            assert train.exact_soft_p == 0 and train.semi_sampling_p == 0.5
        settings = compare.settings_of(cfg)
        assert settings["soft_share"] == 0.5
        assert (settings["reinforce_weight"] is None) == (estimator in ("gumbel", "exact"))
        assert (settings["entropy_weight"] is None) == (estimator == "exact")
        assert (settings["hard_samples"] is None) != (estimator in ("reinforce_loo", "vimco"))
    never = compare.estimator_config(HARD, "reinforce", 0, [], 0.0).train
    assert never.semi_sampling_p == 1.0 and never.exact_soft_p == 0
    assert compare.estimator_config(HARD, "exact", 0, [], 0.0).train.exact_soft_p == 0


def test_a_refused_config_stops_before_any_run_in_one_line(tmp_path, capsys):
    soft = str(ROOT / "configs" / "shapes_soft.yaml")
    with pytest.raises(SystemExit, match="^error: train.hard_estimator=gumbel trains hard"):
        compare.main(["--config", soft, "--out", str(tmp_path), "--estimators", "gumbel"])
    with pytest.raises(SystemExit):  # the tool sets the mixing itself
        compare.main(["--out", str(tmp_path), "--set", "train.exact_soft_p=0"])
    assert "give the share of expected-context minibatches as --soft-share" in (
        capsys.readouterr().err
    )
    assert not any(tmp_path.iterdir())
    # the paper's wiring for the sampling estimators, although exact would refuse it
    paper = ["model.gate=scalar", "model.context_to_lstm=true"]
    cfg = compare.estimator_config(HARD, "vimco", 0, paper, None)
    assert cfg.model.context_to_lstm and cfg.train.semi_sampling_p == 0.5


def row(estimator, seed, exact, **settings):
    return {
        "estimator": estimator,
        "seed": seed,
        "decode": "expectation",
        "train_seconds": 60.0,
        "soft_share": 0.5,
        "soft_share_per": "batch",
        "reinforce_weight": None,
        "entropy_weight": None,
        "hard_samples": None,
        "exact_match": exact,
        **settings,
    }


def test_the_table_names_the_settings_and_gives_one_seed_no_spread():
    rows = [
        row("exact", 0, 0.9),
        row("reinforce", 0, 0.5, reinforce_weight=0.1, entropy_weight=0.002),
        row("reinforce", 1, 0.7, reinforce_weight=0.1, entropy_weight=0.002),
    ]
    lines = importlib.import_module("tools.tables").hard_estimators(rows).splitlines()
    assert lines[0].startswith("| estimator | decode | seeds | soft minibatches | λ_r | entropy")
    exact, reinforce = lines[2], lines[3]
    assert exact.startswith("| exact | expectation | 0 | 0.5 | – | – | – | 0.900 |")
    assert "±" not in exact and exact.endswith("| 1.0 min |")
    assert reinforce.startswith("| reinforce | expectation | 0,1 | 0.5 | 0.1 | 0.002 | – |")
    assert "0.600 ± 0.141" in reinforce


def tiny_hard_model():
    cfg = load_config(
        ROOT / "configs" / "test_tiny.yaml",
        [
            "model.attention=hard",
            "model.context_to_lstm=false",
            "train.hard_estimator=exact",
            "model.dropout=0.0",
        ],
    )
    torch.manual_seed(0)
    return build_model(cfg.model, 12).eval(), cfg


def tiny_batches(count: int, size: int = 6) -> list[dict]:
    generator = torch.Generator().manual_seed(5)
    batches = []
    for _ in range(count):
        tokens = torch.randint(4, 12, (size, 6), generator=generator)
        tokens[:, 0], tokens[:, -1] = 1, 2
        batches.append(
            {"images": torch.rand(size, 3, 48, 48, generator=generator), "tokens": tokens}
        )
    return batches


def test_reinforce_is_measured_with_its_moving_average_baseline():
    """The baseline is the checkpoint's own when REINFORCE trained it; else the moving
    average (decay 0.9) of the mean sampled reward over other training batches, every one of
    them sampled (no expected-context minibatch is skipped). With it, REINFORCE's variance is
    far below the variance without a baseline."""
    model, cfg = tiny_hard_model()
    state = {"estimator": "reinforce", "baseline": {"value": -7.5, "initialized": True}}
    assert variance.training_baseline(model, cfg, state, []) == (-7.5, "the checkpoint's")
    batches = tiny_batches(4)
    baseline, source = variance.training_baseline(model, cfg, {"estimator": "exact"}, batches)
    assert source == "the moving average over 4 training batches"
    means = []
    for step, batch in enumerate(batches):
        cells = model.grid_shape[0] * model.grid_shape[1]
        objective = variance._objective(cfg, "reinforce", {}, 1, cells)
        with torch.no_grad():
            inputs = Batch(batch["tokens"], batch["images"], step=1_000_000 + step)
            terms = objective.loss(model, inputs)
        means.append(float(terms.reward))
    expected = means[0]
    for mean in means[1:]:
        expected = 0.9 * expected + 0.1 * mean
    assert baseline == pytest.approx(expected, rel=1e-5) and baseline < -5  # log p of 5 words
    measured = tiny_batches(1, size=8)[0]
    reference, rows = variance.measure(
        model, cfg, measured, repeats=6, samples=2, baseline=baseline
    )
    by_name = {r["estimator"]: r for r in rows}
    assert reference["baseline"] == baseline
    plain = by_name["reinforce, no baseline"]["variance"]
    with_baseline = by_name["reinforce (its moving-average baseline)"]["variance"]
    assert math.isfinite(plain) and with_baseline < plain / 5, (plain, with_baseline)
    assert by_name["exact"]["variance"] == 0 and by_name["exact"]["mse_marginal"] < 1e-8


def test_rows_merge_by_estimator_seed_and_decode_mode(tmp_path):
    """A re-run replaces only its own (estimator, seed, decode) rows of the results file."""
    results = tmp_path / "rows.json"
    first = [
        row("exact", 0, 0.2),
        {**row("exact", 0, 0.3), "decode": "argmax"},
        row("vimco", 0, 0.1),
    ]
    results.write_text(json.dumps(first))
    again = [row("exact", 0, 0.25)]
    merged = write_results(results, again, compare.KEY)
    assert [(r["estimator"], r["decode"], r["exact_match"]) for r in merged] == [
        ("exact", "argmax", 0.3),
        ("vimco", "expectation", 0.1),
        ("exact", "expectation", 0.25),
    ]
    assert write_results(tmp_path / "absent.json", again, compare.KEY) == again


def test_the_variance_tool_writes_its_rows_with_where_they_came_from(
    tiny_shapes, tmp_path, monkeypatch
):
    from tests.conftest import _tiny_run

    checkpoint = _tiny_run(
        tiny_shapes,
        tmp_path / "run",
        "model.attention=hard",
        "model.context_to_lstm=false",
        "train.hard_estimator=exact",
    )
    results = tmp_path / "variance.json"
    argv = [
        "--checkpoint",
        str(checkpoint),
        "--batch",
        "4",
        "--repeats",
        "2",
        "--samples",
        "2",
        "--baseline-batches",
        "1",
        "--out",
        str(tmp_path / "out"),
    ]
    assert variance.main([*argv, "--results", str(results)]) == 0
    rows = json.loads(results.read_text())
    assert {r["estimator"] for r in rows} >= {"exact", "reinforce_loo", "vimco"}
    for r in rows:
        assert r["command"].startswith("python -m tools.estimator_variance --checkpoint ")
        assert str(tmp_path) not in r["command"] and r["settings"]["out"] == "OUT"
        assert r["commit"] and r["cores"] >= 1 and r["settings"]["repeats"] == 2
        assert r["reference"]["baseline_source"] and r["precision"] == "fp32"
    assert next(r for r in rows if r["estimator"] == "exact")["variance"] == 0
    # other repeats would replace the rows: refused, the file as it was, unless --replace
    before = results.read_bytes()
    other = [*argv[:5], "3", *argv[6:], "--results", str(results)]
    assert variance.main(other) == 2 and results.read_bytes() == before
    assert variance.main([*other, "--replace"]) == 0 and results.read_bytes() != before
