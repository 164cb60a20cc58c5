"""The "attention that looks" study's tables (docs/grounding.md): where each lever leaves
the maps, where the word localiser itself looks, every model on the references' words, and
the stride-16 grid's screen."""

from __future__ import annotations

import math
import statistics
from typing import Any

from tools.tables.common import Rows, header, score, source_note
from tools.tables.grounding import _grounding_groups

# The models of the "attention that looks" study (docs/grounding.md): the shipped 7 x 7
# recipe and the levers measured against it, in the order the study tried them.
LOOKS = (
    "best",
    "s16",
    "mid_ent",
    "os16",
    "os16_ent",
    "os16_ent_dsw0",
    "os16_learned_dsw0",
    "os16_glimpse",
    "tiles5",
    "tiles5_ent",
    "tiles5_ent_dsw0",
    "tiles5_glimpse",
    "tiles5_sum_ent",
    "ctx1",
    "ctx1_dsw0",
    "tiles5_sum_ctx",
    "mid_ctx",
    "hyper_ctx",
    "os16_ctx",
    "os16_maps",
    "os16_wordatt",
    "os16_expect",
    "os16_current",
    "os16_current_images",
    "os16_current_dsw0",
    "os16_current_dsw0_r20",
    "os16_current_dsw0_w3",
    "os16_current_dsw0_categories",
    "os16_current_dsw0_categories_only",
    "best_current_dsw0_categories_only",
    "os16_current_dsw0_categories_only_sgate",
    "os16_current_dsw0_categories_only_sgate_e15",
    "os16_current_dsw0_categories_only_sgate_e15_w03",
    "os16_current_dsw0_categories_only_sgate_e15_finetune",
    "os16_current_dsw0_categories_only_sgate_e15_learned",
    "os16_current_dsw0_categories_only_sgate_e15_t05",
    "os16_current_dsw0_categories_only_sgate_e15_nobeta",
    "os16_current_dsw0_categories_only_sgate_e15_nobeta_t05",
    "best_exact",
    "os16_ent_hard",
    "ctx1_hard",
    "hyper_ctx_hard",
    "hyper_ctx_hard_p1",
    "os16_ctx_hard",
    "os16_maps_hard",
    "os16_expect_hard",
    "os16_current_hard",
    "os16_current_images_hard",
    "os16_current_dsw0_hard",
    "os16_current_dsw0_r20_hard",
    "os16_current_dsw0_categories_only_hard",
    "best_current_dsw0_categories_only_hard",
    "os16_current_dsw0_categories_only_sgate_hard",
    "os16_current_dsw0_categories_only_sgate_e15_exact",
    "tiles5_ent_hard",
    "tiles5_ent_hard_e0",
)


def _even(row: dict[str, Any]) -> tuple[float, float]:
    """An even map's peak (1 / L) and entropy (ln L) on the row's grid."""
    cells = row["grounding"]["grid"][0] * row["grounding"]["grid"][1]
    return 1.0 / cells, math.log(cells)


