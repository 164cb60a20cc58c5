"""Show, Attend and Tell's Flickr8k rows beside ours (``results/flickr8k.json``, rows of
``benchmarks/flickr8k.py``): the recipe, its beams, its levers, the attention penalty over
training, each run's time and the targets (captions decoded otherwise: flickr8k_decoding)."""

from __future__ import annotations

from collections import Counter
from typing import Any

import yaml

from tools.tables.common import (
    PLUMBING,
    ROOT,
    Rows,
    commits,
    header,
    machines,
    mean,
    precisions,
    source_note,
    timed,
)

# Xu et al. (2015), Table 1, Flickr8k: BLEU-1..4 (without the brevity penalty) and METEOR.
PAPER_FLICKR8K = {
    "soft": (67.0, 44.8, 29.9, 19.5, 18.93),
    "hard": (67.0, 45.7, 31.4, 21.3, 20.30),
}
FLICKR8K_MODELS = (
    "nn",
    "none",
    "soft",
    "best",
    "hard",
    "hard_exact",
    "best_exact",
    "scst",
    "best_scst",
    "finetune",
    "best_finetune",
)
FLICKR8K_SCORES = (
    "Bleu_1",
    "Bleu_2",
    "Bleu_3",
    "Bleu_4",
    "METEOR",
    "Bleu_4_no_bp",
    "ROUGE_L",
    "CIDEr",
)
FLICKR8K_HEAD = (
    "| model | beam | trained on | seeds | BLEU-1 | BLEU-2 | BLEU-3 | BLEU-4 | "
    "METEOR | BLEU-4 without BP | ROUGE-L | CIDEr-D | CIDEr-D of each seed | "
    "seeds above nn in CIDEr-D |"
)


# benchmarks/flickr8k.py's names (not imported: it loads torch, the tables need only rows)
BEST_CONFIG = "configs/flickr8k_best.yaml"  # its model best
SOFT_CONFIG = "configs/flickr8k_mobilenet.yaml"  # its model soft, the recipe
RECIPE = "recipe"  # the variant of rows trained by the shipped config files as they are
# the levers that are second stages, by the run whose best.pt they start from
SECOND_STAGES = {
    "scst": "the recipe",
    "finetune": "the recipe",
    "best_scst": "best",
    "best_finetune": "best",
    "best_exact": "best",
    "best_hard": "best",
}
# the models of the levers table shown by their own config file, and their levers by it
OWN_CONFIGS = ("hard", *SECOND_STAGES)


def _own_keys(config: str) -> list[str]:
    """The settings a config file sets itself, over the config it extends, as KEY=VALUE."""
    own = yaml.safe_load((ROOT / config).read_text())
    return [
        f"{section}.{key}={value}"
        for section, keys in own.items()
        if section != "base"
        for key, value in keys.items()
    ]


def _seconds(value: float | None) -> str:
    return "–" if value is None else f"{value:.0f}"


def _device(row: dict[str, Any]) -> str:
    """Where a row was trained: the GPU, or the CPU by its maker, so that the rows of two
    hosts (with their own precision and speed) stay apart."""
    name = row["device"]
    if name == "cpu":  # a profile row names the device type; its machine names the CPU
        name = row.get("machine", {}).get("cpu", name)
    if "NVIDIA" in name:
        return "GPU"
    return f"{name.split()[0].replace('(R)', '')} CPU"


def _last_gpu(device: str) -> tuple[bool, str]:
    """A device's place in the tables: the CPUs by name, then the GPU."""
    return device == "GPU", device


def _devices(groups: dict[tuple, Rows]) -> list[str]:
    """The devices among ``groups`` keyed (..., device), in table order."""
    return sorted({key[-1] for key in groups}, key=_last_gpu)


