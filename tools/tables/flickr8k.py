"""Show, Attend and Tell's Flickr8k rows beside ours (``results/flickr8k.json``, rows of
``benchmarks/flickr8k.py``): the recipe, its beams, its levers, the attention penalty over
training, each run's time and the targets (captions decoded otherwise: flickr8k_decoding)."""

from __future__ import annotations

import statistics
from collections import Counter
from typing import Any

import yaml

from tools.tables.common import (
    PLUMBING,
    ROOT,
    Rows,
    commits,
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
FLICKR8K_MODELS = ("nn", "none", "soft", "best", "hard", "hard_exact", "best_exact", "scst",
                   "best_scst", "finetune", "best_finetune")  # fmt: skip
FLICKR8K_SCORES = ("Bleu_1", "Bleu_2", "Bleu_3", "Bleu_4", "METEOR", "Bleu_4_no_bp",
                   "ROUGE_L", "CIDEr")  # fmt: skip
FLICKR8K_HEAD = ("| model | beam | trained on | seeds | BLEU-1 | BLEU-2 | BLEU-3 | BLEU-4 | "
                 "METEOR | BLEU-4 without BP | ROUGE-L | CIDEr-D | CIDEr-D of each seed | "
                 "seeds above nn in CIDEr-D |")  # fmt: skip


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
    return [f"{section}.{key}={value}" for section, keys in own.items() if section != "base"
            for key, value in keys.items()]  # fmt: skip


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
        each = ", ".join(f"{100 * r['CIDEr']:.1f}"
                         + ("" if r["seed"] is None else f" ({r['seed']})")
                         for r in group)  # fmt: skip
        above = "–"
        if model != "nn" and nn_cider is not None:
            above = f"{sum(r['CIDEr'] > nn_cider for r in group)} of {len(group)}"
        cells = " | ".join("–" if m is None else f"{100 * m:.2f}" for m in means)
        lines.append(f"| {model} | {beam or '–'} | {device} | {len(group)} | {cells} | {each} "
                     f"| {above} |")  # fmt: skip
    return lines


def _nn_cider(rows: Rows) -> float | None:
    """The nearest neighbour's test CIDEr-D among ``rows`` (it has no seed)."""
    found = [r["CIDEr"] for r in rows if r["model"] == "nn" and r["variant"] == RECIPE]
    return found[0] if found else None


def _flickr8k_note(rows: Rows) -> str:
    return (f"Test split, 1,000 images; scores in percent, the mean of the seeds. "
            f"Trained on {machines(rows)}, precision {precisions(rows)}; "
            f"commits {commits(rows)}; {timed(rows)}; `results/flickr8k.json` holds every "
            f"row with its command.")  # fmt: skip


def flickr8k(rows: Rows, min_seeds: int = 1) -> str:
    """Show, Attend and Tell's Flickr8k rows beside ours (``benchmarks/flickr8k.py``): the
    recipe's models at beam 3 and the nearest neighbour, the mean of the seeds; with
    ``min_seeds``, only the models of a device trained on that many seeds (and nn)."""
    head = [FLICKR8K_HEAD, "|" + " --- |" * 14]
    for name, (b1, b2, b3, b4, meteor) in PAPER_FLICKR8K.items():
        bleu = " | ".join(f"{b:.1f}" for b in (b1, b2, b3, b4))
        head.append(f"| **paper: {name}** (Xu et al. 2015; BLEU without BP) | | | | {bleu} | "
                    f"{meteor:.2f} | {b4:.1f} | | | | |")  # fmt: skip
    recipe = [r for r in rows if r["variant"] == RECIPE and r["beam_size"] in (None, 3)]
    counts = Counter((r["model"], _device(r)) for r in recipe)
    recipe = [r for r in recipe
              if r["seed"] is None or counts[r["model"], _device(r)] >= min_seeds]  # fmt: skip
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
    lines = ["| variant | settings | trained on | seeds | BLEU-4 | METEOR | CIDEr-D | best "
             "validation score (selected on) | CIDEr-D of each seed |",
             "|" + " --- |" * 9]  # fmt: skip
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
            settings = [config + start if variant == model
                        else f"{config} and {', '.join(settings)}"]  # fmt: skip
        elif group[0]["model"] == "best":  # best's own settings, or a lever's beyond them
            own = [f"`{o}`" for o in _own_keys(BEST_CONFIG)]
            extra = [o for o in settings if o not in own]
            threads = f"trained on {group[0]['threads']} thread(s)"
            settings = [f"`{BEST_CONFIG}`: {', '.join(own)}" if variant == "best"
                        else f"`{BEST_CONFIG}` and {', '.join(extra) or threads}"]  # fmt: skip
        scores = [mean([r[k] for r in group]) for k in ("Bleu_4", "METEOR", "CIDEr")]
        val = mean([r["best_val"] for r in group])
        each = ", ".join(f"{100 * r['CIDEr']:.1f} ({r['seed']})" for r in group)
        lines.append(f"| {variant} | {', '.join(settings) or 'the recipe'} | "
                     f"{device} | {len(group)} | " + " | ".join(f"{100 * v:.2f}" for v in scores)
                     + f" | {100 * val:.2f} ({group[0]['select_metric']}) | {each} |")  # fmt: skip
    shown = [r for group in groups.values() for r in group]
    return "\n".join([*lines, "", source_note(shown, "flickr8k")]) + "\n"


def flickr8k_attention(rows: Rows) -> str:
    """What the training loss reported of the attention maps at the first and last epoch of
    each Flickr8k run that recorded it (beam-3 rows of the recipe, and of hard attention's
    levers): the doubly stochastic penalty and hard attention's entropy, both per caption."""
    lines = ["| model | seed | trained on | penalty: first epoch | last epoch "
             "| entropy (nats): first epoch | last epoch | nll per word: first epoch "
             "| last epoch |", "|" + " --- |" * 9]  # fmt: skip
    # self-critical training's loss has no penalty term (its trace reads 0): left out
    kept = [r for r in rows if r.get("training") and r["beam_size"] == 3
            and (r["variant"] == RECIPE or r["model"] == "hard")
            and r["model"] not in ("scst", "best_scst")]  # fmt: skip

    def name(row: dict[str, Any]) -> str:
        return row["model"] + ("" if row["variant"] == RECIPE else f" ({row['variant']})")

    for row in sorted(kept, key=lambda r: (name(r), _last_gpu(_device(r)), r["seed"])):
        first, last = row["training"]["first_epoch"], row["training"]["last_epoch"]
        cells = [name(row), str(row["seed"]), _device(row)]
        for key in ("penalty", "entropy", "nll_per_token"):
            cells += [f"{e[key]:.2f}" if key in e else "–" for e in (first, last)]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join([*lines, "", source_note(kept, "flickr8k")]) + "\n"


def flickr8k_time(rows: Rows) -> str:
    """The Flickr8k recipe's seconds per stage, per run, with the device and whether the run
    had the machine to itself."""
    lines = ["| model | seed | trained on | precision | threads | timed alone | prepare s "
             "| extract s | train s | evaluate s | whole recipe s |",
             "|" + " --- |" * 11]  # fmt: skip
    order = {m: n for n, m in enumerate(FLICKR8K_MODELS)}
    rows = sorted(
        rows,
        key=lambda r: (order.get(r["model"], len(order)), _last_gpu(_device(r)), r["seed"] or 0),
    )
    shown = [r for r in rows if r["variant"] == RECIPE and r["beam_size"] in (None, 3)]
    for row in shown:
        t = row["seconds"]
        train = (t.get("first_stage") or 0) + t["train"]
        # a stage not recorded (a run in a folder whose stages ran elsewhere) leaves no total
        whole = t.get("recipe") if None not in (t.get("prepare"), t.get("extract")) else None
        lines.append(f"| {row['model']} | {row['seed'] if row['seed'] is not None else '–'} | "
                     f"{row['device']} | {row['precision']} | {row['threads']} | "
                     f"{'yes' if row['timed_alone'] else 'no'} "
                     f"| {_seconds(t.get('prepare'))} | {_seconds(t.get('extract'))} "
                     f"| {train:.0f} | {_seconds(t.get('evaluate'))} "
                     f"| {_seconds(whole)} |")  # fmt: skip
    return "\n".join([*lines, "", source_note(shown, "flickr8k")]) + "\n"


# The Flickr8k issue's targets: (what, model, score, threshold); scores as the tables show them.
FLICKR8K_TARGETS = (
    ("soft attention by cross-entropy: BLEU-4 ≥ 19.5", "soft", "Bleu_4", 0.195),
    ("soft attention by cross-entropy: METEOR ≥ 18.93", "soft", "METEOR", 0.1893),
    ("soft attention by cross-entropy, best recipe: BLEU-4 ≥ 19.5", "best", "Bleu_4", 0.195),
    ("soft attention by cross-entropy, best recipe: METEOR ≥ 18.93", "best", "METEOR", 0.1893),
    ("hard attention: BLEU-4 ≥ 21.3", "hard", "Bleu_4", 0.213),
    ("hard attention: METEOR ≥ 20.30", "hard", "METEOR", 0.2030),
    ("hard attention by the exact marginal, after best: BLEU-4 ≥ 21.3", "best_exact", "Bleu_4",
     0.213),
    ("hard attention by the exact marginal, after best: METEOR ≥ 20.30", "best_exact",
     "METEOR", 0.2030),
    ("self-critical training: BLEU-4 beyond both paper rows (> 21.3)", "scst", "Bleu_4", 0.213),
    ("self-critical training: METEOR beyond both paper rows (> 20.30)", "scst", "METEOR", 0.2030),
    ("self-critical training after best: BLEU-4 beyond both paper rows (> 21.3)", "best_scst",
     "Bleu_4", 0.213),
    ("self-critical training after best: METEOR beyond both paper rows (> 20.30)", "best_scst",
     "METEOR", 0.2030),
    # not a target of the issue: how far the self-critical model gets, the paper's soft row
    ("self-critical training after best: BLEU-4 beyond the paper's soft row (≥ 19.5)",
     "best_scst", "Bleu_4", 0.195),
    ("self-critical training after best: METEOR beyond the paper's soft row (≥ 18.93)",
     "best_scst", "METEOR", 0.1893),
)  # fmt: skip
# the models held to the CIDEr-D target: every one that attends
ATTENDING = tuple(m for m in FLICKR8K_MODELS if m not in ("nn", "none"))
RECIPE_SECONDS = {"soft": 900, "best": 900, "hard": 1800}  # the whole recipe, 2-core CPU


def flickr8k_targets(rows: Rows) -> str:
    """The Flickr8k targets against the rows: each score's mean over the seeds of each
    device (beam 3, standard BLEU), every seed's value, and whether the mean reaches it;
    then CIDEr-D against the baselines by more than the seed spread, and the recipe's time."""
    lines = ["| target | trained on | seeds | mean | each seed | met |", "|" + " --- |" * 6]
    recipe = [r for r in rows if r["variant"] == RECIPE and r["beam_size"] in (None, 3)]
    groups: dict[tuple, Rows] = {}
    for row in recipe:
        groups.setdefault((row["model"], _device(row)), []).append(row)
    for what, model, key, threshold in FLICKR8K_TARGETS:
        for device in _devices(groups):
            group = sorted(groups.get((model, device), []), key=lambda r: r["seed"])
            if not group:
                continue
            value = mean([r[key] for r in group])
            each = ", ".join(f"{100 * r[key]:.2f} ({r['seed']})" for r in group)
            met = "yes" if value >= threshold else "no"
            lines.append(f"| {what} | {device} | {len(group)} | {100 * value:.2f} | {each} "
                         f"| {met} |")  # fmt: skip
    baselines = {m: [r["CIDEr"] for r in recipe if r["model"] == m] for m in ("nn", "none")}
    best = max((mean(v) for v in baselines.values() if v), default=None)
    for model in ATTENDING:
        for device in _devices(groups):
            group = sorted(groups.get((model, device), []), key=lambda r: r["seed"])
            if len(group) < 2 or best is None:
                continue
            ciders = [r["CIDEr"] for r in group]
            spread = statistics.stdev(ciders)
            each = ", ".join(f"{100 * c:.2f} ({r['seed']})" for c, r in zip(ciders, group))
            met = "yes" if min(ciders) - best > spread else "no"
            lines.append(f"| {model}: CIDEr-D above nn and none on every seed by more than the "
                         f"seed spread ({100 * spread:.2f}); the better baseline's mean "
                         f"{100 * best:.2f} | {device} | {len(group)} | "
                         f"{100 * mean(ciders):.2f} | {each} | {met} |")  # fmt: skip
    for model, limit in RECIPE_SECONDS.items():
        alone = [r for r in recipe if r["model"] == model and _device(r) != "GPU"
                 and r["timed_alone"] is True]  # fmt: skip
        for row in alone:
            seconds = row["seconds"].get("recipe")
            if seconds is None:
                continue
            met = "yes" if seconds <= limit else "no"
            lines.append(f"| {model}: the whole recipe on a 2-core CPU in ≤ {limit // 60} "
                         f"minutes (extraction, the host's yardstick: "
                         f"{row['seconds']['extract']:.0f} s) | {_device(row)} "
                         f"({row['precision']}), timed alone | 1 | "
                         f"{seconds:.0f} s | {seconds:.0f} s ({row['seed']}) "
                         f"| {met} |")  # fmt: skip
    return "\n".join([*lines, "", source_note(recipe, "flickr8k")]) + "\n"


def flickr8k_step_cost(rows: Rows) -> str:
    """A training step of each Flickr8k config (and settings over it) on the cached grids
    (rows of ``benchmarks/profile_epoch.py`` in ``results/speed.json`` whose config is a
    Flickr8k one): the median over the repeats, and its ratio to the median of the soft
    model timed on as many threads (the recipe's config where it was, else best's)."""
    rows = [r for r in rows if r.get("kind") == "profile"
            and r["config"].startswith("configs/flickr8k")]  # fmt: skip
    groups: dict[tuple, Rows] = {}
    for row in rows:
        extra = tuple(o for o in row["overrides"] if not o.startswith(PLUMBING))
        groups.setdefault((row["config"], extra, row["threads"], _device(row)), []).append(row)

    def median(group: Rows) -> float:
        return statistics.median(r["step_seconds"] for r in group)

    lines = ["| config | settings over it | host | threads | repeats | step (s), median "
             "| each repeat (s) | to the soft model's step | one epoch at that rate |",
             "|" + " --- |" * 9]  # fmt: skip
    for (config, extra, threads, host), group in sorted(
            groups.items(), key=lambda g: (g[0][3], g[0][2], median(g[1]))):  # fmt: skip
        soft = [groups.get((c, (), threads, host)) for c in (SOFT_CONFIG, BEST_CONFIG)]
        base = next((median(g) for g in soft if g), None)
        step = median(group)
        each = ", ".join(f"{r['step_seconds']:.2f}" for r in group)
        ratio = "–" if base is None else f"{step / base:.1f}x"
        epoch = step * group[0]["steps_per_epoch"]
        settings = ", ".join(f"`{o}`" for o in extra) or "–"
        rate = f"{epoch:.0f} s" if epoch < 600 else f"{epoch / 60:.0f} min"
        lines.append(f"| `{config}` | {settings} | {host} | {threads} | {len(group)} "
                     f"| {step:.2f} | {each} | {ratio} | {rate} |")  # fmt: skip
    return "\n".join([*lines, "", source_note(rows, "speed")]) + "\n"
