"""Where a row of results came from, and the options every study shares.

A study or benchmark writes rows that say which code made them (:func:`git_commit`), on what
(:func:`machine`), and whether the machine was otherwise idle; :func:`add_study_options` gives
every study the same ``--set``, ``--threads``, ``--results`` and ``--machine-busy``.
"""

from __future__ import annotations

import argparse
import os
import platform
import subprocess
from pathlib import Path
from typing import Any

import torch

from captioning.cli import positive_int

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


def add_study_options(
    parser: argparse.ArgumentParser, *, results: Path | None, each: str = "every run"
) -> None:
    """``--set KEY=VALUE`` (repeatable, into ``overrides``) and ``--machine-busy``; with a
    default ``results`` file, also ``--threads`` (``train.threads`` of each run) and
    ``--results`` (the rows' file, merged into)."""
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help=f"a config override of {each} (repeatable)",
    )
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
