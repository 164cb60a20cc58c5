"""Where a row of results came from: the code, the command, the machine.

A study or benchmark writes rows that say which code made them (:func:`git_commit`, with
``+dirty`` when tracked files differ from the commit), how (:func:`module_command`: the
module form with no machine's paths) and on what (:func:`machine`, :func:`device_name`).
:func:`stamp` puts these on a benchmark's rows and :func:`record` merges them into a results
file through :func:`lab.results.write_results`, the one row merge: a row replaces the
file's row of the same key only when both were made under the same settings, unless
``--replace`` (:func:`add_replace_option`) asks otherwise; :func:`add_result_options` gives a
benchmark ``--results`` and ``--machine-busy``. The studies stamp and merge theirs through
:class:`lab.runner.Recorder`.
"""

from __future__ import annotations

import argparse
import os
import platform
import shlex
import subprocess
import sys
from collections.abc import Callable, Hashable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from lab import ROOT, SHARED
from lab.results import ResultsError, write_results

# options whose value a run writes: a path of theirs outside the checkout becomes OUT/NAME
OUTPUT_OPTIONS = ("--out", "--results")

__all__ = [
    "ROOT",
    "SHARED",
    "OUTPUT_OPTIONS",
    "git_commit",
    "machine",
    "cpu_model",
    "device_name",
    "usable_cores",
    "portable",
    "module_command",
    "stamp",
    "record",
    "add_result_options",
    "add_replace_option",
]


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


def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo``), else what the platform says."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def usable_cores() -> int:
    """The cores this process may run on (its affinity where the platform says)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on every platform
        return os.cpu_count() or 1


def device_name(device: str | torch.device = "cpu") -> str:
    """What a run on ``device`` ran on: the GPU's name for CUDA, else the CPU model."""
    device = torch.device(device)
    if device.type == "cuda" and torch.cuda.is_available():
        return torch.cuda.get_device_name(device)
    return cpu_model()


def machine() -> dict[str, Any]:
    """What the timings ran on: the CPU model, its cores, torch's threads and version."""
    return {
        "cpu": cpu_model(),
        "cores": os.cpu_count(),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
    }


def _under(path: Path, folder: Path) -> str | None:
    try:
        return path.relative_to(folder).as_posix()
    except ValueError:
        return None


def portable(
    word: str,
    places: Mapping[str, Path | str | None] = {},  # noqa: B006
    elsewhere: str = "DATA",
) -> str:
    """``word`` with its path written so that it names no machine: a path in one of
    ``places`` (placeholder -> folder, e.g. ``{"OUT": out, "DATA": data}``; the innermost
    wins) as ``PLACEHOLDER/...``, one in the shared folder as ``SHARED/...``, one in the
    checkout relative to it, any other absolute path as ``ELSEWHERE/NAME`` where
    ``elsewhere`` is ``DATA`` for what a run reads, ``OUT`` for what it writes. A relative
    path is kept as it is (the lab runs from the checkout), unless it climbs out of it
    (``../shared``). The value of ``--flag=PATH`` and of a config override ``KEY=PATH`` is
    treated alike."""
    if "=" in word and not word.startswith("/"):
        key, value = word.split("=", 1)
        return f"{key}={portable(value, places, elsewhere)}"
    if not word.startswith(("/", "~", "../")) and word != "..":
        return word
    path = Path(os.path.expanduser(word)).resolve()
    folders = [(name, Path(folder).resolve()) for name, folder in places.items() if folder]
    folders += [("SHARED", SHARED.resolve()), ("", ROOT)]
    for name, folder in sorted(folders, key=lambda item: -len(item[1].parts)):
        inside = _under(path, folder)
        if inside is not None:
            if not name:
                return inside
            return name if inside == "." else f"{name}/{inside}"
    return f"{elsewhere}/{path.name}"


