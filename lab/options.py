"""The options and checks every study's command line shares: ``--seeds`` (one parser),
``--set``, ``--threads``, ``--jobs``, ``--machine-busy``, ``--results`` and ``--replace``,
and one-line errors.
"""

from __future__ import annotations

import argparse
import functools
import sys
from collections.abc import Callable
from typing import Any

from captioning.cli import add_set_option, positive_int
from captioning.config import parse_override
from captioning.errors import CaptioningError
from lab.provenance import add_replace_option, add_result_options, usable_cores
from lab.results import PLUMBING


class StudyError(CaptioningError):
    """An argument or a run folder the study cannot use (the message says what to do)."""


def parse_seeds(text: str) -> list[int]:
    """``0,1,2``, ``0-9``, ``3`` or ``2-3,5`` as a sorted list of distinct seeds.

    Raises:
        StudyError: in one line, for anything else (a negative seed, ``3-1``, ``a``, none).
    """
    seeds: set[int] = set()
    try:
        for part in (p.strip() for p in text.split(",") if p.strip()):
            low, dash, high = part.partition("-")
            first = int(low)
            last = int(high) if dash else first
            if first < 0 or last < first:
                raise ValueError
            seeds.update(range(first, last + 1))
    except ValueError:
        seeds.clear()
    if not seeds:
        raise StudyError(f"--seeds wants seeds >= 0 such as 0-9, 0,2,4 or 3, got {text!r}")
    return sorted(seeds)


def add_seeds_option(parser: argparse.ArgumentParser, default: str, what: str = "") -> None:
    """``--seeds`` (``0,1,2``, ``0-9``, ``3``, or words ``0 1 2``), read by
    :func:`parse_seeds` from ``" ".join(args.seeds)``."""
    parser.add_argument(
        "--seeds",
        nargs="+",
        default=[default],
        help=f"seeds such as 0-9, 0,2,4 or 3{what} ({default})",
    )


def seeds_of(args: argparse.Namespace) -> list[int]:
    """The seeds of ``--seeds`` (see :func:`add_seeds_option`)."""
    return parse_seeds(",".join(args.seeds))


def add_runner_options(parser: argparse.ArgumentParser, each: str = "every run") -> None:
    """``--set`` (repeatable), ``--threads``, ``--jobs``, ``--machine-busy``, ``--results``
    (no default: without it the rows go to the out folder only) and ``--replace``."""
    add_set_option(parser, f"a config override of {each} (repeatable)")
    parser.add_argument(
        "--threads", type=positive_int, help=f"train.threads of {each} (default: cores // --jobs)"
    )
    parser.add_argument(
        "--jobs", type=positive_int, default=1, help="runs side by side, one process each (1)"
    )
    add_result_options(parser, "the rows")
    add_replace_option(parser)


def refuse_plumbing(overrides: list[str], plumbing: tuple[str, ...] = PLUMBING) -> None:
    """A :class:`StudyError` for a ``--set`` of a key the study sets itself."""
    for text in overrides:
        key = ".".join(parse_override(text)[0])
        if key in plumbing:
            raise StudyError(
                f"--set {text}: {key} is the study's to set; use --seeds, "
                f"--threads or the study's own options"
            )


def fail(exc: Exception) -> int:
    """Print ``exc`` as a one-line error; the exit status of a user's error (2)."""
    print(f"error: {exc}", file=sys.stderr)
    return 2


def threads_for(jobs: int, threads: int | None, cores: int | None = None) -> int | None:
    """``train.threads`` of each run when ``jobs`` run side by side on ``cores`` (default:
    this process's): ``threads`` as asked, else max(1, cores // jobs) for several jobs and
    None (torch's choice) for one. More threads than cores is a :class:`StudyError`."""
    if jobs == 1:
        return threads
    cores = cores or usable_cores()
    if threads is None:
        return max(1, cores // jobs)
    if threads * jobs > cores:
        raise StudyError(
            f"--threads {threads} with --jobs {jobs} asks {threads * jobs} threads "
            f"of {cores} cores; leave out --threads"
        )
    return threads


def errors_in_one_line(main: Callable[..., int]) -> Callable[..., int]:
    """``main`` with a user's error (a :class:`~captioning.errors.CaptioningError`) printed
    in one line, exit status 2 (:func:`fail`): every study's and benchmark's entry point."""

    @functools.wraps(main)
    def wrapped(*args: Any, **kwargs: Any) -> int:
        try:
            return main(*args, **kwargs)
        except CaptioningError as exc:
            return fail(exc)

    return wrapped


def parser_for(module: str, doc: str | None) -> argparse.ArgumentParser:
    """The command line of ``python -m module``: its help opens with the first paragraph of
    the module's docstring ``doc``, kept as written."""
    return argparse.ArgumentParser(
        prog=f"python -m {module}",
        description=(doc or "").split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
