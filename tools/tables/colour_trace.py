"""The colour probe's trace over the first training steps (``results/colour_trace.json``,
rows of ``tools/colour_trace.py``)."""

from __future__ import annotations

from collections.abc import Callable

from tools.tables.common import Row, Rows, commands, header, line, provenance, spread

# the general score's maps beside a score that trains, and the family's seeds that stalled
# with the shipped blocks, each beside a seed of the same member that trained
SCORE_TRACE = ("general", "scaled_dot")
FAMILY_TRACE = ("cosine", "none", "location")


Column = tuple[str, Callable[[Row], str]]  # a label, and a row's cell


def _grid(rows: Rows, columns: list[Column]) -> list[str]:
    """One line per step and, per (variant, seed) in the rows' order, one cell per column
    (– where the run has no row at that step)."""
    runs = list(dict.fromkeys((r["variant"], r["seed"]) for r in rows))
    by = {(r["variant"], r["seed"], r["step"]): r for r in rows}
    head = ["step"] + [f"{v} seed {s}: {label}" for v, s in runs for label, _ in columns]
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for step in sorted({r["step"] for r in rows}):
        cells = [str(step)]
        for variant, seed in runs:
            row = by.get((variant, seed, step))
            cells += [cell(row) if row else "–" for _, cell in columns]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def _settings(rows: Rows) -> str:
    """Each variant's overrides, in the rows' order."""
    return "; ".join(
        f"{v}: " + (", ".join(f"`{o}`" for o in o_list) or "the config as it is")
        for v, o_list in {r["variant"]: r["overrides"] for r in rows}.items()
    )


def _last_stage(rows: Rows) -> str:
    return f"stage{max(int(k[5:]) for k in rows[0] if k.startswith('stage'))}"


def _probe(key: str) -> Callable[[Row], str]:
    """A row's colour probe at ``key`` (a stage, or the grid) as a cell."""
    return lambda row: f"{row[key]:.2f}"


def colour_trace(rows: Rows) -> str:
    """The colour probe at each encoder stage over the first training steps
    (``tools/colour_trace.py``): one line per step, one column per (variant, seed) and stage
    (the stem, the last block, the decoder's grid): the traces of the blocks. The family's
    traces are :func:`score_trace`'s and :func:`family_trace`'s, the starts
    :func:`score_start`'s."""
    left_out = {*SCORE_TRACE, *FAMILY_TRACE, *_at_start_only(rows)}
    rows = [r for r in rows if r["variant"] not in left_out]
    last = _last_stage(rows)
    columns = [("stem", _probe("stage0")), ("last block", _probe(last)), ("grid", _probe("grid"))]
    lines = _grid(rows, columns)
    lines += [
        "",
        f"{len(rows)} rows of `results/colour_trace.json`, `{rows[0]['config']}` "
        f"({_settings(rows)}): {provenance(rows)}. Held-out accuracy of the colour probe "
        f"(chance 0.167) before each step, on the objects of 300 validation images, from "
        f"the feature under each object's centre; each run stops after its last probe "
        f"(the seed study's rows are the whole runs). Re-run: "
        f"{commands(rows, ordered=True)}.",
    ]
    return "\n".join(lines) + "\n"


def score_trace(rows: Rows) -> str:
    """The traces that also read the first word's attention map (the scores of the family
    that still stall): one line per step, per (variant, seed) the colour probe of the
    decoder's grid, the first word's map's largest weight and its scores' spread."""
    rows = [r for r in rows if r["variant"] in SCORE_TRACE]
    if not rows:
        return "No rows of `results/colour_trace.json` trace the first word's map yet.\n"
    lines = _grid(
        rows,
        [
            ("grid probe", _probe("grid")),
            ("first word's peak", lambda r: f"{r['first_peak']:.3f}"),
            ("score sd", lambda r: f"{r['first_score_sd']:.1f}"),
        ],
    )
    lines += [
        "",
        f"{len(rows)} rows of `results/colour_trace.json`, `{rows[0]['config']}` "
        f"({_settings(rows)}): {provenance(rows)}. Before each step: the colour probe of "
        f"the decoder's grid (chance 0.167), as above, and the mean over 300 validation "
        f"images of the first word's map's largest weight (an even map's: 1 / 36 = "
        f"0.028) and the standard deviation of its scores across the cells. "
        f"Re-run: {commands(rows, ordered=True)}.",
    ]
    return "\n".join(lines) + "\n"


def family_trace(rows: Rows) -> str:
    """The family's seeds that stalled with the shipped blocks beside a seed of the same
    member that trained: one line per step, per (variant, seed) the colour probe of the last
    block and of the decoder's grid, and the first word's map's largest weight."""
    rows = [r for r in rows if r["variant"] in FAMILY_TRACE]
    if not rows:
        return "No rows of `results/colour_trace.json` trace the family's stalled seeds yet.\n"
    columns = [
        ("last block", _probe(_last_stage(rows))),
        ("grid", _probe("grid")),
        ("first word's peak", lambda r: f"{r['first_peak']:.2f}" if "first_peak" in r else "–"),
    ]
    lines = _grid(rows, columns)
    lines += [
        "",
        f"{len(rows)} rows of `results/colour_trace.json`, `{rows[0]['config']}` "
        f"({_settings(rows)}): {provenance(rows)}. Held-out accuracy of the colour probe "
        f"(chance 0.167) before each step, as above, and the first word's map's largest "
        f"weight (an even map's: 0.028; no attention has no map). Re-run: "
        f"{commands(rows, ordered=True)}.",
    ]
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
    lines = header(
        [
            "variant",
            "settings",
            "seeds",
            "first word's peak",
            "each seed",
            "entropy (nats)",
            "score sd across cells",
        ]
    )
    for variant in dict.fromkeys(r["variant"] for r in rows):
        group = sorted((r for r in rows if r["variant"] == variant), key=lambda r: r["seed"])
        lines.append(
            line(
                [
                    variant,
                    ", ".join(f"`{o}`" for o in group[0]["overrides"]) or "the config as it is",
                    str(len(group)),
                    spread([r["first_peak"] for r in group]),
                    ", ".join(f"{r['first_peak']:.3f} ({r['seed']})" for r in group),
                    spread([r["first_entropy"] for r in group], 2),
                    spread([r["first_score_sd"] for r in group], 2),
                ]
            )
        )
    lines += [
        "",
        f"{len(rows)} rows of `results/colour_trace.json`, `{rows[0]['config']}`: "
        f"{provenance(rows)}. The random network before its first step, on 300 "
        f"validation images; an even map's peak over the 6 x 6 grid is 1 / 36 = 0.028 "
        f"and its entropy 3.58 nats. Re-run: {commands(rows, ordered=True)}.",
    ]
    return "\n".join(lines) + "\n"
