"""tools.compare_attention (the attention family study's rows) and its two tables
(``python -m tools.tables``)."""

from __future__ import annotations

import importlib
import json
from pathlib import Path

import pytest

import lab.runner as runner
import tools.compare_attention
from captioning.training.step import TrainingError
from captioning.training.train import fit
from tests.conftest import ROOT, TINY_SETTINGS

TINY = [*TINY_SETTINGS, "train.quiet=true"]


@pytest.fixture(scope="module")
def study():
    return tools.compare_attention


@pytest.fixture(scope="module")
def tables():
    return importlib.import_module("tools.tables")


@pytest.mark.slow  # a whole pipeline (make test-slow)
def test_the_study_sweeps_chooses_on_val_adds_seeds_merges_and_resumes(
    study, tiny_shapes, tmp_path, monkeypatch
):
    real = runner.evaluate_checkpoint

    def evaluate(checkpoint, split, **kwargs):
        metrics = real(checkpoint, split=split, **kwargs)
        if split == "val":  # rank the rates: 2e-3 best on val, whatever a few steps learnt
            lr = 1e-3 if "lr0.001-" in str(checkpoint) else 2e-3
            metrics["exact_match"] = {1e-3: 0.25, 2e-3: 0.5}[lr]
        return metrics

    monkeypatch.setattr(runner, "evaluate_checkpoint", evaluate)
    results, out = tmp_path / "family.json", tmp_path / "runs"
    settings = [f"data.root={tiny_shapes}", *TINY]
    common = [
        "--out",
        str(out),
        "--results",
        str(results),
        "--lrs",
        "1e-3,2e-3",
        *(a for s in settings for a in ("--set", s)),
    ]
    assert study.main([*common, "--only", "soft", "--seeds", "0,1", "--threads", "1"]) == 0
    rows = json.loads(results.read_text())
    assert [(r["member"], r["lr"], r["seed"], r["phase"]) for r in rows] == [
        ("soft", 1e-3, 0, "sweep"),
        ("soft", 2e-3, 0, "sweep"),
        ("soft", 2e-3, 1, "seeds"),  # at the rate that was best on val
    ]
    row = rows[2]
    assert row["config"] == "configs/shapes_soft.yaml" and row["change"] == []
    # every setting: both rates (the config's ratio, 1), the seed, the thread count, --set
    assert row["overrides"][:3] == ["train.lr=0.002", "train.encoder_lr=0.002", "train.seed=1"]
    assert "train.threads=1" in row["overrides"] and f"data.root={tiny_shapes}" in row["overrides"]
    assert row["encoder_lr"] == 0.002 and row["select_metric"] == "exact_match"
    assert row["blocks"] == "preact"  # the small CNN's, as the config resolved it
    assert row["val_select"] == 0.5 and set(row["val"]) == set(row["test"])
    assert 0 <= row["test"]["exact"] <= 1 and row["test"]["centre_pointing"] is None
    assert row["parameters"] > 0 and row["steps"] == 3 and row["steps_per_s"] > 0
    assert row["command"].startswith("python -m tools.compare_attention --out OUT ")
    assert len(row["commit"]) >= 7 and row["threads"] == 1 and row["timed_alone"] is True
    # the folders are the runs: the same rows again without training, merged with another
    # member's (local attention, its own config and its predicted centre)
    monkeypatch.setattr(runner, "fit", lambda *a, **k: pytest.fail("retrained a finished run"))
    assert study.main([*common, "--only", "soft", "--seeds", "0,1"]) == 0
    assert json.loads(results.read_text())[2]["test"] == row["test"]
    monkeypatch.undo()
    assert study.main([*common, "--only", "local", "--lrs", "1e-3", "--seeds", "0"]) == 0
    rows = json.loads(results.read_text())
    assert [(r["member"], r["lr"], r["seed"]) for r in rows] == [
        ("soft", 1e-3, 0),
        ("soft", 2e-3, 0),
        ("soft", 2e-3, 1),
        ("local", 1e-3, 0),
    ]
    assert rows[3]["config"] == "configs/shapes_local.yaml"
    # the centre's pointing is scored wherever a caption named an object (a one-epoch model
    # may name none: then neither is scored)
    local = rows[3]["test"]
    pointed = [local[f"pointing_{w}"] for w in ("color", "size", "shape")]
    if local["centre_pointing"] is None:
        assert pointed == [None, None, None]
    else:
        assert 0 <= local["centre_pointing"] <= 1 and any(p is not None for p in pointed)


