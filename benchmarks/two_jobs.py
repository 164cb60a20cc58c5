"""What two trainings on one machine cost each other, and how to share the cores.

    python -m benchmarks.two_jobs --config configs/flickr8k_mobilenet.yaml \\
        [--set KEY=VALUE ...] [--jobs 2] [--steps 12] [--results results/speed.json]

Times a training step of ``--config`` (by :mod:`benchmarks.profile_epoch`, the median of
``--steps`` steps after two warm-up steps) first as one job alone with every core, then as
``--jobs`` identical jobs started together, once with every job on all the cores (what two
plain ``captioning train`` commands do) and once with each job on ``cores // jobs`` threads
(``train.threads``, what the study runner's ``--jobs`` sets). One row per arrangement: the
jobs, the threads of each, each job's steps per second and their sum. Run it on an otherwise
idle machine: the jobs it starts are the only load it means to measure.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from captioning.errors import CaptioningError
from lab.options import fail
from lab.provenance import (
    add_replace_option,
    add_result_options,
    device_name,
    merge_rows,
    portable,
)


def time_jobs(
    config: str, overrides: list[str], jobs: int, threads: int, steps: int, folder: Path
) -> list[dict[str, Any]]:
    """Start ``jobs`` profiles of ``config`` together, each on ``threads`` threads; what
    each measured (:func:`benchmarks.profile_epoch.profile_epoch`)."""
    outs = [folder / f"jobs{jobs}-threads{threads}-{n}.json" for n in range(jobs)]
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "benchmarks.profile_epoch",
                "--config",
                config,
                *(f"--set={o}" for o in overrides),
                f"--set=train.threads={threads}",
                "--steps",
                str(steps),
                "--out",
                str(out),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        for out in outs
    ]
    for proc in procs:
        _, err = proc.communicate()
        if proc.returncode != 0:
            last = (err.strip().splitlines() or ["no output"])[-1]
            raise CaptioningError(f"a profile job failed: {last}")
    return [json.loads(out.read_text()) for out in outs]


def arrangements(cores: int, jobs: int) -> list[tuple[int, int]]:
    """(jobs, threads each): one job on every core, then ``jobs`` jobs on every core each,
    then ``jobs`` jobs sharing the cores."""
    return [(1, cores), (jobs, cores), (jobs, max(1, cores // jobs))]


def measure(config: str, overrides: list[str], jobs: int, steps: int) -> list[dict[str, Any]]:
    """One row per arrangement of :func:`arrangements`."""
    cores = len(os.sched_getaffinity(0))
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for count, threads in arrangements(cores, jobs):
            profiles = time_jobs(config, overrides, count, threads, steps, Path(tmp))
            seconds = [p["step_seconds"] for p in profiles]
            rows.append(
                {
                    "kind": "two_jobs",
                    "config": portable(config),
                    "overrides": [portable(o) for o in overrides],
                    "jobs": count,
                    "threads": threads,
                    "cores": cores,
                    "precision": profiles[0].get("precision"),
                    "device": device_name(),
                    "step_seconds": seconds,
                    "steps_per_s": [round(1 / s, 3) for s in seconds],
                    "steps_per_s_total": round(sum(1 / s for s in seconds), 3),
                }
            )
            print(
                f"{count} job(s) x {threads} thread(s): "
                + ", ".join(f"{1 / s:.2f}" for s in seconds)
                + " steps/s"
            )
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.two_jobs", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--config", required=True, help="YAML config, as for train")
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a config value (repeatable)",
    )
    parser.add_argument("--jobs", type=int, default=2, help="jobs side by side (default 2)")
    parser.add_argument("--steps", type=int, default=12, help="timed steps (default 12)")
    add_result_options(parser, "the rows")
    add_replace_option(parser)
    args = parser.parse_args(argv)
    if args.jobs < 2 or args.steps < 1:
        parser.error("--jobs must be at least 2 and --steps at least 1")
    try:
        rows = measure(args.config, args.set, args.jobs, args.steps)
        if args.results is not None:
            key = ("kind", "device", "config", "overrides", "jobs", "threads")
            return merge_rows(
                args,
                rows,
                lambda r: tuple(str(r.get(k)) for k in key),
                module="benchmarks.two_jobs",
                argv=argv,
                settings=("cores",),
            )
    except CaptioningError as exc:
        return fail(exc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
