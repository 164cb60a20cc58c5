"""The speed benchmark's report: the Markdown tables of a run, and its rows in a results
file."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks.cider_speed import format_cider
from benchmarks.reference_decoding import DECODERS
from lab.provenance import record

TASK_LABELS = {
    "decoder_step": "decoder train step (cached features)",
    "full_step": "full train step",
    "greedy": "greedy",
    "beam3": "beam k=3",
    "beam5": "beam k=5",
}


def _number(value: float | None, digits: int = 3) -> str:
    if value is None:
        return "–"
    return f"{value:.{digits}g}" if abs(value) < 10**digits else f"{value:,.0f}"


def _checks_table(results: dict[str, Any]) -> list[str]:
    lines = [
        "| size | device | images | logits max diff | task | same captions (random) "
        "| same captions (end raised) | ended (random / end raised) | passed |",
        "|" + " --- |" * 9,
    ]
    for check in results["checks"]:
        captions = check["captions"]
        for task in DECODERS:
            random, biased = captions["random"][task], captions["end_biased"][task]
            lines.append(
                f"| {check['size']} | {check['device']} | {check['images']} "
                f"| {check['logits_max_abs_diff']:.2g} | {TASK_LABELS[task]} "
                f"| {random['equal_share']:.2f} | {biased['equal_share']:.2f} "
                f"| {random['ended_share']:.2f} / {biased['ended_share']:.2f} "
                f"| {'yes' if check['passed'] else 'NO'} |"
            )
    return lines


def _timing_line(m: dict[str, Any], ratio: dict[str, Any] | None) -> str:
    target = "–"
    if ratio and ratio["target"] is not None:
        met = "met" if ratio["target_met"] else "not met"
        target = f"≥{ratio['target']:g}x {met}"
    task = TASK_LABELS[m["task"]]
    if m["task"] == "full_step":
        frozen = ", frozen encoder under no_grad" if m["fine_tune"] == "none" else ""
        task += f" (fine_tune={m['fine_tune']}{frozen})"
    notes = []
    if m.get("captions_agree_with_reference") is not None:
        notes.append(f"same captions as reference: {m['captions_agree_with_reference']:.2f}")
    if m["error"]:
        notes.append(m["error"].replace("|", "/"))
    impl = "ours (compiled)" if m["compiled"] else m["impl"]
    speedup = f"{ratio['speedup']:.1f}x" if ratio else "–"
    return (
        f"| {m['size']} | {m['device']} | {m['precision']} | {task} | {impl} "
        f"| {_number(m['median_s'])} | {_number(m['images_per_s'])} "
        f"| {_number(m['tokens_per_s'])} | {_number(m['peak_memory_mb'])} "
        f"| {speedup} | {target} "
        f"| {'; '.join(notes)} |"
    )


def format_markdown(results: dict[str, Any]) -> str:
    """The environment, the checks and every measurement as Markdown tables.

    Args:
        results: what :func:`run_benchmark` returns (or its JSON file holds).
    """
    env = results["environment"]
    lines = [
        "# Benchmark",
        "",
        f"torch {env['torch']}, Python {env['python']}, CPU {env['cpu']} "
        f"({env['threads']} threads of {env['cpu_count']} cores), GPU {env['gpu'] or 'none'}.",
        "",
        "## Ours against the reference",
        "",
        "Teacher-forced logits in fp32; captions in fp64, with random weights and with "
        "`<end>` raised (share of captions that ended: ours).",
        "",
        *_checks_table(results),
        "",
        "## Timings",
        "",
        "Medians. Decoding runs every caption to its size's max_length (`<end>` masked), so "
        "the work does not depend on the random weights. words/s counts teacher-forced words "
        "(training) or the words of the returned captions (decoding). Peak MB: above the "
        "memory in use before the measurement; for training steps it includes the copy of "
        f"the model, gradients and Adam's state (CPU: {env['cpu_memory']}).",
        "",
        "| size | device | precision | task | impl | median s | images/s | words/s | peak MB "
        "| speed-up | target | note |",
        "|" + " --- |" * 12,
    ]
    ratios = {
        (r["size"], r["device"], r["precision"], r["compiled"], r["task"]): r
        for r in results["speedups"]
    }
    for m in results["measurements"]:
        key = (m["size"], m["device"], m["precision"], m["compiled"], m["task"])
        lines.append(_timing_line(m, ratios.get(key) if m["impl"] == "ours" else None))
    if results.get("cider"):
        lines += ["", *format_cider(results["cider"])]
    return "\n".join(lines) + "\n"


TIMING_KEY = ("size", "device", "precision", "compiled", "task", "impl")


def _timing_key(row: dict[str, Any]) -> tuple:
    """A timing row's identity in a results file: its measurement on its host (the CPU's or
    GPU's name), so that a run on one host never replaces another host's rows."""
    return (row["kind"], row.get("machine", {}).get("device"), *(row.get(k) for k in TIMING_KEY))


def record_timings(
    path: Path,
    results: dict[str, Any],
    argv: Sequence[str] | None,
    *,
    timed_alone: bool,
    replace: bool = False,
) -> None:
    """Merge every measurement of ``results`` into the results file ``path``: one row each
    (``kind`` ``bench``), which replaces an earlier row of the same host, size, device,
    precision, compilation, task and implementation made with the same threads and settings (batch
    size, seed, warm-up runs, quick) or, with ``replace``, any; the checks' verdict goes with
    each row.

    Raises:
        lab.results.ResultsError: a row would replace one of other settings.
    """
    settings = results["settings"]
    rows = [
        {
            "kind": "bench",
            **m,
            "threads": results["environment"]["threads"],
            "settings": {
                "batch_size": results["sizes"][m["size"]]["batch_size"],
                "seed": settings["seed"],
                "warmup": settings["warmup"],
                "quick": settings["quick"],
            },
            "checks_passed": results["passed"],
        }
        for m in results["measurements"]
    ]
    for device in dict.fromkeys(r["device"] for r in rows):
        record(
            path,
            [r for r in rows if r["device"] == device],
            _timing_key,
            module="benchmarks.bench",
            argv=argv,
            timed_alone=timed_alone,
            settings=("threads", "settings"),
            replace=replace,
            device=device,
            places={"OUT": Path(settings["out"]).parent},
        )


def write_run_files(results: dict[str, Any], out: Path) -> None:
    """The run's JSON file ``out`` and its Markdown tables beside it (``.md``)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2) + "\n")
    out.with_suffix(".md").write_text(format_markdown(results))
