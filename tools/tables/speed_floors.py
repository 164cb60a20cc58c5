"""The speed page's tables of what bounds a step (``results/speed.json``): the beam-search
floor (``benchmarks/beam_floor.py``), the training step's floor (``train_floor.py``) and
freed memory kept in the process (``allocator.py``)."""

from __future__ import annotations

import statistics
from collections.abc import Callable
from typing import Any

from tools.tables.common import Rows
from tools.tables.speed_rows import by_host_and_size, of_kind, seconds_cell, speed_provenance


def speed_floor(rows: Rows) -> str:
    """The beam-search floor (``benchmarks/beam_floor.py``): its parts, the floor, ours, and
    the median ratio of ours to the floor over the rounds, per task, eager and compiled."""
    rows = sorted(of_kind(rows, "floor"), key=lambda r: (r["device"], -r["beam_size"]))
    columns = [
        (r, mode)
        for r in rows
        for mode in ("eager", "compiled")
        if r.get(f"floor_{mode}") is not None
    ]
    names = [
        f"{'greedy' if r['beam_size'] == 1 else 'beam k=' + str(r['beam_size'])}, {mode}"
        for r, mode in columns
    ]
    lines = ["| | " + " | ".join(names) + " |", "| --- |" + " --- |" * len(columns)]

    def add(label: str, cell: Callable[[dict[str, Any], str], str]) -> None:
        lines.append(f"| {label} | " + " | ".join(cell(r, m) for r, m in columns) + " |")

    def parts(r: dict[str, Any], mode: str) -> str:
        p = r["parts"]
        if mode == "compiled":
            return f"fused: {p['fused']:.2g} s"
        squash = f"{p['tanh']:.2g}"
        if "sigmoid" in p:
            squash = f"min({squash}, {p['sigmoid']:.2g})"
        return f"{p['add']:.2g} + {squash} + {p['projection']:.2g} s"

    def ratio(r: dict[str, Any], mode: str) -> str:
        ratios = r.get(f"ratios_{mode}")
        if not ratios:
            return "–"
        return f"**{statistics.median(ratios):.2f}×** (rounds {min(ratios):.2f}-{max(ratios):.2f}×)"

    add("host", lambda r, m: r["device"] if m == "eager" else "")

    def dense(r: dict[str, Any], mode: str) -> str:
        if mode != "eager":
            return ""
        p = r["parts"]
        own = f"; torch's own layers {p['dense_plain']:.3g} s" if "dense_plain" in p else ""
        return f"{p['dense']:.3g} s ({r['gflop']:.0f} GFLOP{own})"

    add("dense layers", dense)
    add("score: add + min(tanh, sigmoid) + projection alone", parts)
    add(
        "score, the three passes in sequence",
        lambda r, m: f"{r['parts']['sequence']:.3g} s" if m == "eager" else "",
    )
    add(
        "score, one C kernel (`fused_score`)",
        lambda r, m: "" if m != "eager" else seconds_cell(r["parts"].get("kernel")),
    )
    add("word choice", lambda r, m: f"{r['parts']['choice']:.2g} s" if m == "eager" else "")
    add("**floor** (each word's parts in turn)", lambda r, m: f"**{r[f'floor_{m}']:.3g} s**")
    add("ours", lambda r, m: seconds_cell(r.get(f"ours_{m}")))
    add("ours / floor, median of the rounds", ratio)
    add("reference (`bench.py`)", lambda r, m: seconds_cell(r.get("reference_seconds")))

    def allowed(r: dict[str, Any], mode: str) -> str:
        reference = r.get("reference_seconds")
        return f"{reference / r[f'floor_{mode}']:.1f}×" if reference else "–"

    add("most speed-up the floor allows", allowed)
    lines += [
        "",
        speed_provenance(rows, "floor") + f" {rows[0]['images']} images, "
        f"{rows[0]['max_length']} words, COCO size; each round times the floor, then "
        f"ours right after it.",
    ]
    return "\n".join(lines) + "\n"


def speed_train_floor(rows: Rows) -> str:
    """The training step's floor (``benchmarks/train_floor.py``): per size and precision its
    products alone, ours and the reference's step in the same rounds, and the speed-ups."""
    rows = by_host_and_size(rows, "train_floor")
    lines = [
        "| host | size | precision | products (GFLOP) | products alone | largest | ours | ours / "
        "floor | reference | ours' speed-up | most speed-up the floor allows |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        largest, seconds = next(iter(r["largest"].items()))
        lines.append(
            f"| {r['device']} | {r['size']} | {r['precision']} | {r['calls']} ({r['gflop']:.1f}) | "
            f"{r['floor_seconds']:.3g} s | {largest}: {seconds:.3g} s | "
            f"{r['ours_seconds']:.3g} s | {statistics.median(r['ours_over_floor']):.2f}× | "
            f"{r['reference_seconds']:.3g} s | "
            f"{r['reference_seconds'] / r['ours_seconds']:.1f}× | "
            f"**{statistics.median(r['reference_over_floor']):.1f}×** |"
        )
    lines += [
        "",
        speed_provenance(rows, "training floor")
        + f" Batch {rows[0]['batch_size']}, {rows[0]['words']} words; each of "
        f"{rows[0]['rounds']} rounds times the products, then ours and the reference; "
        "ratios are the medians of the rounds'.",
    ]
    return "\n".join(lines) + "\n"


def speed_allocator(rows: Rows) -> str:
    """Freed memory kept in the process (``benchmarks/allocator.py``): per host, size and
    precision the step with glibc's default and with freed memory kept, and the speed-up."""
    rows = by_host_and_size(rows, "allocator")
    lines = [
        "| host | size | precision | glibc's default | freed memory kept | speed-up (rounds) | "
        "page faults a step: default / kept |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        speedups = r["speedups"]
        lines.append(
            f"| {r['device']} | {r['size']} | {r['precision']} | "
            f"{statistics.median(r['default_seconds']):.3g} s | "
            f"{statistics.median(r['kept_seconds']):.3g} s | "
            f"**{statistics.median(speedups):.2f}×** ({min(speedups):.2f}-"
            f"{max(speedups):.2f}×) | {r['default_faults']:,.0f} / {r['kept_faults']:,.0f} |"
        )
    lines += [
        "",
        speed_provenance(rows, "allocator")
        + f" Batch 32; each of {rows[0]['rounds']} rounds times {rows[0]['repeats']} steps "
        "in a fresh process of each kind, in alternating order; seconds are the medians of "
        "the rounds' medians.",
    ]
    return "\n".join(lines) + "\n"
