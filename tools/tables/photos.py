"""The photo recipe's tables (``results/photos.json``, rows of ``benchmarks/photos.py``): the
recipe and its baselines, its levers, and the two-stage recipes timed whole."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tools.tables.common import PLUMBING, Rows, commands, header, line, provenance, spread

RECIPE = "recipe"  # benchmarks/photos.py's variant name of the config as it is
# The variant of the shipped two-stage recipe (configs/photos_mobilenet.yaml with dropout 0.3
# for 12 epochs, then configs/photos_scst.yaml), which the photos table shows beside the
# cross-entropy models
RECIPE_SCST = "budget_bf16_10"


def _variant(row: dict[str, Any]) -> str:
    return row.get("variant", RECIPE)


def photos(rows: Rows) -> str:
    """Test scores of the photo recipe and its baselines: per model the mean over seeds
    (± the standard deviation across seeds), each seed's CIDEr-D, and the recipe's time."""
    rows = [r for r in rows if _variant(r) in (RECIPE, RECIPE_SCST)]
    order = ["nn", "none", "soft", "hard", "soft+scst"]
    names = {
        "nn": "nearest neighbour (consensus, k on val)",
        "none": "no attention",
        "soft": "soft attention",
        "hard": "hard attention (exact marginal)",
        "soft+scst": "soft attention, then self-critical training",
    }

    def model_of(row: dict[str, Any]) -> str:
        return row["model"] + ("+scst" if _variant(row) == RECIPE_SCST else "")

    lines = header(
        [
            "model",
            "test CIDEr-D",
            "each seed",
            "seeds above nn",
            "BLEU-1",
            "BLEU-4",
            "ROUGE-L",
            "recipe (s)",
        ]
    )
    nn = [r["CIDEr"] for r in rows if r["model"] == "nn"]
    for model in sorted({model_of(r) for r in rows}, key=order.index):
        group = sorted((r for r in rows if model_of(r) == model), key=lambda r: r["seed"] or 0)
        if model == "nn":
            each = f"k = {group[0]['k']} (deterministic)"
        else:
            each = ", ".join(f"{r['CIDEr']:.3f} ({r['seed']})" for r in group)
        # rows trained beside other work (benchmarks/photos.py --machine-busy) are not timed
        seconds = [r["recipe_seconds"] for r in group if r.get("timed_alone", True)]
        recipe = "-" if not seconds else f"{min(seconds):.0f}"
        recipe += f"-{max(seconds):.0f}" if len(seconds) > 1 else ""
        above = (
            "–"
            if model == "nn" or not nn
            else (f"{sum(r['CIDEr'] > nn[0] for r in group)} of {len(group)}")
        )
        cells = [names[model], spread([r["CIDEr"] for r in group]), each, above]
        cells += [spread([r[key] for r in group]) for key in ("Bleu_1", "Bleu_4", "ROUGE_L")]
        cells.append(recipe)
        lines.append(line(cells))
    first = rows[0]
    lines.append("")
    lines.append(
        f"{len(rows)} rows of `results/photos.json` (each with its command): "
        f"{provenance(rows)}. Test split of {first['test_images']} photos, beam "
        f"{first['beam_size']}; seeds in brackets, ± the standard deviation across seeds."
    )
    busy = [r for r in rows if not r.get("timed_alone", True)]
    if busy:
        lines[-1] += (
            " Recipe seconds only from runs with nothing else on the machine; not timed: "
            + ", ".join(f"{r['model']} seed {r['seed']}" for r in busy)
            + "."
        )
    return "\n".join(lines) + "\n"


def photo_levers(rows: Rows) -> str:
    """The photo recipe's soft-attention model against the same model with one setting
    changed (``benchmarks/photos.py --variant``): validation and test CIDEr-D by seed."""
    soft = [r for r in rows if r["model"] == "soft" and "then" not in r]  # one stage only
    lines = header(
        ["variant", "setting changed", "seeds", "val CIDEr-D", "test CIDEr-D", "each seed (test)"]
    )
    variants = sorted({_variant(r) for r in soft}, key=lambda v: (v != RECIPE, v))
    for variant in variants:
        group = sorted((r for r in soft if _variant(r) == variant), key=lambda r: r["seed"])
        changed = sorted({o for r in group for o in r["overrides"] if not o.startswith(PLUMBING)})
        setting = ", ".join(f"`{o}`" for o in changed) or "(the config as it is)"
        each = ", ".join(f"{r['CIDEr']:.3f} ({r['seed']})" for r in group)
        cells = [
            variant,
            setting,
            str(len(group)),
            spread([r["val_CIDEr"] for r in group]),
            spread([r["CIDEr"] for r in group]),
            each,
        ]
        lines.append(line(cells))
    nn = [r for r in rows if r["model"] == "nn"]
    lines.append("")
    if nn:
        lines.append(
            f"The nearest neighbour scores {nn[0]['CIDEr']:.3f} on test at k = {nn[0]['k']} "
            f"(val {nn[0]['val_CIDEr_by_k'][str(nn[0]['k'])]:.3f})."
        )
    lines.append(
        f"{len(soft)} rows of `results/photos.json`: {provenance(soft)}. Each variant's "
        f"command: {commands([r for r in soft if _variant(r) != RECIPE])}."
    )
    return "\n".join(lines) + "\n"


def photo_budget_timed(rows: Rows) -> str:
    """Two-stage photo recipes timed whole (``benchmarks/photos.py --then``): per row the
    stages' settings, the seconds of each part of the recipe, and the test CIDEr-D against
    the nearest neighbour's of the same file."""
    staged = sorted((r for r in rows if "then" in r), key=lambda r: (_variant(r), r["seed"]))
    nn = next((r["CIDEr"] for r in rows if r["model"] == "nn"), None)
    head = [
        "variant",
        "seed",
        "first stage",
        "second stage",
        "prepare + extract s",
        "first stage s",
        "second stage s",
        "evaluate s",
        "**recipe s**",
        "test CIDEr-D",
        "above nn",
    ]
    lines = header(head)
    for r in staged:
        then = r["then"]
        first = [o for o in r["overrides"] if not o.startswith(PLUMBING)]
        second = [o for o in then["overrides"] if not o.startswith(PLUMBING)]
        before = (r.get("prepare_seconds") or 0) + (r.get("extract_seconds") or 0)
        cells = [
            _variant(r),
            str(r["seed"]),
            f"`{Path(r['config']).name}` " + ", ".join(f"`{o}`" for o in first),
            f"`{Path(then['config']).name}` " + ", ".join(f"`{o}`" for o in second),
            f"{before:.0f}",
            f"{then['first_seconds']:.0f}",
            f"{r['train_seconds'] - then['first_seconds']:.0f}",
            f"{r['evaluate_seconds']:.0f}",
            f"**{r['recipe_seconds']:.0f}**",
            f"{r['CIDEr']:.3f}",
            "–" if nn is None else ("yes" if r["CIDEr"] > nn else "no"),
        ]
        lines.append(line(cells))
    if not staged:
        lines.append("| (no two-stage rows yet) |" + " |" * (len(head) - 1))
    note = (
        "Rows of `results/photos.json` with a second stage; nearest neighbour "
        f"{'–' if nn is None else f'{nn:.3f}'} on test. The prepare and extract seconds are "
        "the file's (measured once, reused by later invocations). "
    )
    if staged:
        busy = [f"{_variant(r)} seed {r['seed']}" for r in staged if not r.get("timed_alone", True)]
        note += f"{len(staged)} rows: {provenance(staged)}"
        note += f" (not timed alone: {', '.join(busy)})" if busy else ""
        note += f"; commands: {commands(staged, ordered=True)}."
    lines += ["", note]
    return "\n".join(lines) + "\n"
