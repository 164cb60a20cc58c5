"""benchmarks.time_to_quality: which runs, the targets, and the table of its rows."""

from __future__ import annotations

import pytest

from benchmarks import time_to_quality as ttq
from tests.conftest import load_tool


def test_runs_parse_and_bad_ones_are_named() -> None:
    assert ttq.parse_runs("soft:0, hard:12,quickstart") == [
        ("soft", 0),
        ("hard", 12),
        ("quickstart", None),
    ]
    for bad in ("soft", "hard:x", "quickstart:1", "beam:0", ","):
        with pytest.raises(ValueError, match="--runs"):
            ttq.parse_runs(bad)


def _row(recipe: str, seconds: float, exact: float, three: float, pointing: float) -> dict:
    metrics = {
        "exact_match": exact,
        "exact_match_by_objects": {"1": 1.0, "3": three},
        "grounding_by_word_type": {
            "pointing_game/color": pointing,
            "pointing_game/size": 0.99,
            "pointing_game/category": 0.98,
        },
    }
    row = {
        "kind": "quality",
        "name": f"{recipe} seed 0",
        "recipe": recipe,
        "seed": 0,
        "seconds": seconds,
        **ttq.scores(metrics),
        "target": ttq.TARGETS[recipe],
        "run_command": "captioning train",
        "commit": "0123456789",
        "timed_alone": True,
        "command": "python benchmarks/time_to_quality.py --out runs/ttq",
        "machine": {"cores": 2, "cpu": "CPU", "torch": "2"},
    }
    row["met"] = ttq.met(recipe, row)
    return row


def test_a_run_meets_its_targets_only_when_every_one_holds() -> None:
    assert _row("soft", 150, 0.98, 0.95, 0.99)["met"]
    assert not _row("soft", 250, 0.98, 0.95, 0.99)["met"]  # over 4 minutes
    assert not _row("soft", 150, 0.98, 0.85, 0.99)["met"]  # three objects below 0.90
    assert not _row("soft", 150, 0.98, 0.95, 0.80)["met"]  # colour pointing below 0.90
    assert _row("hard", 300, 0.98, 0.10, 0.99)["met"]  # hard has no three-object target
    assert not _row("hard", 300, 0.96, 0.95, 0.99)["met"]


def test_the_table_shows_seconds_scores_and_verdicts() -> None:
    rows = [
        _row("soft", 150.4, 0.984, 0.976, 0.996),
        _row("hard", 400, 0.986, 0.9, 0.99),
        {"kind": "floor"},
    ]
    table = load_tool("tables").speed_quality(rows)
    soft, hard = (line for line in table.splitlines() if "seed 0" in line)
    assert "**150**" in soft and "0.984" in soft and "0.996 / 0.990 / 0.980" in soft
    assert soft.endswith("| met |") and hard.endswith("| **not met** |")
    assert "2 time-to-quality rows" in table  # the floor row is another table's


