"""Where a row of results came from, and the options every study shares.

A study or benchmark writes rows that say which code made them (:func:`git_commit`), on what
(:func:`machine`), and whether the machine was otherwise idle; :func:`add_study_options` gives
every study the same ``--set``, ``--threads``, ``--results`` and ``--machine-busy``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import subprocess
import sys
from collections.abc import Callable, Hashable
from pathlib import Path
from typing import Any

import torch

from captioning.cli import add_set_option, positive_int

ROOT = Path(__file__).resolve().parent.parent


def git_commit() -> str:
    """The checkout's commit, with ``+dirty`` when tracked files differ from it."""
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=ROOT,
            capture_output=True,
            text=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return commit + ("+dirty" if dirty else "")


def machine() -> dict[str, Any]:
    """What the timings ran on."""
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
    }


def read_rows(path: Path) -> list[dict[str, Any]]:
    """The rows of the results file ``path``; none if it is absent."""
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else []


def merge_rows(
    earlier: list[dict[str, Any]],
    rows: list[dict[str, Any]],
    key: Callable[[dict[str, Any]], Hashable],
) -> list[dict[str, Any]]:
    """``earlier`` rows less those that ``rows`` replace (the same ``key``), followed by
    ``rows``: a study runs in pieces and re-runs a row without losing the others."""
    new = {key(r) for r in rows}
    return [r for r in earlier if key(r) not in new] + rows


def command(script: str, argv: list[str] | None) -> str:
    """The command line that ran ``script`` (a path from the repository root) with ``argv``
    (None: this process's arguments)."""
    return shlex.join(["python", script, *(sys.argv[1:] if argv is None else argv)])


def record_rows(
    path: Path,
    rows: list[dict[str, Any]],
    key: Callable[[dict[str, Any]], Hashable],
    *,
    script: str,
    argv: list[str] | None,
    timed_alone: bool = True,
) -> None:
    """Merge ``rows`` into the results file ``path`` (see :func:`merge_rows`), each stamped
    with the command, the commit, the machine and whether it was timed alone."""
    stamp = {"command": command(script, argv), "commit": git_commit(), "machine": machine(),
             "timed_alone": timed_alone}  # fmt: skip
    write_rows(path, [{**row, **stamp} for row in rows], key)


def write_rows(
    path: Path, rows: list[dict[str, Any]], key: Callable[[dict[str, Any]], Hashable]
) -> None:
    """Merge ``rows`` into the results file ``path`` as they are (see :func:`merge_rows`)."""
    merged = merge_rows(read_rows(path), rows, key)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(merged, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")


def add_result_options(parser: argparse.ArgumentParser, what: str) -> None:
    """A benchmark's ``--results FILE`` (merge ``what`` into it) and ``--machine-busy``."""
    parser.add_argument(
        "--machine-busy",
        action="store_true",
        help="other work ran beside this one: the rows say they were not timed alone",
    )
    parser.add_argument(
        "--results",
        type=Path,
        help=f"also merge {what} into this results file (results/speed.json)",
    )


def add_study_options(
    parser: argparse.ArgumentParser, *, results: Path | None, each: str = "every run"
) -> None:
    """``--set KEY=VALUE`` (repeatable, into ``overrides``) and ``--machine-busy``; with a
    default ``results`` file, also ``--threads`` (``train.threads`` of each run) and
    ``--results`` (the rows' file, merged into)."""
    add_set_option(parser, f"a config override of {each} (repeatable)")
    parser.add_argument(
        "--machine-busy",
        action="store_true",
        help="other work runs beside this one: the rows' seconds are not timed alone",
    )
    if results is None:
        return
    parser.add_argument(
        "--threads", type=positive_int, default=None, help=f"train.threads of {each}"
    )
    parser.add_argument(
        "--results", type=Path, default=results, help=f"the rows' file, merged into ({results})"
    )
