"""The speed page's tables (``results/speed.json``: rows of ``benchmarks/time_to_quality.py``,
``bench.py``, ``profile_epoch.py`` and others, told apart by ``kind``); the floors' tables are
in :mod:`tools.tables.speed_floors`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tools.tables.common import (
    Rows,
    commands,
    device_of,
    header,
    line,
    portable,
    provenance,
    score,
)
from tools.tables.speed_rows import of_kind, seconds_cell, speed_provenance


def speed_quality(rows: Rows) -> str:
    """Time to quality (``benchmarks/time_to_quality.py``): each run's wall seconds and test
    scores against its targets."""
    rows = of_kind(rows, "quality")
    hosts = len({r.get("device") for r in rows}) > 1  # each run names its host
    lines = header(
        [
            "run",
            "target",
            "seconds",
            "test exact",
            "3 objects",
            "pointing: colour / size / shape",
            "",
        ]
    )
    for r in rows:
        t = r["target"]
        target = f"≤ {t['seconds']:.0f} s; exact ≥ {t['exact']:.2f}"
        if "three_objects" in t:
            target += f", 3 objects ≥ {t['three_objects']:.2f}"
        if "pointing" in t:
            target += f", pointing ≥ {t['pointing']:.2f}"
        pointing = r["pointing"] if r["recipe"] != "quickstart" else {}
        run = f"`{portable(r['run_command'])}`" if r["recipe"] == "quickstart" else r["name"]
        cells = [
            f"{run} ({r.get('device')})" if hosts else run,
            target,
            f"**{r['seconds']:.0f}**",
            f"{r['exact']:.3f}",
            score(r.get("three_objects")),
            " / ".join(score(v) for v in pointing.values()) or "–",
            "met" if r["met"] else "**not met**",
        ]
        lines.append(line(cells))
    runs = commands([r for r in rows if r["recipe"] != "quickstart"], "run_command", ordered=True)
    lines += [
        "",
        speed_provenance(rows, "time-to-quality") + f" The training runs: {runs}; each timed from "
        "start to exit, then its `best.pt` scored on the test split (greedy).",
    ]
    return "\n".join(lines) + "\n"


def speed_bench(rows: Rows) -> str:
    """Ours against the reference (``benchmarks/bench.py``): per size, host, precision and
    task the median seconds of the reference, of ours and of ours compiled, and the ratios
    of times measured in the same run."""
    rows = of_kind(rows, "bench")
    groups: dict[tuple, dict[tuple, dict[str, Any]]] = {}
    for r in rows:
        name = device_of(r)  # the CPU's or the GPU's
        host = r["device"] if name is None else f"{r['device']}: {name}"
        group = groups.setdefault((r["size"], host, r["precision"], r["task"]), {})
        group[(r["impl"], r["compiled"])] = r
    lines = header(
        [
            "size",
            "host",
            "precision",
            "task",
            "reference",
            "ours",
            "speed-up",
            "ours, compiled",
            "speed-up",
        ]
    )
    for (size, host, precision, task), group in groups.items():
        reference_row = group.get(("reference", False)) or {}
        reference = reference_row.get("median_s")
        cells = [size, host, precision, task.replace("_", " "), seconds_cell(reference)]
        for compiled in (False, True):
            ours_row = group.get(("ours", compiled)) or {}
            ours = ours_row.get("median_s")
            # a ratio only between times of one run (rows of one commit)
            same_run = ours_row.get("commit") == reference_row.get("commit")
            ratio = f"{reference / ours:.1f}×" if reference and ours and same_run else "–"
            cells += [seconds_cell(ours), ratio]
        lines.append(line(cells))
    passed = all(r["checks_passed"] for r in rows)
    lines += [
        "",
        speed_provenance(rows, "timing")
        + (
            " Ours and the reference agreed in every check of the run."
            if passed
            else " **Ours and the reference disagreed in a check.**"
        ),
    ]
    return "\n".join(lines) + "\n"


def speed_profile(rows: Rows) -> str:
    """Where a training step's time goes (``benchmarks/profile_epoch.py``): the median
    milliseconds of each phase per step, one column per measured configuration."""
    rows = [r for r in of_kind(rows, "profile") if not r["config"].startswith("configs/flickr8k")]

    hosts = len({r.get("device") for r in rows}) > 1

    def label(r: dict[str, Any]) -> str:
        words = [Path(r["config"]).stem, *r["overrides"]]
        words.append("word loop" if r["step_loop"] else "all words at once")
        words.append("channels-last" if r["channels_last"] else "NCHW")
        if hosts:
            words.append(str(r.get("device")))
        return ", ".join(words)

    lines = [
        "| phase (ms per step) | " + " | ".join(label(r) for r in rows) + " |",
        "| --- |" + " --- |" * len(rows),
    ]
    phases = list(dict.fromkeys(name for r in rows for name in r["phases"]))
    for name in phases:
        cells = [f"{r['phases'][name] * 1e3:.0f}" if name in r["phases"] else "–" for r in rows]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    lines.append(
        "| **step** | " + " | ".join(f"**{r['step_seconds'] * 1e3:.0f}**" for r in rows) + " |"
    )
    lines.append(
        "| validation (decode + score), per epoch | "
        + " | ".join(
            f"{(r['validation_decode_seconds'] + r['validation_score_seconds']):.1f} s"
            for r in rows
        )
        + " |"
    )
    lines.append(
        "| **epoch** | " + " | ".join(f"**{r['epoch_seconds']:.1f} s**" for r in rows) + " |"
    )
    lines += [
        "",
        speed_provenance(rows, "profile") + f" Medians of each run's timed steps; "
        f"{rows[0]['steps_per_epoch']} steps per epoch, batch {rows[0]['batch_size']}.",
    ]
    return "\n".join(lines) + "\n"


def speed_sharing(rows: Rows) -> str:
    """Two trainings on one machine (``benchmarks/two_jobs.py``): each arrangement's jobs and
    threads, each job's steps per second, their sum, and the sum against one job alone."""
    rows = of_kind(rows, "two_jobs")
    if not rows:
        return "No rows of `results/speed.json` yet: the command above writes them.\n"
    alone = {(r.get("device"), r["config"]): r["steps_per_s_total"] for r in rows if r["jobs"] == 1}
    lines = [
        "| host | jobs side by side | threads each | steps/s of each job | steps/s in all | "
        "to one job alone |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for row in rows:
        each = ", ".join(f"{s:.2f}" for s in row["steps_per_s"])
        one = alone.get((row.get("device"), row["config"]))
        ratio = "–" if not one else f"{row['steps_per_s_total'] / one:.2f}x"
        lines.append(
            f"| {row.get('device', '–')} | {row['jobs']} | {row['threads']} | {each} | "
            f"{row['steps_per_s_total']:.2f} | {ratio} |"
        )
    configs = sorted({r["config"] for r in rows})
    note = (
        f"{len(rows)} rows of `results/speed.json` ({', '.join(configs)}): "
        f"{provenance(rows)}. Made by {commands(rows)}."
    )
    return "\n".join([*lines, "", note]) + "\n"


def speed_encoder(rows: Rows) -> str:
    """Feature extraction's encoder with each convolution and its clamp apart and joined
    (``benchmarks/encoder_speed.py``): per grid and precision, seconds per batch of images
    each way, the ratio, and whether the grids are equal to the bit."""
    rows = of_kind(rows, "encoder")
    if not rows:
        return "No rows of `results/speed.json` yet: the command above writes them.\n"
    lines = [
        "| grid | precision | images | seconds apart | seconds joined | speed-up | "
        "the same grid | host, threads |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    key = lambda r: (str(r.get("device")), r["grid"] != "best", r["precision"])  # noqa: E731
    for row in sorted(rows, key=key):
        h, w = row["grid_shape"]
        same = (
            "to the bit"
            if row["bit_identical"]
            else f"to {row['max_abs_difference']:.1e} (largest difference)"
        )
        lines.append(
            f"| {row['grid']} ({h}x{w} x {row['channels']:,}) | {row['precision']} | "
            f"{row['images']} | {row['seconds_apart']:.2f} | {row['seconds_fused']:.2f} | "
            f"{row['speedup']:.2f}x | {same} | {row['device']}, {row['threads']} |"
        )
    note = (
        f"{len(rows)} rows of `results/speed.json`: {provenance(rows)}. Made by {commands(rows)}."
    )
    return "\n".join([*lines, "", note]) + "\n"


ROOFLINE_TASKS = {
    "train": "training step, cached grids",
    "beam5": "beam search, k=5",
    "greedy": "greedy",
}


def roofline(rows: Rows) -> str:
    """Each task's matrix FLOPs, time and rate, its share of the host's two peaks
    (``benchmarks/roofline.py``), by precision; for decoding, the bytes it must read, its
    share of the roofline's bound, its time with torch's own (unpacked) layers, with the
    additive score in torch's form instead of its C kernel, and with the score's tanh
    instead of its sigmoid form; the host last."""
    if not rows:
        return "No rows of `results/roofline.json` yet: the command above writes them.\n"
    lines = [
        "| task | precision | GFLOP | seconds | GFLOP/s | peak: 2,048-cube / the decoder's "
        "products (GFLOP/s) | share of the cube's peak | share of the decoder's products' "
        "| GB read (at GB/s) | roofline's bound | share of the roofline | torch's own layers "
        "| the score in torch's form | the score's tanh | host |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- "
        "| --- |",
    ]
    order = list(ROOFLINE_TASKS)
    key = lambda r: (str(r.get("device")), r["precision"], order.index(r["task"]))  # noqa: E731
    for row in sorted(rows, key=key):
        lines.append(
            f"| {ROOFLINE_TASKS[row['task']]} | {row['precision']} | {row['gflop']:.1f} | "
            f"{row['seconds']:.3f} | {row['gflops_per_s']:.0f} | "
            f"{row['peak_square_gflops_per_s']:.0f} / {row['peak_model_gflops_per_s']:.0f} | "
            f"{row['share_of_square_peak']:.0%} | {row['share_of_model_peak']:.0%} | "
            + " | ".join(_memory_roof(row))
            + f" | {_seconds_against(row, 'seconds_torch_score')}"
            + f" | {_seconds_against(row, 'seconds_tanh')} | {row.get('device', '–')} |"
        )
    images = sorted({r["images"] for r in rows})
    note = (
        f"{len(rows)} rows of `results/roofline.json`: {provenance(rows)}. Made by "
        f"{commands(rows)}. COCO size, {', '.join(map(str, images))} images, 20 words."
    )
    return "\n".join([*lines, "", note]) + "\n"


def _seconds_against(row: dict[str, Any], field: str) -> str:
    """A row's other timing ``field`` and its ratio to the row's own seconds, or "–"."""
    other = row.get(field)
    return "–" if other is None else f"{other:.3f} s ({other / row['seconds']:.2f}x)"


def _memory_roof(row: dict[str, Any]) -> list[str]:
    """The memory-roof cells of a roofline row ("–" where the row has none: training) and
    its time with torch's own layers."""
    own = _seconds_against(row, "seconds_unpacked")
    if row.get("gbytes") is None:
        return ["–"] * 3 + [own]
    return [
        f"{row['gbytes']:.2f} ({row['bandwidth_gb_per_s']:.0f})",
        f"{row['roofline_seconds']:.3f} s",
        f"{row['share_of_roofline']:.0%}",
        own,
    ]
