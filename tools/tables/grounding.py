"""Attention grounding against COCO's boxes (``results/grounding.json``, rows of
``tools/grounding_study.py``): per model and seed, per category and per word."""

from __future__ import annotations

import statistics
from typing import Any

from tools.tables.common import Rows, header, portable, provenance, score, source_note

GROUNDING_MAPS = ("model", "centre", "saliency", "even")


def _grounding_groups(rows: Rows) -> dict[tuple[str, str], Rows]:
    """The rows of each (model, variant), seeds in order."""
    groups: dict[tuple[str, str], Rows] = {}
    for row in sorted(rows, key=lambda r: (r["model"], r["variant"], r["seed"])):
        groups.setdefault((row["model"], row["variant"]), []).append(row)
    return groups


def _grounding_verdict(model: str, group: Rows) -> str:
    """Whether the model's pointing game beats the centre prior and its own saliency map on
    every seed by more than the spread of its own score over the seeds."""
    overall = [r["grounding"]["overall"] for r in group]
    spread = statistics.stdev([o["model"]["pointing"] for o in overall]) if len(group) > 1 else 0
    gaps, met = [], True
    for baseline in ("centre", "saliency"):
        diffs = [o["model"]["pointing"] - o[baseline]["pointing"] for o in overall]
        met = met and all(d > spread for d in diffs)
        gaps.append(f"{baseline} " + ", ".join(f"{d:+.3f}" for d in diffs))
    masses = [o["model"]["mass"] - o["saliency"]["mass"] for o in overall]
    verdict = (
        f"the model's own spread over the seeds (standard deviation) {spread:.3f}: it "
        f"{'beats' if met else 'does not beat'} both on every seed by more than that"
        if len(group) > 1
        else "one seed, so no spread to beat them by: a screen, not a verdict"
    )
    return (
        f"**{model}**, the model's pointing game minus the baseline's, seed by seed: "
        f"{'; '.join(gaps)}; {verdict}. Its mass in the boxes minus its saliency map's: "
        + ", ".join(f"{d:+.3f}" for d in masses)
        + "."
    )


def _decoding(row: dict[str, Any]) -> str:
    decoding = row["decoding"]
    return "greedy" if decoding["strategy"] == "greedy" else f"beam {decoding['beam_size']}"


def grounding(rows: Rows) -> str:
    """Attention grounding against COCO's boxes (``tools/grounding_study.py``): per model and
    seed the words scored, the pointing game and the mass in the boxes of the model's maps
    and of the baselines, the maps' median peak and mean entropy, then the verdict on the
    target (the model beats the centre prior and its saliency map on every seed)."""
    head = (
        " | ".join(f"pointing {m}" for m in GROUNDING_MAPS)
        + " | "
        + " | ".join(f"mass {m}" for m in GROUNDING_MAPS)
    )
    lines = [
        f"| model | seed | grid | words | {head} | median peak | mean entropy | other "
        "maps (pointing) | CIDEr-D |",
        "|" + " --- |" * 16,
    ]
    verdicts = []
    for (model, variant), group in _grounding_groups(rows).items():
        name = model if variant == "recipe" else f"{model} ({variant})"
        for row in group:
            o = row["grounding"]["overall"]
            others = ", ".join(
                f"{k} {o[k]['pointing']:.3f}" for k in o if k not in ("words", *GROUNDING_MAPS)
            )
            cells = [f"{o[m][k]:.3f}" for k in ("pointing", "mass") for m in GROUNDING_MAPS]
            peak, entropy = o["model"]["median_peak"], o["model"]["mean_entropy"]
            cider = score(row["scores"].get("CIDEr"))
            cells += [f"{peak:.4f}", f"{entropy:.3f}", others or "–", cider]
            grid = "x".join(str(n) for n in row["grounding"]["grid"])
            lines.append(
                f"| {name} | {row['seed']} | {grid} | {o['words']} | " + " | ".join(cells) + " |"
            )
        verdicts.append(_grounding_verdict(name, group))
    first = rows[0]
    evens = sorted(
        {
            (
                tuple(r["grounding"]["grid"]),
                round(r["grounding"]["overall"]["even"]["median_peak"], 4),
                round(r["grounding"]["overall"]["even"]["mean_entropy"], 3),
            )
            for r in rows
        }
    )
    even = "; ".join(
        f"{g[0]} x {g[1]}: peak {peak:.3f}, entropy {entropy:.3f} nats"
        for g, peak, entropy in evens
    )
    lines += [
        "",
        *verdicts,
        "",
        f"{len(rows)} rows of `results/grounding.json`: {provenance(rows)}. "
        f"{first['images']} images; an even map's peak and entropy by grid: {even}; "
        f"centre prior sd {first['grounding']['centre_sigma']} of the image's sides; "
        f"decoded {_decoding(first)}. The first row's command: "
        f"`{portable(first['command'])}`.",
    ]
    return "\n".join(lines) + "\n"


