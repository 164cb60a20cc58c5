"""Timing helpers of the benchmarks: :func:`median_seconds` of a callable, and for the speed
benchmark one measurement (:func:`measure`: warm-up and timed runs, the median, the words per
second and the peak memory) and the speed-ups of ours over the reference (:func:`speedups`).
"""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from benchmarks.memory import PeakMemory
from captioning.inference.decoding import Decoded

logger = logging.getLogger("benchmarks")

# Speed-ups to report (not assert), by (size, device, task).
TARGETS = {("coco", "cpu", "decoder_step"): 5.0, ("coco", "cpu", "beam5"): 20.0}


@dataclass
class Job:
    """One measurement: ``make`` builds the timed callable (copies weights, compiles)."""

    task: str
    impl: str  # ours | reference
    make: Callable[[], Callable[[], Any]]
    repeats: int
    words: int | None  # teacher-forced words per call; None counts the decoded words


def synchronize(device: torch.device) -> None:
    """Wait for ``device``'s queued work (CUDA runs asynchronously; the CPU does not)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_seconds(fn: Callable[[], object], repeats: int, warmup: int = 2) -> float:
    """The median time of ``fn``.

    Args:
        fn: what is timed.
        repeats: timed calls.
        warmup: untimed calls first.
    """
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _first_lines(exc: BaseException) -> str:
    """The error in one line: compiler errors put the cause on their second or third line."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()][:3]
    return f"{type(exc).__name__}: {' / '.join(lines)}"[:300]


def measure(job: Job, warmup: int, device: torch.device) -> tuple[dict[str, Any], Decoded | None]:
    """Time ``job``: ``warmup`` untimed runs, then ``job.repeats`` timed ones. A failure
    (a compiler that is missing, an unsupported op) is recorded, not raised.

    Args:
        job: the measurement.
        warmup: untimed runs first.
        device: where it runs (synchronised after every run; its memory is measured).

    Returns:
        The measurement's row, and the last result when it is a :class:`Decoded`.
    """
    memory = PeakMemory(device)
    warm_times: list[float] = []
    times: list[float] = []
    result = None
    error = None
    memory.start()
    try:
        fn = job.make()
        for runs in (warm_times, times):
            for _ in range(warmup if runs is warm_times else job.repeats):
                start = time.perf_counter()
                result = fn()
                synchronize(device)
                runs.append(time.perf_counter() - start)
    except Exception as exc:  # recorded in the results; the benchmark goes on
        error = _first_lines(exc)
        logger.warning("%s %s failed: %s", job.task, job.impl, error)
    fn = None  # drop the copies before the next measurement
    peak_delta, peak = memory.stop()
    median = statistics.median(times) if times and error is None else None
    decoded = result if isinstance(result, Decoded) and error is None else None
    words = (
        job.words
        if job.words is not None
        else (int(decoded.lengths.sum()) if decoded is not None else None)
    )
    return {
        "task": job.task,
        "impl": job.impl,
        "warmup_seconds": warm_times,
        "seconds": times,
        "median_s": median,
        "images_per_s": None,
        "tokens_per_s": words / median if median and words is not None else None,
        "peak_memory_mb": peak_delta if error is None else None,
        "peak_memory_total_mb": peak if error is None else None,
        "error": error,
    }, decoded


def speedups(measurements: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Ours against the reference of the same size, device, precision and task (the
    uncompiled reference for compiled variants): reference time / our time.

    Args:
        measurements: the rows of :func:`run_benchmark`'s ``measurements``.
    """
    references = {
        (m["size"], m["device"], m["precision"], m["task"]): m
        for m in measurements
        if m["impl"] == "reference" and m["median_s"]
    }
    ratios = []
    for m in measurements:
        key = (m["size"], m["device"], m["precision"], m["task"])
        if m["impl"] != "ours" or not m["median_s"] or key not in references:
            continue
        speedup = references[key]["median_s"] / m["median_s"]
        target = TARGETS.get((m["size"], m["device"], m["task"]))
        ratios.append(
            {
                "size": m["size"],
                "device": m["device"],
                "precision": m["precision"],
                "compiled": m["compiled"],
                "task": m["task"],
                "speedup": speedup,
                "target": target,
                "target_met": None if target is None else speedup >= target,
            }
        )
    return ratios