def grounding_looks(rows: Rows) -> str:
    """Where each lever of the study leaves the maps, seed by seed, against the targets:
    the median peak and mean entropy of every word's map and of the grounded words' maps as
    a ratio to an even map's on the same grid, the pointing game against the centre prior
    and the model's saliency map, and the mass in the boxes against the centre prior's."""
    picked = [r for r in rows if r["variant"] in LOOKS]
    lines = header(
        "model | seed | grid | peak, all words (x even) | entropy, all words (% of even) "
        "| peak, grounded (x even) | entropy, grounded (% of even) | pointing model / "
        "centre / saliency | mass / centre's | CIDEr-D"
    )
    verdicts = []
    order = {v: i for i, v in enumerate(LOOKS)}
    groups = _grounding_groups(picked)
    for (model, variant), group in sorted(groups.items(), key=lambda kv: order[kv[0][1]]):
        name = f"{model} ({variant})"
        peaks, entropies, pointing, masses = [], [], [], []
        for row in group:
            peak, entropy = _even(row)
            g = row["grounding"]
            o, every = g["overall"], g["all_words"]
            peaks.append(every["median_peak"] / peak)
            entropies.append(o["model"]["mean_entropy"] / entropy)
            pointing.append(tuple(o[m]["pointing"] for m in ("model", "centre", "saliency")))
            masses.append(o["model"]["mass"] / o["centre"]["mass"])
            lines.append(
                f"| {name} | {row['seed']} | {g['grid'][0]}x{g['grid'][1]} | "
                f"{every['median_peak'] / peak:.1f} | "
                f"{100 * every['mean_entropy'] / entropy:.0f} | "
                f"{o['model']['median_peak'] / peak:.1f} | "
                f"{100 * o['model']['mean_entropy'] / entropy:.0f} | "
                + " / ".join(f"{p:.3f}" for p in pointing[-1])
                + f" | {masses[-1]:.2f} | {score(row['scores'].get('CIDEr'))} |"
            )
        spread = statistics.stdev([p[0] for p in pointing]) if len(group) > 1 else math.inf
        checks = {
            "peak ≥ 5x even": all(p >= 5 for p in peaks),
            "grounded entropy ≤ 80%": all(e <= 0.8 for e in entropies),
            "pointing above centre and saliency by more than the spread": all(
                p[0] - max(p[1], p[2]) > spread for p in pointing
            ),
            "mass ≥ 1.25x centre's": all(m >= 1.25 for m in masses),
        }
        met = [k for k, ok in checks.items() if ok]
        missed = [k for k, ok in checks.items() if not ok]
        verdicts.append(
            f"**{name}**, {len(group)} seed{'s' * (len(group) > 1)}: "
            + (f"meets {', '.join(met)} on every seed" if met else "meets no target on every seed")
            + (f"; misses {', '.join(missed)}" if missed else "")
            + "."
        )
    note = source_note(picked, "grounding")
    return "\n".join([*lines, "", *verdicts, "", note]) + "\n"


def grounding_localiser(rows: Rows) -> str:
    """Where the word localiser itself finds each grounded word, beside the attention it
    draws: the pointing game and the mass in the boxes of the localiser's map of the word
    (``localiser``, models with ``model.word_maps``), the attention's, the centre prior's and
    the saliency map's, and the localiser map's peak and entropy against an even map's."""
    picked = [r for r in rows if "localiser" in r["grounding"]["overall"]]
    lines = header(
        "model | seed | words | pointing localiser / attention / centre / saliency | "
        "mass / centre's: localiser, attention | localiser's peak (x even) | "
        "localiser's entropy (% of even)"
    )
    order = {v: i for i, v in enumerate(LOOKS)}
    groups = _grounding_groups(picked)
    ranked = sorted(groups.items(), key=lambda kv: (order.get(kv[0][1], len(LOOKS)), kv[0]))
    for (model, variant), group in ranked:
        for row in group:
            peak, entropy = _even(row)
            o = row["grounding"]["overall"]
            found = o["localiser"]
            lines.append(
                f"| {model} ({variant}) | {row['seed']} | {o['words']} | "
                + " / ".join(
                    f"{o[m]['pointing']:.3f}" for m in ("localiser", "model", "centre", "saliency")
                )
                + f" | {found['mass'] / o['centre']['mass']:.2f}, "
                f"{o['model']['mass'] / o['centre']['mass']:.2f} | "
                f"{found['median_peak'] / peak:.1f} | {100 * found['mean_entropy'] / entropy:.0f} |"
            )
    return "\n".join([*lines, "", source_note(picked, "grounding")]) + "\n"


def grounding_references(rows: Rows) -> str:
    """The study's models on the reference captions' words, teacher-forced (the rows'
    ``references``): every model scored on the same words of the same photos, five captions
    a photo, so the baselines are the same for every model and the words are several times
    as many as a model's own captions name. Pointing and mass of the attention's map (and
    the localiser's, for models with one) against the centre prior and the saliency map, and
    the study's two grounding targets, group by group."""
    picked = [r for r in rows if "references" in r and r["variant"] in LOOKS]
    lines = header(
        "model | seed | words | pointing attention / localiser / centre / saliency | "
        "mass / centre's: attention, localiser | peak (x even) | entropy (% of even)"
    )
    order = {v: i for i, v in enumerate(LOOKS)}
    verdicts = []
    groups = _grounding_groups(picked)
    for (model, variant), group in sorted(groups.items(), key=lambda kv: order[kv[0][1]]):
        name = f"{model} ({variant})"
        pointing, masses, located, located_masses = [], [], [], []
        for row in group:
            peak, entropy = _even(row)
            o = row["references"]["overall"]
            found = o.get("localiser")
            pointing.append(tuple(o[m]["pointing"] for m in ("model", "centre", "saliency")))
            masses.append(o["model"]["mass"] / o["centre"]["mass"])
            if found is not None:
                located.append((found["pointing"], *pointing[-1][1:]))
                located_masses.append(found["mass"] / o["centre"]["mass"])
            localiser = (
                ("–", "–")
                if found is None
                else (f"{found['pointing']:.3f}", f"{found['mass'] / o['centre']['mass']:.2f}")
            )
            lines.append(
                f"| {name} | {row['seed']} | {o['words']} | {o['model']['pointing']:.3f} / "
                f"{localiser[0]} / {o['centre']['pointing']:.3f} / "
                f"{o['saliency']['pointing']:.3f} | {masses[-1]:.2f}, {localiser[1]} | "
                f"{o['model']['median_peak'] / peak:.1f} | "
                f"{100 * o['model']['mean_entropy'] / entropy:.0f} |"
            )
        verdict = f"**{name}**: " + _targets(pointing, masses)
        if len(located) == len(group):
            verdict += " The localiser's maps, against the same baselines: " + _targets(
                located, located_masses
            )
        verdicts.append(verdict)
    note = source_note(picked, "grounding")
    return "\n".join([*lines, "", *verdicts, "", note]) + "\n"