def test_rows_are_merged_by_name_and_a_failed_run_exits_1(tmp_path, monkeypatch, capsys) -> None:
    import json

    made = []

    stamped = ("commit", "command", "timed_alone", "machine")  # the recorder's to write

    def fake_run(recipe, seed, out, python):
        made.append((recipe, seed))
        row = _row(recipe, 60 + len(made), 0.98, 0.95, 0.99)
        return {k: v for k, v in row.items() if k not in stamped}

    monkeypatch.setattr(ttq, "run_one", fake_run)
    results = tmp_path / "speed.json"
    argv = ["--out", str(tmp_path / "runs"), "--runs", "soft:0,hard:0", "--results", str(results)]
    assert ttq.main([*argv, "--machine-busy"]) == 0
    rows = json.loads(results.read_text())
    assert made == [("soft", 0), ("hard", 0)] and len(rows) == 2
    assert all(r["timed_alone"] is False and "--machine-busy" in r["command"] for r in rows)
    assert rows[0]["command"].startswith("python -m benchmarks.time_to_quality --out OUT --runs ")
    assert rows[0]["commit"] and rows[0]["cpu"] and str(tmp_path) not in results.read_text()
    assert ttq.main([*argv[:3], "soft:0", *argv[4:]]) == 0  # seed 0 again: replaced
    rows = json.loads(results.read_text())
    assert [r["name"] for r in rows] == ["hard seed 0", "soft seed 0"] and rows[1]["timed_alone"]

    def failing(recipe, seed, out, python):
        raise ttq.Failed("captioning train exited with 1; see log")

    monkeypatch.setattr(ttq, "run_one", failing)
    assert ttq.main(argv) == 1
    assert capsys.readouterr().err.strip() == "error: captioning train exited with 1; see log"

    # a row made under other settings replaces the file's only with --replace
    monkeypatch.setattr(ttq, "run_one", lambda *a: {**fake_run(*a), "precision": "bf16"})
    before = results.read_text()
    assert ttq.main([*argv[:3], "hard:0", *argv[4:]]) == 0  # the file's rows had no precision
    monkeypatch.setattr(ttq, "run_one", lambda *a: {**fake_run(*a), "precision": "fp32"})
    assert ttq.main([*argv[:3], "hard:0", *argv[4:]]) == 2
    assert "other precision" in capsys.readouterr().err and results.read_text() != before
    assert ttq.main([*argv[:3], "hard:0", *argv[4:], "--replace"]) == 0

    # the same run on another host stays beside this host's
    count = len(json.loads(results.read_text()))
    other = lambda *a: {**fake_run(*a), "precision": "fp32", "device": "Another CPU"}  # noqa: E731
    monkeypatch.setattr(ttq, "run_one", other)
    assert ttq.main([*argv[:3], "hard:0", *argv[4:]]) == 0
    rows = json.loads(results.read_text())
    assert len(rows) == count + 1
    assert sorted(str(r.get("device")) for r in rows if r["name"] == "hard seed 0") == [
        "Another CPU",
        "None",
    ]


def test_without_results_the_rows_stay_in_the_out_folder(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(ttq, "run_one", lambda *a: _row("soft", 60, 0.98, 0.95, 0.99))
    out = tmp_path / "runs"
    assert ttq.main(["--out", str(out), "--runs", "soft:0"]) == 0
    assert [r["name"] for r in __import__("json").loads((out / "rows.json").read_text())] == [
        "soft seed 0"
    ]


def test_a_row_says_how_its_recipe_trains() -> None:
    fields = ttq.trained_with("quickstart")
    assert fields["config"] == "configs/shapes_soft.yaml" and fields["blocks"] == "preact"
    assert fields["precision"] in ("fp32", "bf16") and fields["device"] and fields["threads"]


def test_a_failed_command_names_itself_and_its_log(tmp_path) -> None:
    import sys

    log = tmp_path / "run.log"
    assert ttq._timed([sys.executable, "-c", "print('ok')"], log) > 0
    assert log.read_text().strip() == "ok"
    with pytest.raises(ttq.Failed, match=f"exited with 3; see {log}"):
        ttq._timed([sys.executable, "-c", "import sys; print('bad'); sys.exit(3)"], log)


def test_a_run_folder_is_removed_only_when_it_is_its_verbs(tmp_path):
    from benchmarks.time_to_quality import remove_own
    from captioning.errors import CaptioningError

    mine = tmp_path / "soft_s0"
    mine.mkdir()
    (mine / "notes.txt").write_text("mine")
    with pytest.raises(CaptioningError, match="did not write; nothing was removed"):
        remove_own(mine, "train")
    assert (mine / "notes.txt").read_text() == "mine"
    (mine / ".captioning").write_text("shapes\n")  # another verb's
    with pytest.raises(CaptioningError):
        remove_own(mine, "train")
    (mine / ".captioning").write_text("train\n")
    remove_own(mine, "train")
    assert not mine.exists()
    remove_own(tmp_path / "never", "train")  # a missing folder is fine