def _flickr8k_lines(rows: Rows, nn_cider: float | None) -> list[str]:
    """One line per model, beam size and device: the mean of the seeds in percent, each
    seed's CIDEr-D, and how many seeds score above the nearest neighbour's CIDEr-D."""
    groups: dict[tuple, Rows] = {}
    for row in rows:
        groups.setdefault((row["model"], row["beam_size"], _device(row)), []).append(row)
    order = {m: i for i, m in enumerate(FLICKR8K_MODELS)}
    lines = []
    for (model, beam, device), group in sorted(
        groups.items(), key=lambda g: (order[g[0][0]], _last_gpu(g[0][2]), g[0][1] or 0)
    ):
        group = sorted(group, key=lambda r: r["seed"] or 0)
        means = [mean([r.get(k) for r in group]) for k in FLICKR8K_SCORES]
        each = ", ".join(
            f"{100 * r['CIDEr']:.1f}" + ("" if r["seed"] is None else f" ({r['seed']})")
            for r in group
        )
        above = "–"
        if model != "nn" and nn_cider is not None:
            above = f"{sum(r['CIDEr'] > nn_cider for r in group)} of {len(group)}"
        cells = " | ".join("–" if m is None else f"{100 * m:.2f}" for m in means)
        lines.append(
            f"| {model} | {beam or '–'} | {device} | {len(group)} | {cells} | {each} | {above} |"
        )
    return lines


def _nn_cider(rows: Rows) -> float | None:
    """The nearest neighbour's test CIDEr-D among ``rows`` (it has no seed)."""
    found = [r["CIDEr"] for r in rows if r["model"] == "nn" and r["variant"] == RECIPE]
    return found[0] if found else None


def _flickr8k_note(rows: Rows) -> str:
    return (
        f"Test split, 1,000 images; scores in percent, the mean of the seeds. "
        f"Trained on {machines(rows)}, precision {precisions(rows)}; "
        f"commits {commits(rows)}; {timed(rows)}; `results/flickr8k.json` holds every "
        f"row with its command."
    )


def flickr8k(rows: Rows, min_seeds: int = 1) -> str:
    """Show, Attend and Tell's Flickr8k rows beside ours (``benchmarks/flickr8k.py``): the
    recipe's models at beam 3 and the nearest neighbour, the mean of the seeds; with
    ``min_seeds``, only the models of a device trained on that many seeds (and nn)."""
    head = [FLICKR8K_HEAD, "|" + " --- |" * 14]
    for name, (b1, b2, b3, b4, meteor) in PAPER_FLICKR8K.items():
        bleu = " | ".join(f"{b:.1f}" for b in (b1, b2, b3, b4))
        head.append(
            f"| **paper: {name}** (Xu et al. 2015; BLEU without BP) | | | | {bleu} | "
            f"{meteor:.2f} | {b4:.1f} | | | | |"
        )
    recipe = [r for r in rows if r["variant"] == RECIPE and r["beam_size"] in (None, 3)]
    counts = Counter((r["model"], _device(r)) for r in recipe)
    recipe = [r for r in recipe if r["seed"] is None or counts[r["model"], _device(r)] >= min_seeds]
    lines = _flickr8k_lines(recipe, _nn_cider(rows))
    return "\n".join([*head, *lines, "", _flickr8k_note(recipe)]) + "\n"


def flickr8k_headline(rows: Rows) -> str:
    """:func:`flickr8k` for the README: the models measured on three seeds or more (one
    seed is a screen, shown in docs/flickr8k.md)."""
    return flickr8k(rows, min_seeds=3)


def flickr8k_beams(rows: Rows) -> str:
    """The soft models of the Flickr8k recipes (the recipe and best) decoded with 1, 3 and 5
    beams."""
    head = [FLICKR8K_HEAD, "|" + " --- |" * 14]
    soft = [r for r in rows if r["variant"] == RECIPE and r["model"] in ("soft", "best")]
    lines = _flickr8k_lines(soft, _nn_cider(rows))
    return "\n".join([*head, *lines, "", _flickr8k_note(soft)]) + "\n"


