"""benchmarks.photos's bookkeeping (the recipe itself is tests/test_photos.py, slow)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import photos
from lab.results import ResultsError, write_results
from tests.conftest import ROOT, TINY_SETTINGS


def _row(model: str, seed: int | None, cider: float, variant: str | None = None) -> dict:
    row = {"model": model, "seed": seed, "CIDEr": cider}
    if variant is not None:
        row["variant"] = variant
    return row


def test_merge_keeps_other_variants_and_replaces_the_same_run(tmp_path: Path) -> None:
    path = tmp_path / "results.json"
    earlier = [_row("nn", None, 1.2), _row("soft", 0, 1.1), _row("soft", 0, 1.0, "smooth")]
    path.write_text(json.dumps(earlier))
    new = [_row("soft", 0, 1.3, "smooth"), _row("none", 1, 0.9, "recipe")]
    merged = write_results(path, new, photos.key, order=photos.order)
    keys = [(r.get("variant", "recipe"), r["model"], r["seed"], r["CIDEr"]) for r in merged]
    assert keys == [
        ("recipe", "nn", None, 1.2),
        ("recipe", "none", 1, 0.9),
        ("recipe", "soft", 0, 1.1),  # a row without a variant is the recipe's: kept
        ("smooth", "soft", 0, 1.3),  # the same variant, model and seed: replaced
    ]
    # a row of other settings does not replace a committed one unless asked
    other = {**_row("soft", 0, 1.4, "smooth"), "overrides": ["model.dropout=0.5"]}
    path.write_text(json.dumps([{**merged[-1], "overrides": ["model.dropout=0.3"]}]))
    with pytest.raises(ResultsError, match="other overrides"):
        write_results(path, [other], photos.key, order=photos.order)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--variant", "a b"], "--variant must be a plain name"),
        (["--variant", "smooth", "--models", "nn,soft"], "leave nn out of --models"),
    ],
)
def test_bad_variants_are_refused(argv, message, tmp_path: Path, capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        photos.main(["--shared", str(tmp_path), "--out", str(tmp_path / "out"), *argv])
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_then_needs_a_variant_and_then_set_needs_then(tmp_path: Path, capsys) -> None:
    base = ["--shared", str(tmp_path), "--out", str(tmp_path / "out"), "--models", "soft"]
    for argv, message in [
        (["--then", "configs/photos_scst.yaml"], "name its rows with --variant"),
        (["--variant", "b", "--then-set", "train.lr=1e-4"], "name its config with --then"),
    ]:
        with pytest.raises(SystemExit) as exc:
            photos.main([*base, *argv])
        assert exc.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.slow  # two tiny trainings and an evaluation
def test_a_second_stage_starts_from_the_first_and_its_seconds_count(
    tiny_shapes: Path, tmp_path: Path
) -> None:
    from captioning.checkpoint import load_checkpoint

    config = str(ROOT / "configs" / "test_tiny.yaml")
    second = [*TINY_SETTINGS, "train.objective=scst", "train.scst_samples=2", "train.lr=1e-4"]
    specs = photos.model_specs(
        config,
        (f"data.root={tiny_shapes}",),
        TINY_SETTINGS,
        "soft",
        0,
        tmp_path,
        1,
        variant="two",
        then=(config, second),
    )
    [row] = photos.run_models(specs, threads=1)
    first = tmp_path / "runs" / "two" / "soft-seed0"
    last = tmp_path / "runs" / "two" / "soft-seed0-then"
    assert load_checkpoint(last / "best.pt")["config"]["train"]["objective"] == "scst"
    assert load_checkpoint(first / "best.pt")["config"]["train"]["objective"] == "xe"
    stage = row["then"]
    assert stage["overrides"] == second and stage["first_seconds"] > 0
    first_seconds = json.loads((first / "summary.json").read_text())["seconds"]
    last_seconds = json.loads((last / "summary.json").read_text())["seconds"]
    assert row["train_seconds"] == pytest.approx(first_seconds + last_seconds, abs=0.01)
    assert 0 <= row["CIDEr"] and row["steps"] > 0 and row["evaluate_seconds"] > 0
    assert row["precision"] in ("fp32", "bf16") and row["threads"] == 1 and row["device"]
    assert f"data.root=DATA/{tiny_shapes.name}" in row["overrides"]  # no machine's path
