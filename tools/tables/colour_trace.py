"""The colour probe's trace over the first training steps (``results/colour_trace.json``,
rows of ``tools/colour_trace.py``)."""

from __future__ import annotations

from tools.tables.common import Rows, commands, header, line, provenance, spread

# the general score's maps beside a score that trains, and the family's seeds that stalled
# with the shipped blocks, each beside a seed of the same member that trained
SCORE_TRACE = ("general", "scaled_dot")
FAMILY_TRACE = ("cosine", "none", "location")


def colour_trace(rows: Rows) -> str:
    """The colour probe at each encoder stage over the first training steps
    (``tools/colour_trace.py``): one line per step, one column per (variant, seed) and stage
    (the stem, the last block, the decoder's grid): the traces of the blocks. The family's
    traces are :func:`score_trace`'s and :func:`family_trace`'s, the starts
    :func:`score_start`'s."""
    rows = [r for r in rows if r["variant"] not in (*SCORE_TRACE, *FAMILY_TRACE)
            and r["variant"] not in _at_start_only(rows)]  # fmt: skip
    runs = list(dict.fromkeys((r["variant"], r["seed"]) for r in rows))
    by = {(r["variant"], r["seed"], r["step"]): r for r in rows}
    last = max(int(k[5:]) for k in rows[0] if k.startswith("stage"))
    stages = [("stage0", "stem"), (f"stage{last}", "last block"), ("grid", "grid")]
    head = ["step"] + [f"{v} seed {s}: {label}" for v, s in runs for _, label in stages]
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for step in sorted({r["step"] for r in rows}):
        cells = [str(step)]
        for variant, seed in runs:
            row = by.get((variant, seed, step))
            cells += [f"{row[k]:.2f}" if row else "–" for k, _ in stages]
        lines.append("| " + " | ".join(cells) + " |")
    overrides = {r["variant"]: r["overrides"] for r in rows}
    settings = "; ".join(
        f"{v}: " + (", ".join(f"`{o}`" for o in o_list) or "the config as it is")
        for v, o_list in overrides.items()
    )
    first = rows[0]
    lines += ["", f"{len(rows)} rows of `results/colour_trace.json`, `{first['config']}` "
              f"({settings}): {provenance(rows)}. Held-out accuracy of the colour probe "
              f"(chance 0.167) before each step, on the objects of 300 validation images, from "
              f"the feature under each object's centre; each run stops after its last probe "
              f"(the seed study's rows are the whole runs). Re-run: "
              f"{commands(rows, ordered=True)}."]  # fmt: skip
    return "\n".join(lines) + "\n"


def score_trace(rows: Rows) -> str:
    """The traces that also read the first word's attention map (the scores of the family
    that still stall): one line per step, per (variant, seed) the colour probe of the
    decoder's grid, the first word's map's largest weight and its scores' spread."""
    rows = [r for r in rows if r["variant"] in SCORE_TRACE]
    if not rows:
        return "No rows of `results/colour_trace.json` trace the first word's map yet.\n"
    runs = list(dict.fromkeys((r["variant"], r["seed"]) for r in rows))
    by = {(r["variant"], r["seed"], r["step"]): r for r in rows}
    head = ["step"] + [f"{v} seed {s}: {label}" for v, s in runs
                       for label in ("grid probe", "first word's peak", "score sd")]  # fmt: skip
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for step in sorted({r["step"] for r in rows}):
        cells = [str(step)]
        for variant, seed in runs:
            row = by.get((variant, seed, step))
            cells += ([f"{row['grid']:.2f}", f"{row['first_peak']:.3f}",
                       f"{row['first_score_sd']:.1f}"] if row else ["–"] * 3)  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
    settings = "; ".join(
        f"{v}: " + (", ".join(f"`{o}`" for o in o_list) or "the config as it is")
        for v, o_list in {r["variant"]: r["overrides"] for r in rows}.items()
    )
    lines += ["", f"{len(rows)} rows of `results/colour_trace.json`, `{rows[0]['config']}` "
              f"({settings}): {provenance(rows)}. Before each step: the colour probe of the "
              f"decoder's grid (chance 0.167), as above, and the mean over 300 validation "
              f"images of the first word's map's largest weight (an even map's: 1 / 36 = "
              f"0.028) and the standard deviation of its scores across the cells. "
              f"Re-run: {commands(rows, ordered=True)}."]  # fmt: skip
    return "\n".join(lines) + "\n"


