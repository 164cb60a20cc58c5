"""What keeping freed memory in the process buys a training step
(:func:`captioning.allocator.keep_freed_memory`, which ``fit`` sets).

    python -m benchmarks.allocator --sizes coco,flickr8k --rounds 5

glibc's default hands large freed blocks and the free top of its heap back to the kernel,
and a training step allocates and frees the same hundreds of megabytes every step, so every
step the kernel faults those pages in again and zeroes them. What that costs depends on the
host (a page fault costs several times more on some virtual machines than on others), so
this script measures it: each round times the paper-wiring step on cached grids (as
``benchmarks.bench`` times ours) in two fresh processes, one with glibc's default and one
with freed memory kept, in alternating order, and counts the pages each faults in per step.
A row per size and precision keeps every round's medians and the median of the rounds'
speed-ups.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.workload import (
    SIZES,
    decoder_step,
    seeded_setup,
    sizes_and_precisions,
)
from captioning.allocator import keep_freed_memory
from captioning.config import replace_section
from lab.provenance import add_replace_option, add_result_options, device_name, merge_rows

ROOT = Path(__file__).resolve().parents[1]
MODES = ("default", "kept")


def time_steps(size_name: str, precision: str, mode: str, repeats: int) -> dict[str, float]:
    """In this process (fresh, with the allocator as ``mode`` says): the median seconds of
    ``repeats`` steps after two, and the pages faulted in per step."""
    if mode == "kept" and not keep_freed_memory():
        raise SystemExit("not glibc: there is no default to compare freed memory kept with")
    size = SIZES[size_name]()
    setup = seeded_setup(size)
    cfg = replace_section(size.config, "train", precision=precision)
    step = decoder_step(setup, cfg, reference=False, compiled=False)
    step(), step()  # the heap settles in the first steps
    seconds = []
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(repeats):
        start = time.perf_counter()
        step()
        seconds.append(time.perf_counter() - start)
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults
    return {"seconds": statistics.median(seconds), "faults": faults / repeats}


def _in_a_fresh_process(size: str, precision: str, mode: str, repeats: int) -> dict[str, float]:
    argv = ["--child", size, precision, mode, str(repeats)]
    result = subprocess.run(
        [sys.executable, "-m", "benchmarks.allocator", *argv],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    if result.returncode != 0:
        lines = (result.stderr or result.stdout).strip().splitlines() or ["no output"]
        raise SystemExit(f"the {mode} step of {size} {precision} failed: {lines[-1]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def measure(size: str, precision: str, rounds: int, repeats: int) -> dict[str, Any]:
    """One size and precision: ``rounds`` rounds of the two processes, in alternating order."""
    timed: dict[str, list[dict[str, float]]] = {mode: [] for mode in MODES}
    for number in range(rounds):
        for mode in MODES if number % 2 == 0 else reversed(MODES):
            timed[mode].append(_in_a_fresh_process(size, precision, mode, repeats))
    default, kept = ([t["seconds"] for t in timed[mode]] for mode in MODES)
    return {
        "kind": "allocator",
        "size": size,
        "precision": precision,
        "rounds": rounds,
        "repeats": repeats,
        "default_seconds": default,
        "kept_seconds": kept,
        "speedups": [d / k for d, k in zip(default, kept, strict=True)],
        "default_faults": statistics.median(t["faults"] for t in timed["default"]),
        "kept_faults": statistics.median(t["faults"] for t in timed["kept"]),
        "device": device_name("cpu"),
        "threads": torch.get_num_threads(),
    }


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.allocator", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--sizes", default="coco", help="of benchmarks.bench (default: coco)")
    parser.add_argument("--precisions", default="fp32", help="fp32 and/or bf16 (autocast)")
    parser.add_argument("--rounds", type=int, default=5, help="rounds of the two processes")
    parser.add_argument("--repeats", type=int, default=7, help="timed steps in each process")
    parser.add_argument("--child", nargs=4, help=argparse.SUPPRESS)
    add_result_options(parser, "one row per size and precision")
    add_replace_option(parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Time each size and precision with and without freed memory kept.

    Returns:
        0, or 2 when the row would replace one of other settings in ``--results``.
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.child:
        size, precision, mode, repeats = args.child
        print(json.dumps(time_steps(size, precision, mode, int(repeats))))
        return 0
    sizes, precisions = sizes_and_precisions(parser, args.sizes, args.precisions)
    if min(args.rounds, args.repeats) < 1:
        parser.error("--rounds and --repeats must be at least 1")
    rows = []
    for size in sizes:
        for precision in precisions:
            row = measure(size, precision, args.rounds, args.repeats)
            rows.append(row)
            print(
                f"{size} {precision}: {statistics.median(row['default_seconds']):.3g} s with "
                f"glibc's default ({row['default_faults']:.0f} page faults a step), "
                f"{statistics.median(row['kept_seconds']):.3g} s with freed memory kept "
                f"({row['kept_faults']:.0f}): {statistics.median(row['speedups']):.2f}x "
                f"(rounds {min(row['speedups']):.2f}-{max(row['speedups']):.2f}x)"
            )
    if args.results is None:
        return 0
    return merge_rows(
        args, rows, _key, module="benchmarks.allocator", argv=argv, settings=("threads", "repeats")
    )


def _key(row: dict[str, Any]) -> tuple:
    """A row's identity in a results file: one per size, precision and host."""
    return row.get("kind"), row.get("size"), row.get("precision"), row.get("device")


if __name__ == "__main__":
    sys.exit(main())