def test_a_run_stopped_part_way_resumes_and_a_failed_one_stays_failed(
    study, tiny_shapes, tmp_path, monkeypatch
):
    extra = [f"data.root={tiny_shapes}", *TINY]
    folder = study.run_folder(tmp_path, "none", 1e-3, 0)
    config, overrides = study.settings("none", 1e-3, 0, extra)
    fit(study.load_config(ROOT / config, overrides), folder)  # one of two epochs
    resumed = []
    monkeypatch.setattr(runner, "fit", lambda *a, **k: resumed.append(k) or fit(*a, **k))
    row = study.train_and_evaluate(tmp_path, "none", 1e-3, 0, [*extra, "train.epochs=2"])
    assert resumed == [{"resume": str(folder / "last.pt"), "init": None}] and row["steps"] == 6

    def diverge(cfg, out_dir, resume=None, init=None):
        Path(out_dir).mkdir(parents=True)
        raise TrainingError("non-finite loss at step 2 (epoch 1)")

    monkeypatch.setattr(runner, "fit", diverge)
    row = study.train_and_evaluate(tmp_path, "soft-dot", 8e-3, 0, extra)
    assert row["failed"].startswith("non-finite loss") and "test" not in row
    monkeypatch.setattr(runner, "fit", lambda *a, **k: pytest.fail("retrained a failed run"))
    assert study.train_and_evaluate(tmp_path, "soft-dot", 8e-3, 0, extra) == row
    assert study.chosen_lr([row], "soft-dot", 0) is None


def test_bad_arguments_are_one_line_errors(study, capsys) -> None:
    with pytest.raises(SystemExit, match="--lrs wants comma-separated numbers"):
        study.main(["--lrs", "fast"])
    with pytest.raises(SystemExit):
        study.main(["--only", "soft", "nope"])
    assert "unknown member 'nope'; --list names them" in capsys.readouterr().err
    assert study.main(["--list"]) == 0
    listing = capsys.readouterr().out
    for name in ("none", "soft-general", "local", "multi-head-8", "hard"):
        assert f"\n{name} " in "\n" + listing
    assert "configs/shapes_local.yaml" in listing and "model.heads=4" in listing


def _scores(exact: float, centre: float | None = None) -> dict:
    return {
        "exact": exact,
        "exact_3_objects": exact - 0.1,
        "pointing_color": 0.9,
        "pointing_size": 0.8,
        "pointing_shape": 0.7,
        "centre_pointing": centre,
        "mass_in_box": 0.5,
        "Bleu_4": 0.9,
        "CIDEr": 8.0,
    }


def _row(member: str, lr: float, seed: int, val: float, exact: float, **extra) -> dict:
    return {
        "member": member,
        "lr": lr,
        "seed": seed,
        "phase": "sweep" if seed == 0 else "seeds",
        "select_metric": "exact_match",
        "val_select": val,
        "val": _scores(val),
        "test": _scores(exact),
        "parameters": 750_000,
        "train_seconds": 120.0,
        "precision": "bf16",
        "commit": "abcdef1234",
        "command": "python -m tools.x",
        "cores": 2,
        "cpu": "cpu",
        "torch": "2.6",
        "timed_alone": True,
        **extra,
    }


def _failed(member: str, lr: float) -> dict:
    row = _row(member, lr, 0, 0.0, 0.0, failed="non-finite loss at step 7 (epoch 1)")
    for key in ("val", "val_select", "test", "parameters", "train_seconds", "precision"):
        del row[key]
    return row