def flickr8k_levers(rows: Rows) -> str:
    """The Flickr8k soft model against the same model with one setting changed (rows of a
    ``--variant``), and hard attention and the second stages against theirs, beam 3, the
    seeds' mean in percent."""
    lines = header(
        "variant | settings | trained on | seeds | BLEU-4 | METEOR | CIDEr-D | best "
        "validation score (selected on) | CIDEr-D of each seed"
    )
    groups: dict[tuple, Rows] = {}
    for row in rows:
        trained = not row["variant"].startswith("cut")  # cut captions are only scored
        if row["model"] == "soft" and row["beam_size"] == 3 and trained:
            groups.setdefault((row["variant"], _device(row)), []).append(row)
        elif row["model"] in OWN_CONFIGS and row["beam_size"] == 3:  # and their levers
            name = row["model"] if row["variant"] == RECIPE else row["variant"]
            groups.setdefault((name, _device(row)), []).append(row)
        elif row["model"] == "best" and row["beam_size"] == 3:  # best, and levers over it
            name = "best" if row["variant"] == RECIPE else row["variant"]
            groups.setdefault((name, _device(row)), []).append(row)
    for (variant, device), group in sorted(
        groups.items(), key=lambda g: (g[0][0] != RECIPE, g[0][0], _last_gpu(g[0][1]))
    ):
        group = sorted(group, key=lambda r: r["seed"])
        # the attention is plumbing for the study's own models (none), a lever for a variant
        settings = [
            f"`{o}`"
            for o in group[0]["overrides"]
            if not o.startswith(PLUMBING) or o.startswith("model.attention=")
        ]
        if group[0]["model"] in OWN_CONFIGS:
            model, config = group[0]["model"], f"`{group[0]['config']}`"
            start = f", from {SECOND_STAGES[model]}'s `best.pt`" if model in SECOND_STAGES else ""
            settings = [
                config + start if variant == model else f"{config} and {', '.join(settings)}"
            ]
        elif group[0]["model"] == "best":  # best's own settings, or a lever's beyond them
            own = [f"`{o}`" for o in _own_keys(BEST_CONFIG)]
            extra = [o for o in settings if o not in own]
            threads = f"trained on {group[0]['threads']} thread(s)"
            settings = [
                f"`{BEST_CONFIG}`: {', '.join(own)}"
                if variant == "best"
                else f"`{BEST_CONFIG}` and {', '.join(extra) or threads}"
            ]
        scores = [mean([r[k] for r in group]) for k in ("Bleu_4", "METEOR", "CIDEr")]
        val = mean([r["best_val"] for r in group])
        each = ", ".join(f"{100 * r['CIDEr']:.1f} ({r['seed']})" for r in group)
        lines.append(
            f"| {variant} | {', '.join(settings) or 'the recipe'} | "
            f"{device} | {len(group)} | "
            + " | ".join(f"{100 * v:.2f}" for v in scores)
            + f" | {100 * val:.2f} ({group[0]['select_metric']}) | {each} |"
        )
    shown = [r for group in groups.values() for r in group]
    return "\n".join([*lines, "", source_note(shown, "flickr8k")]) + "\n"


def flickr8k_attention(rows: Rows) -> str:
    """What the training loss reported of the attention maps at the first and last epoch of
    each Flickr8k run that recorded it (beam-3 rows of the recipe, and of hard attention's
    levers, by REINFORCE or the exact marginal): the doubly stochastic penalty and hard
    attention's entropy, both per caption, the last epoch's entropy also as a share of an
    even map's (rows that record it)."""
    lines = header(
        "model | seed | trained on | penalty: first epoch | last epoch | entropy (nats): "
        "first epoch | last epoch | last epoch (% of even) | nll per word: first epoch | "
        "last epoch"
    )
    # self-critical training's loss has no penalty term (its trace reads 0): left out
    kept = [
        r
        for r in rows
        if r.get("training")
        and r["beam_size"] == 3
        and (r["variant"] == RECIPE or r["model"] in ("hard", "best_hard", "best_exact"))
        and r["model"] not in ("scst", "best_scst")
    ]

    def name(row: dict[str, Any]) -> str:
        return row["model"] + ("" if row["variant"] == RECIPE else f" ({row['variant']})")

    for row in sorted(kept, key=lambda r: (name(r), _last_gpu(_device(r)), r["seed"])):
        first, last = row["training"]["first_epoch"], row["training"]["last_epoch"]
        cells = [name(row), str(row["seed"]), _device(row)]
        for key in ("penalty", "entropy", "nll_per_token"):
            cells += [f"{e[key]:.2f}" if key in e else "–" for e in (first, last)]
            if key == "entropy":
                even = row["training"].get("even_entropy")
                share = even and "entropy" in last and 100 * last["entropy"] / even
                cells.append(f"{share:.1f}" if share else "–")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join([*lines, "", source_note(kept, "flickr8k")]) + "\n"