def module_command(
    module: str,
    argv: Sequence[str] | None,
    places: Mapping[str, Path | str | None] = {},  # noqa: B006
) -> str:
    """The command that ran ``module`` (``tools.seed_study``) with ``argv`` (None: this
    process's arguments), in module form, every path made :func:`portable` (the value of
    an option of :data:`OUTPUT_OPTIONS` outside ``places`` as ``OUT/NAME``)."""
    words, option = [], ""
    for word in sys.argv[1:] if argv is None else argv:
        named = word.split("=", 1)[0] if word.startswith("--") else option
        words.append(portable(word, places, "OUT" if named in OUTPUT_OPTIONS else "DATA"))
        option = word if word.startswith("--") and "=" not in word else ""
    return shlex.join(["python", "-m", module, *words])


def stamp(
    module: str,
    argv: Sequence[str] | None,
    *,
    timed_alone: bool,
    device: str | torch.device = "cpu",
    places: Mapping[str, Path | str | None] | None = None,
) -> dict[str, Any]:
    """The fields every row of one benchmark run shares: ``command`` (:func:`module_command`),
    ``commit``, ``machine`` (:func:`machine` and the ``device``'s name) and ``timed_alone``.

    Args:
        module: the benchmark's module (``benchmarks.bench``).
        argv: its arguments (None: this process's).
        timed_alone: nothing else ran on the machine.
        device: where the run ran (``cuda``: the row names the GPU).
        places: folders written as placeholders in the command (``{"OUT": out}``).
    """
    return {
        "command": module_command(module, argv, places or {}),
        "commit": git_commit(),
        "machine": {**machine(), "device": device_name(device)},
        "timed_alone": timed_alone,
    }


def record(
    path: Path,
    rows: list[dict[str, Any]],
    key: Callable[[dict[str, Any]], Hashable],
    *,
    module: str,
    argv: Sequence[str] | None,
    timed_alone: bool,
    settings: Sequence[str],
    replace: bool = False,
    device: str | torch.device = "cpu",
    places: Mapping[str, Path | str | None] | None = None,
) -> None:
    """Merge ``rows``, each given the fields of :func:`stamp`, into the results file ``path``.

    Args:
        path: the results file (``results/speed.json``).
        rows: the run's rows.
        key: a row's identity: a row replaces the file's row of the same key.
        module, argv, timed_alone, device, places: as for :func:`stamp`.
        settings: the row fields that must agree for a row to replace another (a field one
            of the two rows lacks is not compared).
        replace: replace rows of other settings too.

    Raises:
        lab.results.ResultsError: a row would replace one made under other settings
            (one line; the file is untouched).
    """
    fields = stamp(module, argv, timed_alone=timed_alone, device=device, places=places)
    write_results(
        path,
        [{**row, **fields} for row in rows],
        key,
        replace=replace,
        settings=lambda row: {name: row[name] for name in settings if name in row},
    )


def merge_rows(
    args: argparse.Namespace,
    rows: list[dict[str, Any]],
    key: Callable[[dict[str, Any]], Hashable],
    *,
    module: str,
    argv: Sequence[str] | None,
    settings: Sequence[str],
) -> int:
    """A benchmark's last step: :func:`record` its ``rows`` into ``args.results`` with its
    ``--machine-busy`` and ``--replace``, and say so. Returns 0, or 2 after a one-line error
    when a row would replace one made under other settings (the file is untouched)."""
    try:
        record(
            args.results,
            rows,
            key,
            module=module,
            argv=argv,
            timed_alone=not args.machine_busy,
            settings=settings,
            replace=args.replace,
        )
    except ResultsError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"merged {len(rows)} rows into {args.results}")
    return 0


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
        help=f"also merge {what} into this results file (e.g. results/speed.json)",
    )


def add_replace_option(parser: argparse.ArgumentParser) -> None:
    """``--replace``: let the rows replace those of other settings in ``--results``."""
    parser.add_argument(
        "--replace",
        action="store_true",
        help="with --results: also replace rows made under other settings",
    )