def family_trace(rows: Rows) -> str:
    """The family's seeds that stalled with the shipped blocks beside a seed of the same
    member that trained: one line per step, per (variant, seed) the colour probe of the last
    block and of the decoder's grid, and the first word's map's largest weight."""
    rows = [r for r in rows if r["variant"] in FAMILY_TRACE]
    if not rows:
        return "No rows of `results/colour_trace.json` trace the family's stalled seeds yet.\n"
    runs = list(dict.fromkeys((r["variant"], r["seed"]) for r in rows))
    by = {(r["variant"], r["seed"], r["step"]): r for r in rows}
    last = max(int(k[5:]) for k in rows[0] if k.startswith("stage"))
    head = ["step"] + [f"{v} seed {s}: {label}" for v, s in runs
                       for label in ("last block", "grid", "first word's peak")]  # fmt: skip
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for step in sorted({r["step"] for r in rows}):
        cells = [str(step)]
        for variant, seed in runs:
            row = by.get((variant, seed, step))
            if row is None:
                cells += ["–"] * 3
                continue
            peak = f"{row['first_peak']:.2f}" if "first_peak" in row else "–"
            cells += [f"{row[f'stage{last}']:.2f}", f"{row['grid']:.2f}", peak]
        lines.append("| " + " | ".join(cells) + " |")
    settings = "; ".join(
        f"{v}: " + (", ".join(f"`{o}`" for o in o_list) or "the config as it is")
        for v, o_list in {r["variant"]: r["overrides"] for r in rows}.items()
    )
    lines += ["", f"{len(rows)} rows of `results/colour_trace.json`, `{rows[0]['config']}` "
              f"({settings}): {provenance(rows)}. Held-out accuracy of the colour probe "
              f"(chance 0.167) before each step, as above, and the first word's map's largest "
              f"weight (an even map's: 0.028; no attention has no map). Re-run: "
              f"{commands(rows, ordered=True)}."]  # fmt: skip
    return "\n".join(lines) + "\n"


def _first_word_rows(rows: Rows) -> Rows:
    return [r for r in rows if "first_peak" in r]


def _at_start_only(rows: Rows) -> set[str]:
    """The variants probed before the first step only (``--steps 0``)."""
    steps: dict[str, set[int]] = {}
    for r in _first_word_rows(rows):
        steps.setdefault(r["variant"], set()).add(r["step"])
    return {v for v, s in steps.items() if s == {0}}


def score_start(rows: Rows) -> str:
    """Each score's first-word map before any step (``--steps 0``), over its seeds: how peaked
    the random network's attention starts."""
    start = _at_start_only(rows)
    rows = [r for r in _first_word_rows(rows) if r["variant"] in start]
    if not rows:
        return "No rows of `results/colour_trace.json` probe the start alone yet.\n"
    lines = header(["variant", "settings", "seeds", "first word's peak", "each seed",
                    "entropy (nats)", "score sd across cells"])  # fmt: skip
    for variant in dict.fromkeys(r["variant"] for r in rows):
        group = sorted((r for r in rows if r["variant"] == variant), key=lambda r: r["seed"])
        lines.append(line([
            variant,
            ", ".join(f"`{o}`" for o in group[0]["overrides"]) or "the config as it is",
            str(len(group)),
            spread([r["first_peak"] for r in group]),
            ", ".join(f"{r['first_peak']:.3f} ({r['seed']})" for r in group),
            spread([r["first_entropy"] for r in group], 2),
            spread([r["first_score_sd"] for r in group], 2),
        ]))  # fmt: skip
    lines += ["", f"{len(rows)} rows of `results/colour_trace.json`, `{rows[0]['config']}`: "
              f"{provenance(rows)}. The random network before its first step, on 300 "
              f"validation images; an even map's peak over the 6 x 6 grid is 1 / 36 = 0.028 "
              f"and its entropy 3.58 nats. Re-run: {commands(rows, ordered=True)}."]  # fmt: skip
    return "\n".join(lines) + "\n"