def _targets(pointing: list[tuple[float, ...]], masses: list[float]) -> str:
    """The two grounding targets, in words, for each seed's (map, centre, saliency)
    pointing and mass over the centre prior's."""
    spread = statistics.stdev([p[0] for p in pointing]) if len(pointing) > 1 else math.inf
    margins = ", ".join(f"{p[0] - max(p[1], p[2]):+.3f}" for p in pointing)
    above = all(p[0] - max(p[1], p[2]) > spread for p in pointing)
    mass = all(m >= 1.25 for m in masses)
    return (
        "pointing minus the better of the centre prior and the saliency map, "
        f"seed by seed, {margins} (spread {spread:.3f}): "
        + ("above both by more than the spread" if above else "not above both by the spread")
        + f" on every seed; mass {'at least' if mass else 'under'} 1.25x the centre "
        + f"prior's on {'every' if mass else 'some'} seed."
    )


def looks_screen(rows: Rows) -> str:
    """The stride-16 grid's screen (``results/looks_screen.json``): each variant's best
    validation CIDEr-D seed by seed, and the greedy test scores of the seeds whose test
    split was decoded."""
    lines = header(
        "variant | settings over `configs/flickr8k_best.yaml` | validation CIDEr-D of "
        "each seed | mean | greedy test BLEU-4 / METEOR / CIDEr-D (seeds decoded)"
    )
    groups: dict[str, Rows] = {}
    for row in rows:
        groups.setdefault(row["variant"], []).append(row)
    for variant, group in groups.items():
        group = sorted(group, key=lambda r: r["seed"])
        vals = [100 * r["best_val"] for r in group]
        tested = [r for r in group if r["test_greedy"]]
        test = "–"
        if tested:
            means = [
                statistics.mean(100 * r["test_greedy"][k] for r in tested)
                for k in ("Bleu_4", "METEOR", "CIDEr")
            ]
            test = (
                " / ".join(f"{m:.2f}" for m in means)
                + " ("
                + ", ".join(str(r["seed"]) for r in tested)
                + ")"
            )
        each = ", ".join(f"{v:.2f} ({r['seed']})" for v, r in zip(vals, group))
        settings = ", ".join(f"`{o}`" for o in group[0]["overrides"])
        lines.append(f"| {variant} | {settings} | {each} | {statistics.mean(vals):.2f} | {test} |")
    return "\n".join([*lines, "", source_note(rows, "looks_screen")]) + "\n"


