"""Ctrl-C and SIGTERM at 100 points of a training and of a feature extraction, sent from
outside to the run's process group (tests/signal_points.py): every run exits 130 or 143 with
its one line (or 0 when the signal came after its last write), leaves no temporary file,
and continues to the end a run nobody stopped reaches: a training resumed from its
``last.pt`` to the same weights, an extraction run again to the same split. Half the
trainings start as a script's ``command &`` starts them, with Ctrl-C ignored."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def points(tmp_path: Path, verb: str, count: int, *extra: str) -> list[dict]:
    rows = tmp_path / "rows.json"
    argv = [
        "--verb",
        verb,
        "--points",
        str(count),
        "--work",
        str(tmp_path / "work"),
        "--out",
        str(rows),
        *extra,
    ]
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    result = subprocess.run(
        [sys.executable, "-m", "tests.signal_points", *argv],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=3000,
    )
    assert rows.exists(), result.stderr[-3000:]
    return json.loads(rows.read_text())


def broken(rows: list[dict]) -> list[dict]:
    return [row for row in rows if not row["ok"]]


@pytest.mark.slow
@pytest.mark.parametrize("background", [False, True], ids=["terminal", "script"])
def test_a_training_keeps_its_promise_at_50_points(tmp_path, background):
    rows = points(tmp_path, "train", 50, *(["--background"] if background else []))
    assert len(rows) == 50
    assert not broken(rows), json.dumps(broken(rows), indent=1)
    assert sum(row["code"] in (130, 143) for row in rows) >= 35  # most came mid-run


@pytest.mark.slow
def test_an_extraction_keeps_its_promise_at_100_points(tmp_path):
    rows = points(tmp_path, "extract", 100)
    assert len(rows) == 100
    assert not broken(rows), json.dumps(broken(rows), indent=1)
    assert sum(row["code"] in (130, 143) for row in rows) >= 70
