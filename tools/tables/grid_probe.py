"""What each encoder grid lets any map find (``results/grid_probe.json``, rows of
``tools/grid_probe.py``): the localisation probe's pointing and mass against the baselines."""

from __future__ import annotations

import math
import statistics

from tools.tables.common import Rows, header, source_note

GRID_ORDER = ("top7", "tiles5", "os16", "mid14", "hyper14")


def grid_probe(rows: Rows) -> str:
    """One line per grid and seed: the probe's image-level mean average precision on the
    Flickr8k development photos, and on the ``coco_mini`` pairs its pointing game against
    the centre prior, the photo's saliency map and an even map, its mass in the boxes as a
    ratio to the centre prior's, and its median peak and mean entropy as ratios to an even
    map's; under them, per grid, the grounding targets the probe meets on every seed."""
    lines = header(
        "grid | settings over `configs/flickr8k_best.yaml` | classes | cells x channels | "
        "seed | dev mAP | pairs | pointing probe / centre / saliency / even | "
        "mass / centre's | peak (x even) | entropy (% of even) | "
        "references: words, pointing probe / centre / saliency, mass / centre's"
    )
    order = {g: i for i, g in enumerate(GRID_ORDER)}
    groups: dict[str, Rows] = {}
    for row in sorted(
        rows, key=lambda r: (order.get(r["grid"], len(order)), _classes(r) != "categories")
    ):
        label = r"{} ({})".format(row["grid"], _classes(row))
        groups.setdefault(label if _classes(row) != "categories" else row["grid"], []).append(row)
    for group in groups.values():
        group.sort(key=lambda r: r["seed"])
    verdicts = []
    for grid, group in groups.items():
        pointing, masses = [], []
        for row in group:
            rows_, cols = row["grid_shape"]
            cells = rows_ * cols
            o = row["grounding"]["overall"]
            pointing.append([o[m]["pointing"] for m in ("probe", "centre", "saliency", "even")])
            masses.append(o["probe"]["mass"] / o["centre"]["mass"])
            settings = ", ".join(f"`{s}`" for s in row["overrides"]) or "–"
            lines.append(
                f"| {row['grid']} | {settings} | {_classes(row)} | "
                f"{rows_}x{cols} x {row['channels']:,} | "
                f"{row['seed']} | {row['dev_map']:.3f} | {o['words']} | "
                + " / ".join(f"{p:.3f}" for p in pointing[-1])
                + f" | {masses[-1]:.2f} | {o['probe']['median_peak'] * cells:.1f} | "
                f"{100 * o['probe']['mean_entropy'] / math.log(cells):.0f} | "
                f"{_references(row)} |"
            )
        verdict = f"**{grid}**, {len(group)} seed{'s' * (len(group) > 1)}: " + _verdict(
            pointing, masses
        )
        found = [row["grounding"].get("references") for row in group]
        if all(found):
            words = [f["overall"] for f in found]
            verdict += " On the references' words: " + _verdict(
                [[o[m]["pointing"] for m in ("probe", "centre", "saliency")] for o in words],
                [o["probe"]["mass"] / o["centre"]["mass"] for o in words],
            )
        verdicts.append(verdict)
    return "\n".join([*lines, "", *verdicts, "", source_note(rows, "grid_probe")]) + "\n"


def _verdict(pointing: list[list[float]], masses: list[float]) -> str:
    """The probe's pointing (probe, centre, saliency of each seed) and mass ratios against
    the two grounding targets, every seed."""
    spread = statistics.stdev([p[0] for p in pointing]) if len(pointing) > 1 else math.inf
    margins = [p[0] - max(p[1], p[2]) for p in pointing]
    return (
        "pointing minus the better of the centre prior and the saliency map "
        + ", ".join(f"{m:+.3f}" for m in margins)
        + (f" (the probe's spread {spread:.3f})" if len(pointing) > 1 else "")
        + "; mass "
        + ", ".join(f"{m:.2f}" for m in masses)
        + " times the centre prior's: "
        + _met(
            {
                "pointing above both by more than the spread": all(m > spread for m in margins),
                "mass ≥ 1.25x centre's": all(m >= 1.25 for m in masses),
            }
        )
    )


def _classes(row: dict) -> str:
    return row.get("classes", "categories")


def _references(row: dict) -> str:
    """The probe on the words of the photos' captions: words, pointing against the
    baselines, mass over the centre prior's; – for rows scored before it was."""
    references = row["grounding"].get("references")
    if references is None:
        return "–"
    o = references["overall"]
    pointing = " / ".join(f"{o[m]['pointing']:.3f}" for m in ("probe", "centre", "saliency"))
    return f"{o['words']}, {pointing}, {o['probe']['mass'] / o['centre']['mass']:.2f}"


def _met(checks: dict[str, bool]) -> str:
    """Which of the ``checks`` hold on every seed, in words."""
    met = [k for k, ok in checks.items() if ok]
    missed = [k for k, ok in checks.items() if not ok]
    said = f"meets {', '.join(met)} on every seed" if met else "meets neither on every seed"
    return said + (f"; misses {', '.join(missed)}." if missed and met else ".")