# Each attention model of the study beside the decoder without attention on the same grid,
# trained the same way: (the grid, the model's variant, the control's variant). ``recipe``
# is the shipped best recipe (model ``best``); a ``_hard`` or ``_exact`` variant is a second
# stage (model ``best_hard`` or ``best_exact``) from the soft run of the same seed.
KEEP_PAIRS = (
    ("7 x 7", "recipe", "best_none"),
    ("7 x 7", "best_current_dsw0_categories_only", "best_none"),
    ("5 x 5 tiles", "tiles5_ent", "tiles5_none"),
    ("5 x 5 tiles, summary", "tiles5_sum_ent", "tiles5_sum_none"),
    ("14 x 14 mid-level", "mid_ctx", "mid_none"),
    ("14 x 14 hypercolumns", "hyper_ctx", "hyper_none"),
    ("14 x 14 stride 16, summary not gated", "os16_current_dsw0_categories_only", "os16_none"),
    (
        "14 x 14 stride 16, gated summary",
        "os16_current_dsw0_categories_only_sgate",
        "os16_none_sgate",
    ),
    (
        "14 x 14 stride 16, gated summary",
        "os16_current_dsw0_categories_only_sgate_hard",
        "os16_none_sgate",
    ),
    (
        "14 x 14 stride 16, gated summary, 15 epochs",
        "os16_current_dsw0_categories_only_sgate_e15",
        "os16_none_sgate_e15",
    ),
    (
        "14 x 14 stride 16, gated summary, 15 epochs",
        "os16_current_dsw0_categories_only_sgate_e15_w03",
        "os16_none_sgate_e15",
    ),
    (
        "14 x 14 stride 16, gated summary, 15 epochs",
        "os16_current_dsw0_categories_only_sgate_e15_exact",
        "os16_none_sgate_e15",
    ),
    (
        "14 x 14 stride 16, gated summary, 15 epochs, temperature 0.5",
        "os16_current_dsw0_categories_only_sgate_e15_t05",
        "os16_none_sgate_e15",
    ),
    (
        "14 x 14 stride 16, gated summary, 15 epochs, no beta gate",
        "os16_current_dsw0_categories_only_sgate_e15_nobeta",
        "os16_none_sgate_e15",
    ),
    (
        "14 x 14 stride 16, gated summary, 15 epochs, no beta gate, temperature 0.5",
        "os16_current_dsw0_categories_only_sgate_e15_nobeta_t05",
        "os16_none_sgate_e15",
    ),
    (
        "14 x 14 stride 16, gated summary at the output only, learned initial state, 15 epochs",
        "os16_current_dsw0_categories_only_sgate_e15_learned",
        "os16_none_sgate_e15_learned",
    ),
)


def _beam3(rows: Rows, variant: str) -> dict[int, list[dict[str, Any]]]:
    """The beam-3 rows of ``variant`` by seed (``recipe``: model best's), in the file's
    order (a seed may have run on several hosts)."""
    picked: dict[int, list[dict[str, Any]]] = {}
    for row in rows:
        model_ok = variant != "recipe" or row["model"] == "best"
        if row["variant"] == variant and row["beam_size"] == 3 and model_ok:
            picked.setdefault(row["seed"], []).append(row)
    return picked


def _pair(models: list[dict[str, Any]], controls: list[dict[str, Any]]) -> tuple | None:
    """The first row of ``models`` with a row of ``controls`` on the same host and
    precision, and that row; None where no host has both."""
    for row in models:
        host = (row["device"], row["precision"])
        match = next((c for c in controls if (c["device"], c["precision"]) == host), None)
        if match is not None:
            return row, match
    return None


def flickr8k_keep(rows: Rows) -> str:
    """Whether attention earns its keep: each attention model's test CIDEr-D (beam 3) beside
    the decoder without attention on the same grid, seed by seed, on the same host and
    precision, against the two points asked on every seed."""
    lines = header(
        "grid | with attention | without | seeds | CIDEr-D with / without | "
        "difference per seed | mean difference | ≥ 2 on every seed"
    )
    used = []
    for grid, variant, control in KEEP_PAIRS:
        model, baseline = _beam3(rows, variant), _beam3(rows, control)
        pairs = {s: _pair(model[s], baseline[s]) for s in sorted(set(model) & set(baseline))}
        seeds = [s for s, pair in pairs.items() if pair is not None]
        if not seeds:
            continue
        used += [row for s in seeds for row in pairs[s]]
        with_ = [100 * pairs[s][0]["CIDEr"] for s in seeds]
        without = [100 * pairs[s][1]["CIDEr"] for s in seeds]
        gaps = [a - b for a, b in zip(with_, without)]
        lines.append(
            f"| {grid} | {variant} | {control} | {', '.join(map(str, seeds))} | "
            + " / ".join(f"{a:.2f}" for a in with_)
            + " against "
            + " / ".join(f"{b:.2f}" for b in without)
            + " | "
            + " / ".join(f"{g:+.2f}" for g in gaps)
            + f" | {statistics.mean(gaps):+.2f} | "
            + ("yes" if len(seeds) >= 3 and all(g >= 2 for g in gaps) else "no")
            + " |"
        )
    return "\n".join([*lines, "", source_note(used, "flickr8k")]) + "\n"
