"""Every committed results row says how it was made and can be re-run on another machine.

A row carries its precision, device, threads, whether it was timed alone and its commit (with
``+dirty`` where the checkout differed); none of its strings names a machine's path (run
folders are ``OUT/...``, data ``DATA/...``, the shared folder ``SHARED/...``, the checkout's
own files relative to it); its commands run the lab's scripts as modules.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import ROOT

RESULTS = sorted((ROOT / "results").glob("*.json"))
NOT_RECORDED = "not recorded"
PRECISION = re.compile(r"^(fp32|bf16|fp16)(, then (fp32|bf16|fp16))?$")
COMMIT = re.compile(r"^[0-9a-f]{7,40}(\+dirty)?$")
# a machine's folder anywhere in a string, a path from the file system's root or a home
# folder at the start of a word, a folder beside the checkout, a Windows drive
MACHINE_PATH = re.compile(
    r"/(tmp|work|home|root|Users|mnt|var)/"
    r"|(^|[\s=:'\"])(/|~/)(?=[\w.~-])"
    r"|(^|[\s=:'\"])\.\./"
    r"|[A-Za-z]:\\"
)
# a lab script run by its file path rather than as a module
SCRIPT_PATH = re.compile(r"(^|[\s/])(tools|benchmarks)/\w+\.py\b")
COMMAND_START = ("python -m ", "captioning ")


def _strings(value: Any, where: str) -> Iterator[tuple[str, str]]:
    """Every string in ``value`` (keys and values, however nested), with where it sits."""
    if isinstance(value, dict):
        for key, item in value.items():
            yield f"{where}.{key} (key)", key
            yield from _strings(item, f"{where}.{key}")
    elif isinstance(value, list):
        for index, item in enumerate(value):
            yield from _strings(item, f"{where}[{index}]")
    elif isinstance(value, str):
        yield where, value


def provenance_problems(row: dict[str, Any]) -> list[str]:
    """What ``row`` lacks of its provenance, or holds in an unreadable form."""
    problems = []
    for key in ("precision", "device", "threads", "timed_alone", "commit"):
        if key not in row:
            problems.append(f"no {key}")
    precision = row.get("precision", NOT_RECORDED)
    if precision != NOT_RECORDED and not PRECISION.match(str(precision)):
        problems.append(f"precision {precision!r}")
    if not isinstance(row.get("device", ""), str) or row.get("device") == "":
        problems.append(f"device {row.get('device')!r}")
    threads = row.get("threads", NOT_RECORDED)
    if threads != NOT_RECORDED and not (isinstance(threads, int) and threads > 0):
        problems.append(f"threads {threads!r}")
    if row.get("timed_alone", NOT_RECORDED) not in (True, False, NOT_RECORDED):
        problems.append(f"timed_alone {row.get('timed_alone')!r}")
    if not COMMIT.match(str(row.get("commit", "0" * 7))):
        problems.append(f"commit {row.get('commit')!r}")
    return problems


def portability_problems(row: dict[str, Any]) -> list[str]:
    """The strings of ``row`` that name a machine's path or run a script by its path, and
    the commands that are neither ``python -m ...`` nor the ``captioning`` CLI."""
    problems = []
    for where, text in _strings(row, "row"):
        if MACHINE_PATH.search(text):
            problems.append(f"{where} names a machine's path: {text[:120]}")
        if SCRIPT_PATH.search(text):
            problems.append(f"{where} runs a script by its path: {text[:120]}")
    for key, value in row.items():
        if (key == "command" or key.endswith("_command")) and not (
            isinstance(value, str) and value.startswith(COMMAND_START)
        ):
            problems.append(f"{key} is not `python -m ...` or `captioning ...`: {value!r:.120}")
    return problems


def _rows(path: Path) -> list[dict[str, Any]]:
    rows = json.loads(path.read_text(encoding="utf-8"))
    assert isinstance(rows, list) and all(isinstance(r, dict) for r in rows), path.name
    return rows


def _report(path: Path, check) -> list[str]:
    return [f"{path.name} row {i}: {p}" for i, row in enumerate(_rows(path)) for p in check(row)]


def test_there_are_results_to_check() -> None:
    assert len(RESULTS) >= 10


@pytest.mark.parametrize("path", RESULTS, ids=lambda p: p.stem)
def test_every_row_says_how_it_was_made(path: Path) -> None:
    problems = _report(path, provenance_problems)
    assert not problems, "\n".join(problems[:20])


@pytest.mark.parametrize("path", RESULTS, ids=lambda p: p.stem)
def test_no_row_names_a_machine_path_or_a_script_path(path: Path) -> None:
    problems = _report(path, portability_problems)
    assert not problems, "\n".join(problems[:20])


@pytest.mark.parametrize("path", RESULTS, ids=lambda p: p.stem)
def test_results_files_keep_their_layout(path: Path) -> None:
    """One row per list item, written as the study runner writes it (indent 1, a final
    newline), so a re-run's diff shows only the rows that changed."""
    text = path.read_text(encoding="utf-8")
    assert text == json.dumps(json.loads(text), indent=1, ensure_ascii=False) + "\n"


def test_the_checks_reject_a_row_without_provenance_or_with_machine_paths() -> None:
    """A row as the lab wrote it before its rows were portable fails every check."""
    row = {
        "seed": 0,
        "command": "python tools/compare_attention.py --out /tmp/attention --data-root "
        "/work/data/shapes --shared ../shared",
        "train_command": "benchmarks/photos.py --out runs/x",
        "config": "/home/me/captioning/configs/shapes_soft.yaml",
        "settings": {"checkpoint": "/root/runs/best.pt", "images": ["C:\\photos\\a.jpg"]},
        "commit": "abc",
        "threads": 0,
        "timed_alone": "yes",
    }
    assert {p.split(" ", 1)[0] for p in provenance_problems(row)} == {
        "no",
        "threads",
        "timed_alone",
        "commit",
    }
    assert len([p for p in provenance_problems(row) if p.startswith("no ")]) == 2
    problems = portability_problems(row)
    for where in (
        "row.command",
        "row.train_command",
        "row.config",
        "row.settings.checkpoint",
        "row.settings.images[0]",
    ):
        assert any(p.startswith(where + " ") for p in problems), where
    assert any("runs a script by its path" in p for p in problems)
    assert any(p.startswith("train_command is not") for p in problems)


def test_the_checks_accept_placeholders_and_the_checkouts_own_paths() -> None:
    row = {
        "command": "python -m tools.grounding_study --data SHARED/data/coco_mini --out OUT "
        "--runs RUNS --set 'data.max_images={train: 2000, val: 200}'",
        "run_command": "captioning train --config configs/shapes_soft.yaml --out runs/ttq",
        "data": "DATA/flickr8k",
        "note": "colour / size / shape",
        "pointing_game/color": 0.9,
        "precision": "fp32, then bf16",
        "device": "NVIDIA H200 (CUDA)",
        "threads": NOT_RECORDED,
        "timed_alone": False,
        "commit": "2e78a68d3a8f0a665177ffb7b98fa918c52c7683+dirty",
    }
    assert provenance_problems(row) == []
    assert portability_problems(row) == []