def _pooled(groups: list[dict[str, Any]]) -> dict[str, Any]:
    """One group's scores over seeds: words summed, each map's pointing weighted by words."""
    words = sum(g["words"] for g in groups)
    pooled = {"words": words, "seeds": len(groups)}
    for m in GROUNDING_MAPS:
        pooled[m] = sum(g[m]["pointing"] * g["words"] for g in groups) / words
    return pooled


def _grounding_breakdown(rows: Rows, key: str, label: str) -> str:
    """Per category (``key`` = categories) or word (words), pooled over each model's seeds
    (the recipes' rows: a lever or another decoding is in :func:`grounding` only)."""
    lines = [
        f"| model | {label} | seeds | words | "
        + " | ".join(f"pointing {m}" for m in GROUNDING_MAPS)
        + " | model minus the best baseline |",
        "|" + " --- |" * (5 + len(GROUNDING_MAPS)),
    ]
    for (model, variant), group in _grounding_groups(rows).items():
        if variant != "recipe":  # the levers and other decodings: the first table only
            continue
        name = model
        found: dict[str, list[dict[str, Any]]] = {}
        for row in group:
            for item, scores in row["grounding"][key].items():
                found.setdefault(item, []).append(scores)
        pooled = {item: _pooled(g) for item, g in found.items()}
        for item, p in sorted(pooled.items(), key=lambda kv: (-kv[1]["words"], kv[0])):
            gap = p["model"] - max(p[m] for m in GROUNDING_MAPS if m != "model")
            lines.append(
                f"| {name} | {item} | {p['seeds']} | {p['words']} | "
                + " | ".join(f"{p[m]:.2f}" for m in GROUNDING_MAPS)
                + f" | {gap:+.2f} |"
            )
    return "\n".join(lines) + "\n"


def grounding_categories(rows: Rows) -> str:
    """:func:`grounding` per COCO category, pooled over the seeds (weighted by words)."""
    table = _grounding_breakdown(rows, "categories", "category")
    return f"{table}\n{source_note(rows, 'grounding')}\n"


def grounding_words(rows: Rows) -> str:
    """:func:`grounding` per generated word, pooled over the seeds, and the words that name a
    category their photo lacks."""
    table = _grounding_breakdown(rows, "words", "word")
    absent: dict[str, int] = {}
    for row in (r for r in rows if r["variant"] == "recipe"):
        for word, count in row["grounding"]["absent"].items():
            absent[word] = absent.get(word, 0) + count
    listed = ", ".join(f"{w} {n}" for w, n in sorted(absent.items(), key=lambda kv: -kv[1]))
    note = "Words that name a category their photo lacks (not scored; the recipes' rows)"
    return f"{table}\n{note}: {listed}. {source_note(rows, 'grounding')}\n"


def grounding_levers(rows: Rows) -> str:
    """The soft model with one lever moved (rows of a ``--variant``) against the recipe: what
    the lever changed in the checkpoint's settings, then over the seeds the mean pointing game
    of the word maps and its margin over the centre prior and the saliency map, the mass in
    the boxes, how peaked the maps are (against an even map on the same grid), and the
    captions' CIDEr-D on the COCO photos."""
    soft = [r for r in rows if r["model"] == "soft"]
    recipe = next((r["settings"] for r in soft if r["variant"] == "recipe"), {})
    lines = header(
        "variant | changed | seeds | pointing model | minus centre | minus saliency | "
        "mass model | minus saliency | median peak (even map) | mean entropy | CIDEr-D"
    )
    for (_, variant), group in _grounding_groups(soft).items():
        overall = [r["grounding"]["overall"] for r in group]

        def avg(map_: str, key: str, over: list[dict[str, Any]] = overall) -> float:
            return statistics.mean(o[map_][key] for o in over)

        changed = [
            f"`{k}={str(v).lower() if isinstance(v, bool) else v}`"
            for k, v in group[0]["settings"].items()
            if k != "train.seed" and recipe.get(k) != v
        ]
        cells = [
            variant,
            ", ".join(changed) or "–",
            str(len(group)),
            f"{avg('model', 'pointing'):.3f}",
            f"{avg('model', 'pointing') - avg('centre', 'pointing'):+.3f}",
            f"{avg('model', 'pointing') - avg('saliency', 'pointing'):+.3f}",
            f"{avg('model', 'mass'):.3f}",
            f"{avg('model', 'mass') - avg('saliency', 'mass'):+.3f}",
            f"{avg('model', 'median_peak'):.4f} ({avg('even', 'median_peak'):.4f})",
            f"{avg('model', 'mean_entropy'):.3f}",
            score(statistics.mean(r["scores"]["CIDEr"] for r in group)),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join([*lines, "", source_note(soft, "grounding")]) + "\n"