def test_the_family_table_gives_each_member_at_its_rate_with_its_seeds(tables, tmp_path):
    rows = [
        _row("soft", 1e-3, 0, 0.90, 0.91),
        _row("soft", 4e-3, 0, 0.98, 0.97),
        _row("soft", 4e-3, 1, 0.0, 0.95),
        _row("soft", 4e-3, 2, 0.0, 0.05),
        _row("soft", 1e-3, 1, 0.0, 0.10),  # a seed of an earlier choice: not in the table
        _row("soft-dot", 4e-3, 0, 0.40, 0.41),  # one seed: no ±
        _failed("soft-dot", 8e-3),
        {**_row("local", 2e-3, 0, 0.5, 0.6), "test": _scores(0.6, centre=0.4)},
        _failed("soft-general", 4e-3),
        _failed("soft-general", 8e-3),
    ]
    rows[-1]["commit"] = "1234567890+dirty"
    (tmp_path / "attention_family.json").write_text(json.dumps(rows))
    text = "<!-- table: attention_family -->\n<!-- end table -->\n"
    out = tables.render(text, tmp_path)
    assert tables.render(out, tmp_path) == out  # rendering is idempotent
    lines = out.splitlines()
    assert lines[3] == (
        "| soft | 0.004 | 0.657 ± 0.525 | 0.970 (0), 0.950 (1), 0.050 (2) | 0.557 "
        "| 0.900 / 0.800 / 0.700 | – | 0.500 | 0.900 | 8.000 | 0.75M | 2.0 min |"
    )
    assert lines[4].startswith("| soft-dot | 0.004 | 0.410 | 0.410 (0) | 0.310 |")
    assert lines[5].startswith("| local | 0.002 | 0.600 | 0.600 (0) | 0.500 | 0.900 / ")
    assert lines[5].split(" | ")[6] == "0.400"  # the predicted centre's pointing game
    assert lines[6] == (
        "| soft-general | – | failed at every rate (0.004, 0.008) | – | – | – | – | – | – | – "
        "| – | – |"
    )
    assert "10 rows of `results/attention_family.json`, commit 1234567+dirty, abcdef1" in lines[8]
    assert "2 cores (cpu), torch 2.6, bf16" in lines[8]


def test_hard_attention_gets_a_line_per_decoding_mode(tables) -> None:
    row = _row(
        "hard",
        4e-3,
        0,
        0.98,
        0.98,
        test_by_hard_context={
            "expectation": _scores(0.98),
            "argmax": _scores(0.97),
            "sample": _scores(0.9),
        },
    )
    lines = tables.attention_family([row]).splitlines()
    assert [line.split(" | ")[0:3] for line in lines[2:5]] == [
        ["| hard (expectation)", "0.004", "0.980"],
        ["| hard (argmax)", "0.004", "0.970"],
        ["| hard (sample)", "0.004", "0.900"],
    ]


def test_the_sweep_appendix_gives_every_rate_and_marks_the_chosen(tables, study) -> None:
    rows = [
        _row("soft", 1e-3, 0, 0.90, 0.0),
        _row("soft", 4e-3, 0, 0.98, 0.0),
        _row("soft", 4e-3, 1, 0.99, 0.0),  # a seed row: not the sweep's
        _row("soft-dot", 2e-3, 0, 0.40, 0.0),
        _row("soft-dot", 4e-3, 0, 0.40, 0.0),  # a tie: the lower rate
        _failed("soft-dot", 8e-3),
    ]
    lines = tables.attention_family_sweep(rows).splitlines()
    assert lines[0] == "| member | lr 0.001 | lr 0.002 | lr 0.004 | lr 0.008 |"
    assert lines[2] == "| soft | 0.900 | – | **0.980** | – |"
    assert lines[3] == "| soft-dot | – | **0.400** | 0.400 | failed |"
    assert "Validation exact_match at seed 0" in lines[5]
    # the renderer and the study choose alike
    for member in ("soft", "soft-dot"):
        group = [r for r in rows if r["member"] == member]
        assert tables._chosen_lr(group) == study.chosen_lr(group, member, 0)


def test_without_its_results_file_a_table_says_so(tables, tmp_path) -> None:
    text = "<!-- table: attention_family_sweep -->\nold\n<!-- end table -->\n"
    assert "(results/attention_family.json is not there yet.)\n<!-- end" in tables.render(
        text, tmp_path
    )


def test_rows_of_other_blocks_sit_beside_the_first_studys(study, tmp_path) -> None:
    from lab.results import write_results

    path = tmp_path / "family.json"
    old = {"member": "soft", "lr": 0.004, "seed": 0, "test": {"exact": 0.06}}  # before blocks
    new = {**old, "blocks": "preact", "test": {"exact": 0.99}}
    write_results(path, [old], study.row_key)
    rows = write_results(path, [new], study.row_key)
    assert [r["test"]["exact"] for r in rows] == [0.06, 0.99]
    assert study.row_key(old) == ("soft", 0.004, 0, "plain")
