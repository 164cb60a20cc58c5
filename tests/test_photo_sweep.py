"""tools.photo_sweep (many recipe runs side by side, one row each) and its two tables."""

from __future__ import annotations

import json

import pytest

from captioning.errors import CaptioningError
from lab.provenance import usable_cores
from tests.conftest import ROOT, load_tool


@pytest.fixture(scope="module")
def sweep():
    return load_tool("photo_sweep")


@pytest.fixture(scope="module")
def tables():
    return load_tool("tables")


def test_jobs_are_checked_before_anything_runs(sweep) -> None:
    ok = [{"name": "xe", "seed": 0}, {"name": "rl", "seed": 0, "init": "xe", "phase": 2}]
    sweep.check_jobs(ok)
    with pytest.raises(CaptioningError, match="listed twice"):
        sweep.check_jobs([{"name": "xe", "seed": 0}, {"name": "xe", "seed": 0}])
    with pytest.raises(CaptioningError, match="lacks 'seed'"):
        sweep.check_jobs([{"name": "xe"}])
    for bad in (
        {"name": "rl", "seed": 0, "init": "xe"},  # same phase
        {"name": "rl", "seed": 1, "init": "xe", "phase": 2},  # another seed
        {"name": "rl", "seed": 0, "init": "nope", "phase": 2},
    ):
        with pytest.raises(CaptioningError, match="earlier phase"):
            sweep.check_jobs([ok[0], bad])


def test_the_shipped_job_lists_are_valid(sweep) -> None:
    for path in sorted((ROOT / "tools" / "photo_sweeps").glob("*.json")):
        jobs = json.loads(path.read_text())
        sweep.check_jobs(jobs)
        assert jobs, path


@pytest.mark.slow  # five trainings in worker processes, each scored twice
def test_a_sweep_trains_side_by_side_starts_from_another_job_and_writes_rows(
    sweep, tiny_shapes, tmp_path
) -> None:
    tiny = ["train.epochs=1", "train.batch_size=8", "model.encoder=small_cnn"]
    jobs = [
        {"name": "xe", "seed": 0, "set": tiny},
        {"name": "xe-lr", "seed": 0, "set": [*tiny, "train.lr=1e-3"]},
        {
            "name": "rl",
            "seed": 0,
            "phase": 2,
            "init": "xe",
            "set": [
                *tiny,
                "train.objective=scst",
                "train.scst_baseline=loo",
                "train.scst_samples=2",
                "train.lr=1e-4",
            ],
        },
    ]
    spec = tmp_path / "jobs.json"
    spec.write_text(json.dumps(jobs))
    results, out = tmp_path / "rows.json", tmp_path / "runs"
    args = [
        "--jobs",
        str(spec),
        "--data",
        str(tiny_shapes),
        "--weights",
        "null",
        "--config",
        str(ROOT / "configs" / "test_tiny.yaml"),
        "--out",
        str(out),
        "--parallel",
        "2",
        "--results",
        str(results),
    ]
    assert sweep.main(args) == 0
    rows = {r["name"]: r for r in json.loads(results.read_text())}
    assert set(rows) == {"xe", "xe-lr", "rl"}
    assert rows["rl"]["init"] == "xe" and rows["xe"]["init"] is None
    for row in rows.values():
        assert 0 <= row["test_CIDEr_beam3"] and 0 <= row["val_CIDEr_beam3"]
        assert row["command"].startswith("python -m tools.photo_sweep --jobs DATA/jobs.json")
        assert row["tokenizer"] in ("ptb", "python") and row["device"]
        assert row["jobs"] == 2 and row["timed_alone"] is False and row["commit"]
        # two jobs side by side share the cores
        assert row["threads"] == max(1, usable_cores() // 2) and row["precision"]
    assert str(tmp_path) not in results.read_text()
    # the self-critical run started from the cross-entropy run's weights
    log = (out / "rl-seed0" / "config.yaml").read_text()
    assert "objective: scst" in log
    # finished runs are scored again, not retrained
    stamp = (out / "xe-seed0" / "best.pt").stat().st_mtime_ns
    assert sweep.main(args) == 0
    assert (out / "xe-seed0" / "best.pt").stat().st_mtime_ns == stamp


@pytest.mark.slow  # a worker process
def test_a_failed_job_is_named_and_the_exit_code_says_so(sweep, tiny_shapes, tmp_path, capsys):
    spec = tmp_path / "jobs.json"
    spec.write_text(json.dumps([{"name": "bad", "seed": 0, "set": ["model.hidden_dim=-3"]}]))
    args = [
        "--jobs",
        str(spec),
        "--data",
        str(tiny_shapes),
        "--weights",
        "null",
        "--config",
        str(ROOT / "configs" / "test_tiny.yaml"),
        "--out",
        str(tmp_path / "r"),
        "--results",
        str(tmp_path / "rows.json"),
    ]
    assert sweep.main(args) == 1
    assert "bad seed 0: failed" in capsys.readouterr().out


def _row(name, seed, test, val=1.0, init=None, settings=()):
    return {
        "name": name,
        "seed": seed,
        "set": list(settings),
        "init": init,
        "val_best": val,
        "test_CIDEr_beam3": test,
        "commit": "abcdef0123",
        "command": "python x",
        "device": "CPU",
        "tokenizer": "ptb",
    }


def test_the_tables_count_the_seeds_above_the_nearest_neighbour(tables) -> None:
    nn = {**_row("nn", None, 1.2), "k": 40, "val_CIDEr_by_k": {"40": 1.1}}
    rows = [
        nn,
        _row("recipe", 0, 1.1),
        _row("recipe", 1, 1.25),
        _row("rl", 0, 1.3, init="recipe", settings=["train.objective=scst"]),
        _row("rl", 1, 1.21, init="recipe", settings=["train.objective=scst"]),
        _row("family-heads", 0, 1.0, settings=["model.heads=2"]),
    ]
    table = tables.photo_sweep(rows).splitlines()
    assert table[2].startswith("| recipe | (the config as it is) |")
    assert table[2].endswith("| 1.100 (0), 1.250 (1) | 1 of 2 |")
    assert table[3].startswith("| rl | from `recipe`: `train.objective=scst` |")
    assert table[3].endswith("| 2 of 2 |")
    assert not any("family-" in line or "| heads" in line for line in table)
    family = tables.photo_family(rows).splitlines()
    assert family[2].startswith("| soft | (additive, the recipe) |")  # mean 1.175 first
    assert family[3].startswith("| heads | `model.heads=2` |")
    assert "test 1.200 at k = 40 (val 1.100)" in family[-1]
    assert "rows of `results/photo_sweep.json`" in table[-1]
    budget = tables.photo_budget(rows).splitlines()
    assert budget[:-1] == table[:-1] and "rows of `results/photo_budget.json`" in budget[-1]
