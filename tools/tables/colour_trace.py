"""The colour probe's trace over the first training steps (``results/colour_trace.json``,
rows of ``tools/colour_trace.py``)."""

from __future__ import annotations

from tools.tables.common import Rows, commands, provenance


def colour_trace(rows: Rows) -> str:
    """The colour probe at each encoder stage over the first training steps
    (``tools/colour_trace.py``): one line per step, one column per (variant, seed) and stage
    (the stem, the last block, the decoder's grid)."""
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
