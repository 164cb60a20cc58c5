"""The docs' result tables, generated from the committed result rows in ``results/*.json``.

    python tools/tables.py            # rewrite every generated table in README.md and docs/
    python tools/tables.py --check    # exit 1 when a table differs from what its rows give

A generated table sits between two marker lines in a Markdown file::

    <!-- table: photos -->
    ...
    <!-- end table -->

``photos`` names both the rows (``results/photos.json``) and the function of ``TABLES`` that
renders them (``SOURCES`` names the rows of a table that shares another's file). Nothing
between the markers is typed by hand: edit the rows (by re-running the benchmark that writes
them) or the renderer, then run this script.
"""

from __future__ import annotations

import argparse
import json
import re
import shlex
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
DOCUMENTS = ("README.md", "docs/*.md")
_BLOCK = re.compile(r"(<!-- table: (\w+) -->\n)(.*?)(<!-- end table -->)", re.S)

Rows = list[dict[str, Any]]


def _hosts(rows: Rows) -> str:
    """The machines that made ``rows``, each once: ``2 cores (AMD EPYC; Intel Xeon)``."""
    cores = sorted({str(r["cores"]) for r in rows if "cores" in r})
    cpus = sorted({r["cpu"] for r in rows if "cpu" in r})
    return f"{' or '.join(cores)} cores ({'; '.join(cpus)})"


def _spread(values: list[float | None], digits: int = 3) -> str:
    """Mean, and the standard deviation where there are several values; missing values
    (None) are left out, and none at all is –."""
    present = [v for v in values if v is not None]
    if not present:
        return "–"
    if len(present) == 1:
        return f"{present[0]:.{digits}f}"
    return f"{statistics.mean(present):.{digits}f} ± {statistics.stdev(present):.{digits}f}"


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

    lines = [
        "| model | test CIDEr-D | each seed | seeds above nn | BLEU-1 | BLEU-4 | ROUGE-L "
        "| recipe (s) |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
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
        cells = [names[model], _spread([r["CIDEr"] for r in group]), each, above]
        cells += [_spread([r[key] for r in group]) for key in ("Bleu_1", "Bleu_4", "ROUGE_L")]
        cells.append(recipe)
        lines.append("| " + " | ".join(cells) + " |")
    first = rows[0]
    commits = ", ".join(sorted({_short(r["commit"]) for r in rows}))
    lines.append("")
    lines.append(
        f"{len(rows)} rows of `results/photos.json` (each with its command), commit "
        f"{commits}; {_hosts(rows)}, test split of "
        f"{first['test_images']} photos, beam {first['beam_size']}; seeds in brackets, "
        f"± the standard deviation across seeds."
    )
    busy = [r for r in rows if not r.get("timed_alone", True)]
    if busy:
        lines[-1] += (
            " Recipe seconds only from runs with nothing else on the machine; not timed: "
            + ", ".join(f"{r['model']} seed {r['seed']}" for r in busy)
            + "."
        )
    return "\n".join(lines) + "\n"


# overrides of paths, the model, the seed and the thread count: not what a lever changes
_PLUMBING = (
    "data.root=",
    "model.weights=",
    "model.attention=",
    "train.seed=",
    "train.threads=",
    "train.quiet=",
)


def photo_levers(rows: Rows) -> str:
    """The photo recipe's soft-attention model against the same model with one setting
    changed (``benchmarks/photos.py --variant``): validation and test CIDEr-D by seed."""
    soft = [r for r in rows if r["model"] == "soft" and "then" not in r]  # one stage only
    lines = [
        "| variant | setting changed | seeds | val CIDEr-D | test CIDEr-D | each seed (test) |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    variants = sorted({_variant(r) for r in soft}, key=lambda v: (v != RECIPE, v))
    for variant in variants:
        group = sorted((r for r in soft if _variant(r) == variant), key=lambda r: r["seed"])
        changed = sorted({o for r in group for o in r["overrides"] if not o.startswith(_PLUMBING)})
        setting = ", ".join(f"`{o}`" for o in changed) or "(the config as it is)"
        each = ", ".join(f"{r['CIDEr']:.3f} ({r['seed']})" for r in group)
        cells = [
            variant,
            setting,
            str(len(group)),
            _spread([r["val_CIDEr"] for r in group]),
            _spread([r["CIDEr"] for r in group]),
            each,
        ]
        lines.append("| " + " | ".join(cells) + " |")
    nn = [r for r in rows if r["model"] == "nn"]
    lines.append("")
    if nn:
        lines.append(
            f"The nearest neighbour scores {nn[0]['CIDEr']:.3f} on test at k = {nn[0]['k']} "
            f"(val {nn[0]['val_CIDEr_by_k'][str(nn[0]['k'])]:.3f})."
        )
    commands = sorted({r["command"] for r in soft if _variant(r) != RECIPE})
    lines.append(
        "Rows of `results/photos.json`; each variant's command: "
        + "; ".join(f"`{c}`" for c in commands)
        + "."
    )
    return "\n".join(lines) + "\n"


def photo_budget_timed(rows: Rows) -> str:
    """Two-stage photo recipes timed whole (``benchmarks/photos.py --then``): per row the
    stages' settings, the seconds of each part of the recipe, and the test CIDEr-D against
    the nearest neighbour's of the same file."""
    staged = sorted((r for r in rows if "then" in r), key=lambda r: (_variant(r), r["seed"]))
    nn = next((r["CIDEr"] for r in rows if r["model"] == "nn"), None)
    head = ["variant", "seed", "first stage", "second stage", "prepare + extract s",
            "first stage s", "second stage s", "evaluate s", "**recipe s**", "test CIDEr-D",
            "above nn"]  # fmt: skip
    lines = ["| " + " | ".join(head) + " |", "| " + " | ".join(["---"] * len(head)) + " |"]
    for r in staged:
        then = r["then"]
        first = [o for o in r["overrides"] if not o.startswith(_PLUMBING)]
        second = [o for o in then["overrides"] if not o.startswith(_PLUMBING)]
        before = (r.get("prepare_seconds") or 0) + (r.get("extract_seconds") or 0)
        cells = [
            _variant(r), str(r["seed"]),
            f"`{Path(r['config']).name}` " + ", ".join(f"`{o}`" for o in first),
            f"`{Path(then['config']).name}` " + ", ".join(f"`{o}`" for o in second),
            f"{before:.0f}", f"{then['first_seconds']:.0f}",
            f"{r['train_seconds'] - then['first_seconds']:.0f}",
            f"{r['evaluate_seconds']:.0f}", f"**{r['recipe_seconds']:.0f}**",
            f"{r['CIDEr']:.3f}", "–" if nn is None else ("yes" if r["CIDEr"] > nn else "no"),
        ]  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
    if not staged:
        lines.append("| (no two-stage rows yet) |" + " |" * (len(head) - 1))
    first = staged[0] if staged else {}
    commands = "; ".join(f"`{c}`" for c in dict.fromkeys(r["command"] for r in staged))
    busy = [f"{_variant(r)} seed {r['seed']}" for r in staged if not r.get("timed_alone", True)]
    lines += ["", f"Rows of `results/photos.json` with a second stage; nearest neighbour "
              f"{'–' if nn is None else f'{nn:.3f}'} on test. The prepare and extract seconds "
              "are the file's (measured once, reused by later invocations). "
              + (f"{_hosts(staged)}, "
                 + (f"not timed alone: {', '.join(busy)}" if busy else "each timed alone")
                 + f"; commands: {commands}." if first else "")]  # fmt: skip
    return "\n".join(lines) + "\n"


def serve_latency(rows: Rows) -> str:
    """The web demo's latency per client count (``benchmarks/serve_load.py``); rows measured
    with several ``--max-batch`` limits get a column for it (1: one image at a time) and the
    requests refused (503); rows of several models (``--name``) a column for the model, and
    each model's own cost per image at batch 1 and at its largest batch."""
    batches = any("max_batch" in r for r in rows)
    names = any("name" in r for r in rows)
    head = ["clients", "requests", "requests/s", "p50 (ms)", "p95 (ms)", "p99 (ms)"]
    if batches:
        head = ["max batch", *head, "refused"]
    if names:
        head = ["model", *head]
    lines = ["| " + " | ".join(head) + " |", "| " + " | ".join(["---"] * len(head)) + " |"]
    order = list(dict.fromkeys(r.get("name", "") for r in rows))
    key = lambda r: (order.index(r.get("name", "")), r.get("max_batch", 0), r["clients"])  # noqa: E731
    for r in sorted(rows, key=key):
        cells = [str(r["clients"]), str(r["requests"]), f"{r['requests_per_s']:.2f}",
                 f"{r['p50_ms']:.0f}", f"{r['p95_ms']:.0f}", f"{r['p99_ms']:.0f}"]  # fmt: skip
        if batches:
            cells = [str(r.get("max_batch", 1)), *cells, str(r.get("refused", 0))]
        if names:
            cells = [r.get("name", ""), *cells]
        lines.append("| " + " | ".join(cells) + " |")
    lines.append("")
    for name in order:
        group = [r for r in rows if r.get("name", "") == name]
        first = group[0]
        notes = _batch_gain(group)
        notes += _model_cost(first)
        label = f"**{name}**: " if names else ""
        lines.append(
            f"{label}`{first['command']}`, commit {_short(first['commit'])}, beam "
            f"{first['beam_size']}, {first['images']} images sent in turn; {first['cores']} "
            f"cores ({first['cpu']})" + "".join(f"; {n}" for n in notes) + "."
        )
        lines.append("")
    return "\n".join(lines[:-1]) + "\n"


def _model_cost(row: dict[str, Any]) -> list[str]:
    """The model's own ms per image by batch size (encoder; encoder and beam search) and
    the requests/s its encoder allows at best, from ``benchmarks/serve_load.py``'s row."""

    def by_batch(kind: str) -> dict[int, float]:
        prefix = f"model_{kind}_ms_batch"
        return {int(k[len(prefix) :]): v for k, v in row.items() if k.startswith(prefix)}

    encode, caption = by_batch("encode"), by_batch("caption")
    if not encode:
        return []

    def listing(values: dict[int, float]) -> str:
        sizes = sorted(values)
        ms = " / ".join(f"{values[b]:.1f}" for b in sizes)
        return f"{ms} at batch {' / '.join(str(b) for b in sizes)}"

    precision = f" in {row['precision']}" if row.get("precision") else ""
    notes = [f"the encoder alone{precision} {listing(encode)} ms per image"]
    if caption:
        notes.append(f"encoder and beam search {listing(caption)}")
    fixed = row.get("prepare_ms", 0.0) + row.get("answer_ms", 0.0)
    if "answer_ms" in row:
        notes.append(f"preparing an upload {row['prepare_ms']:.1f} ms and its answer's JSON "
                     f"{row['answer_ms']:.1f} ms")  # fmt: skip
    notes.append(
        f"so at most {1000 / (min(encode.values()) + fixed):.0f} requests/s whatever the "
        "server does"
    )
    batched = {b: v for b, v in caption.items() if b > 1}
    if "answer_ms" in row and batched:
        best = min(batched, key=batched.get)
        notes.append(f"at most {1000 / (batched[best] + fixed):.0f} with the whole "
                     f"captioning at its cheapest batch size ({best})")  # fmt: skip
    return notes


def _batch_gain(rows: Rows) -> list[str]:
    """The requests/s with the largest batch limit over one image at a time, per client
    count above one (an empty list without both)."""
    gains = []
    for clients in sorted({r["clients"] for r in rows}):
        rates = {
            r.get("max_batch", 1): r["requests_per_s"] for r in rows if r["clients"] == clients
        }
        largest = max(rates)
        if largest > 1 and 1 in rates and clients > 1:
            gains.append(f"{rates[largest] / rates[1]:.2f}x at {clients}")
    if not gains:
        return []
    return ["batches against one image at a time: " + ", ".join(gains) + " clients"]


def _chosen_lr(rows: Rows) -> float | None:
    """The learning rate of the best validation score among one member's sweep rows (the
    lower rate on a tie), as tools/compare_attention.py chooses it; None if none scored."""
    scored = [r for r in rows if r.get("phase") == "sweep" and "val" in r]
    if not scored:
        return None
    return max(scored, key=lambda r: (r["val_select"], -r["lr"]))["lr"]


def _members(rows: Rows) -> dict[str, Rows]:
    """The rows of each member, in the order the file holds them."""
    members: dict[str, Rows] = {}
    for row in rows:
        members.setdefault(row["member"], []).append(row)
    return members


def _score(value: float | None) -> str:
    return "–" if value is None else f"{value:.3f}"


def _mean(values: list[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.mean(present) if present else None


def _test(row: dict[str, Any], hard_context: str | None) -> dict[str, Any]:
    """A row's test scores, or those of one decoding mode of hard attention."""
    return row["test"] if hard_context is None else row["test_by_hard_context"][hard_context]


def attention_family(rows: Rows) -> str:
    """The attention family on shapes (``tools/compare_attention.py``): one line per member
    at its chosen learning rate, test exact match as mean ± sd over the seeds and each seed,
    and the means of the other test scores; hard attention gets a line per decoding mode."""
    head = ["member", "lr", "exact", "each seed", "exact, 3 objects",
            "pointing colour / size / shape", "pointing, local centre", "mass in box",
            "BLEU-4", "CIDEr-D", "parameters", "train time"]  # fmt: skip
    lines = ["| " + " | ".join(head) + " |", "| " + " | ".join(["---"] * len(head)) + " |"]
    for member, group in _members(rows).items():
        lr = _chosen_lr(group)
        if lr is None:
            failed = sorted(f"{r['lr']:g}" for r in group if r.get("phase") == "sweep")
            cells = [member, "–", f"failed at every rate ({', '.join(failed)})"]
            lines.append("| " + " | ".join(cells + ["–"] * (len(head) - 3)) + " |")
            continue
        seeds = sorted((r for r in group if r["lr"] == lr), key=lambda r: r["seed"])
        scored = [r for r in seeds if "test" in r]
        minutes = [r["train_seconds"] / 60 for r in scored if r.get("timed_alone", True)]
        hard = scored[0].get("test_by_hard_context")
        for mode in [None] if hard is None else list(hard):
            tests = [_test(r, mode) for r in scored]
            each = ", ".join(
                f"{_test(r, mode)['exact']:.3f} ({r['seed']})" if "test" in r
                else f"failed ({r['seed']})" for r in seeds
            )  # fmt: skip
            pointing = " / ".join(
                _score(_mean([t[k] for t in tests]))
                for k in ("pointing_color", "pointing_size", "pointing_shape")
            )
            cells = [
                member if mode is None else f"{member} ({mode})",
                f"{lr:g}",
                _spread([t["exact"] for t in tests]),
                each,
                _score(_mean([t["exact_3_objects"] for t in tests])),
                pointing,
                *(_score(_mean([t[k] for t in tests]))
                  for k in ("centre_pointing", "mass_in_box", "Bleu_4", "CIDEr")),
                f"{scored[0]['parameters'] / 1e6:.2f}M",
                "–" if not minutes else f"{statistics.mean(minutes):.1f} min",
            ]  # fmt: skip
            lines.append("| " + " | ".join(cells) + " |")
    lines.append("")
    lines.append(_family_note(rows))
    return "\n".join(lines) + "\n"


def _family_note(rows: Rows) -> str:
    """Where the attention family's rows come from: commits, machine, precision, commands."""
    first = rows[0]
    commits = ", ".join(sorted({_short(r["commit"]) for r in rows}))
    precisions = ", ".join(sorted({r["precision"] for r in rows if "precision" in r}))
    commands = "; ".join(f"`{c}`" for c in sorted({r["command"] for r in rows}))
    note = (
        f"{len(rows)} rows of `results/attention_family.json`, commit {commits}; "
        f"{_hosts(rows)}, torch {first['torch']}, {precisions}. "
        f"The learning rate is each member's best on validation exact match in the sweep "
        f"below; test split, greedy decoding; seeds in brackets, ± the standard deviation "
        f"across seeds, the other scores the mean over the seeds; train time the mean of the "
        f"epochs' seconds"
    )
    busy = [r for r in rows if not r.get("timed_alone", True)]
    if busy:
        note += ", from runs with nothing else on the machine"
    return note + f". Written by {commands}."


def multi_head(rows: Rows) -> str:
    """One head against H = 2, 4, 8 seed by seed, each at its chosen rate of the family study
    (``tools/compare_attention.py``): test exact match and the pointing game by word type."""
    lines = [
        "| heads | lr | seed | exact | pointing colour / size / shape |",
        "| --- | --- | --- | --- | --- |",
    ]
    members = _members(rows)
    for heads, member in ((1, "soft"), (2, "multi-head-2"), (4, "multi-head-4"),
                          (8, "multi-head-8")):  # fmt: skip
        group = members.get(member, [])
        lr = _chosen_lr(group)
        if lr is None:
            continue
        for r in sorted((r for r in group if r["lr"] == lr and "test" in r),
                        key=lambda r: r["seed"]):  # fmt: skip
            t = r["test"]
            exact = f"**{t['exact']:.3f}**" if t["exact"] < 0.5 else f"{t['exact']:.3f}"
            pointing = " / ".join(
                _score(t[k]) for k in ("pointing_color", "pointing_size", "pointing_shape")
            )
            lines.append(f"| {heads} | {lr:g} | {r['seed']} | {exact} | {pointing} |")
    lines += ["", "Rows of `results/attention_family.json`, the family study below; bold: stalled "
              "(below 0.5)."]  # fmt: skip
    return "\n".join(lines) + "\n"


def attention_family_sweep(rows: Rows) -> str:
    """The attention family's learning-rate sweep: validation exact match of each member at
    each rate (the sweep's seed), the chosen rate in bold."""
    sweep = [r for r in rows if r.get("phase") == "sweep"]
    lrs = sorted({r["lr"] for r in sweep})
    head = ["member", *(f"lr {lr:g}" for lr in lrs)]
    lines = ["| " + " | ".join(head) + " |", "| " + " | ".join(["---"] * len(head)) + " |"]
    for member, group in _members(sweep).items():
        chosen = _chosen_lr(group)
        by_lr = {r["lr"]: r for r in group}
        cells = [member]
        for lr in lrs:
            row = by_lr.get(lr)
            if row is None:
                cells.append("–")
            elif "val" not in row:
                cells.append("failed")
            else:
                value = f"{row['val_select']:.3f}"
                cells.append(f"**{value}**" if lr == chosen else value)
        lines.append("| " + " | ".join(cells) + " |")
    seeds = ", ".join(str(s) for s in sorted({r["seed"] for r in sweep}))
    metrics = ", ".join(sorted({r["select_metric"] for r in sweep}))
    lines.append("")
    lines.append(
        f"Validation {metrics} at seed {seeds}, greedy decoding; a rate sets `train.lr` and "
        f"`train.encoder_lr` together; bold: the chosen rate; failed: the training stopped "
        f"(a non-finite loss or weights); –: not run."
    )
    return "\n".join(lines) + "\n"


def _short(commit: str) -> str:
    """A commit's first 7 characters, marked ``+dirty`` when the checkout had changes."""
    return commit[:7] + ("+dirty" if commit.endswith("+dirty") else "")


def _per_seed(rows: Rows, key: str) -> str:
    """One score of each row, in the rows' order; a stalled run's in bold."""
    return " / ".join(f"**{r[key]:.3f}**" if r["stalled"] else f"{r[key]:.3f}" for r in rows)


def shapes_seeds(rows: Rows) -> str:
    """The shapes recipe's seeds (``tools/seed_study.py``): one line per variant with its
    settings, test exact match and colour probe per seed, how many seeds stalled and the mean
    of the others, then where the runs come from and the command that re-runs each variant."""
    head = ["variant", "settings", "seeds", "test exact per seed", "stalled",
            "mean, not stalled", "colour probe per seed"]  # fmt: skip
    lines = ["| " + " | ".join(head) + " |", "| " + " | ".join(["---"] * len(head)) + " |"]
    variants: dict[str, Rows] = {}
    for row in rows:
        variants.setdefault(row["variant"], []).append(row)
    reruns = []
    for variant, group in variants.items():
        group = sorted(group, key=lambda r: r["seed"])
        settings = sorted({o for r in group for o in r["overrides"]})
        healthy = [r["test_exact"] for r in group if not r["stalled"]]
        stalled = sum(r["stalled"] for r in group)
        cells = [
            variant,
            ", ".join(f"`{o}`" for o in settings) or "(the config as it is)",
            ", ".join(str(r["seed"]) for r in group),
            _per_seed(group, "test_exact"),
            f"{stalled} of {len(group)}",
            _spread(healthy) if healthy else "–",
            _per_seed(group, "colour_probe"),
        ]
        lines.append("| " + " | ".join(cells) + " |")
        words = ["python", "tools/seed_study.py", "--out", "runs/seeds", "--variant", variant]
        if group[0]["config"] != "configs/shapes_soft.yaml":
            words += ["--config", group[0]["config"]]
        seeds = [r["seed"] for r in group]
        if seeds != list(range(10)):  # tools/seed_study.py's default seeds
            words += ["--seeds", ",".join(str(s) for s in seeds)]
        words += [w for o in settings for w in ("--set", o)]
        threads = {r.get("train_threads") for r in group}
        if len(threads) == 1 and None not in threads:
            words += ["--threads", str(threads.pop())]
        reruns.append(f"{variant}: `{shlex.join(words)}`")
    first = rows[0]
    trained = ", ".join(sorted({_short(r["commit"]) for r in rows}))
    evaluated = ", ".join(sorted({_short(r["evaluated_at"]) for r in rows}))
    adopted = sum(r.get("adopted", False) for r in rows)
    lines.append("")
    lines.append(
        f"{len(rows)} rows of `results/shapes_seeds.json` ({adopted} of them runs trained "
        f"before the study and adopted into it; each row says how it was trained), trained at "
        f"{trained}, evaluated at {evaluated}; {_hosts(rows)}, torch "
        f"{', '.join(sorted({r['torch'] for r in rows}))}. Test split, greedy decoding; bold: "
        f"stalled (test exact match below 0.5); the mean ± sd is over the seeds that did not "
        f"stall. Colour probe: held-out accuracy of a logistic regression from the decoder's "
        f"grid feature under each object's centre to its colour "
        f"({first['probe_objects']['held_out']} objects of the last third of 400 validation "
        f"images; chance {first['probe_chance']:.3f})."
    )
    lines.append("")
    lines.append("Each variant, trained afresh: " + "; ".join(reruns) + ".")
    return "\n".join(lines) + "\n"


# the variant of results/shapes_seeds.json that is configs/shapes_soft.yaml as shipped
# (tests/test_tables.py holds that it sets nothing the config does not say)
SHAPES_RECIPE = "preact"
# configs/shapes_hard.yaml's learning rate (tests/test_tables.py holds the two equal)
HARD_LR = 0.004


def shapes_recipe(rows: Rows) -> str:
    """The shipped shapes recipe seed by seed (the ``SHAPES_RECIPE`` rows of
    ``results/shapes_seeds.json``): test exact match overall and by object count, pointing
    per word type, whether it stalled."""
    group = sorted((r for r in rows if r["variant"] == SHAPES_RECIPE), key=lambda r: r["seed"])
    lines = [
        "| seed | exact match | 1 object | 2 objects | 3 objects | pointing: colour | size "
        "| shape | stalled |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in group:
        by, point = r["test_exact_by_objects"], r["pointing"]
        cells = [str(r["seed"]), f"**{r['test_exact']:.3f}**" if r["stalled"] else
                 f"{r['test_exact']:.3f}"]  # fmt: skip
        cells += [f"{by[k]:.3f}" for k in ("1", "2", "3")]
        cells += [f"{point[k]:.3f}" for k in ("color", "size", "shape")]
        cells.append("yes" if r["stalled"] else "no")
        lines.append("| " + " | ".join(cells) + " |")
    stalled = sum(r["stalled"] for r in group)
    first = group[0]
    lines += [
        "",
        f"{len(group)} rows of `results/shapes_seeds.json` (variant {SHAPES_RECIPE}), trained "
        f"at {', '.join(sorted({_short(r['commit']) for r in group}))} with "
        f"{first['train_threads']} thread in {first['precision']}; test split, greedy decoding; "
        f"{stalled} of "
        f"{len(group)} seeds stalled (bold). Each seed: `{first['train_command']}` with its "
        "`train.seed`.",
    ]
    return "\n".join(lines) + "\n"


# what each shipped shapes config must reach on every seed (docs/attention.md): test exact
# match, exact match on three-object images, and the pointing game of each word type
SHAPES_TARGETS = {
    "configs/shapes_soft.yaml": {"exact": 0.95, "three": 0.90, "pointing": 0.90},
    "configs/shapes_hard.yaml": {"exact": 0.95, "three": 0.90, "pointing": 0.90},
    "configs/shapes_local.yaml": {"exact": 0.90, "three": None, "pointing": None},
}


def _at_target(row: dict[str, Any], target: dict[str, float | None]) -> bool:
    if row["test_exact"] < target["exact"]:
        return False
    if target["three"] is not None and row["test_exact_by_objects"]["3"] < target["three"]:
        return False
    return target["pointing"] is None or all(
        (row["pointing"][word] or 0) >= target["pointing"] for word in ("color", "size", "shape")
    )


def _block_only(row: dict[str, Any]) -> str | None:
    """The small CNN's blocks of a row whose only override (if any) names them, else None."""
    overrides = row["overrides"]
    if not overrides:
        return "preact"  # model.cnn_block's default
    if len(overrides) == 1 and overrides[0].startswith("model.cnn_block="):
        return overrides[0].split("=", 1)[1]
    return None


def shapes_targets(rows: Rows) -> str:
    """Each shipped shapes config as it is, and with the small CNN's other blocks (the rows of
    ``results/shapes_seeds.json`` whose only override is ``model.cnn_block``), over its
    seeds: how many stalled, how many reached the config's target, the lowest score of each
    kind and the median training seconds."""
    lines = ["| config | blocks | seeds | stalled | at target | target | lowest exact "
             "| lowest 3 objects | lowest pointing: colour / size / shape "
             "| median train s (threads) |",
             "|" + " --- |" * 10]  # fmt: skip
    for config, target in SHAPES_TARGETS.items():
        blocks = [b for b in ("preact", "residual", "plain")
                  if any(r["config"] == config and _block_only(r) == b for r in rows)]  # fmt: skip
        for block in blocks:
            group = [r for r in rows if r["config"] == config and _block_only(r) == block]
            lines.append(_target_line(config, block, group, target))
    return "\n".join(lines) + "\n"


def _target_line(config: str, block: str, group: Rows, target: dict[str, float | None]) -> str:
    wants = [f"exact >= {target['exact']}"]
    if target["three"] is not None:
        wants.append(f"3 objects >= {target['three']}")
    if target["pointing"] is not None:
        wants.append(f"pointing >= {target['pointing']}")
    lowest = [min(r["pointing"][w] or 0 for r in group) for w in ("color", "size", "shape")]
    seconds = sorted(r["train_seconds"] for r in group)
    threads = ", ".join(sorted({str(r["train_threads"]) for r in group}))
    seeds = ", ".join(str(s) for s in sorted(r["seed"] for r in group))
    shipped = " (shipped)" if block == "preact" else ""
    return (
        f"| `{config}` | {block}{shipped} | {seeds} "
        f"| {sum(r['stalled'] for r in group)} of {len(group)} "
        f"| {sum(_at_target(r, target) for r in group)} of {len(group)} | {'; '.join(wants)} "
        f"| {min(r['test_exact'] for r in group):.3f} "
        f"| {min(r['test_exact_by_objects']['3'] for r in group):.3f} "
        f"| {' / '.join(f'{v:.3f}' for v in lowest)} "
        f"| {seconds[len(seconds) // 2]:.0f} ({threads}) |"
    )


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
    commits = ", ".join(sorted({_short(r["commit"]) for r in rows}))
    lines += ["", f"{len(rows)} rows of `results/colour_trace.json`, `{first['config']}` "
              f"({settings}), at {commits}. Held-out accuracy of the colour probe (chance "
              f"0.167) before each step, on the objects of 300 validation images, from the "
              f"feature under each object's centre; each run stops after its last probe (the "
              f"seed study's rows are the whole runs). Re-run: "
              + "; ".join(f"`{c}`" for c in dict.fromkeys(r["command"] for r in rows))
              + "."]  # fmt: skip
    return "\n".join(lines) + "\n"


_SCST_NAMES = {
    "xe": "cross-entropy (7 epochs)",
    "scst_loo": "+ SCST, `loo` baseline (1 epoch)",
    "scst_greedy": "+ SCST, `greedy` baseline (1 epoch)",
    "xe_control": "+ cross-entropy (1 epoch, the control)",
}


def scst_shapes(rows: Rows) -> str:
    """Self-critical training on the varied shapes captions (``tools/scst_study.py``): per
    variant the test CIDEr-D of each seed, its mean, its ratio to the cross-entropy model it
    started from (the mean of the seeds' ratios), and the other scores and caption statistics
    as means over the seeds."""
    by_seed = {(r["variant"], r["seed"]): r for r in rows}
    seeds = sorted({r["seed"] for r in rows})
    head = ["model", "test CIDEr-D per seed", "mean", "× cross-entropy", "BLEU-4", "METEOR",
            "exact match", "mean length", "ends in a / and / of / the"]  # fmt: skip
    lines = ["| " + " | ".join(head) + " |", "| " + " | ".join(["---"] * len(head)) + " |"]
    for variant, name in _SCST_NAMES.items():
        group = [by_seed[(variant, s)] for s in seeds if (variant, s) in by_seed]
        if not group:
            continue
        ratios = [r["CIDEr"] / by_seed[("xe", r["seed"])]["CIDEr"] for r in group
                  if ("xe", r["seed"]) in by_seed]  # fmt: skip
        cells = [
            name,
            " / ".join(f"{r['CIDEr']:.3f}" for r in group),
            _spread([r["CIDEr"] for r in group]),
            _spread(ratios),
            *(_spread([r.get(k) for r in group]) for k in ("Bleu_4", "METEOR", "exact_match")),
            _spread([r["mean_length"] for r in group], 2),
            _spread([r["dangling"] for r in group]),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    first = rows[0]
    where = first["machine"]
    commits = ", ".join(sorted({_short(r["commit"]) for r in rows}))
    timed = "timed alone" if all(r["timed_alone"] for r in rows) else "not timed alone"
    lines += [
        "",
        f"{len(rows)} rows of `results/scst_shapes.json`: seeds "
        f"{', '.join(str(s) for s in seeds)}, commit {commits}, {where['cores']} cores "
        f"({where['cpu']}), {where['threads']} thread(s), torch {where['torch']} ({timed}). "
        f"Test split ({first['test_images']} images), beam {first['beam_size']}; per seed in "
        f"the order {' / '.join(str(s) for s in seeds)}; mean ± the standard deviation across "
        "seeds; × cross-entropy is the mean over seeds of the ratio to that seed's "
        "cross-entropy model. Made by `python tools/scst_study.py --data data/shapes_varied "
        "--out runs/scst_study`; each row holds its `captioning train` command.",
    ]
    return "\n".join(lines) + "\n"


def _sweep_groups(rows: Rows) -> tuple[dict[str, Any] | None, dict[str, Rows]]:
    """The sweep's nearest-neighbour row, and its other rows by job name, seeds in order."""
    nn = next((r for r in rows if r["name"] == "nn"), None)
    groups: dict[str, Rows] = {}
    for row in sorted((r for r in rows if r["name"] != "nn"), key=lambda r: r["seed"]):
        groups.setdefault(row["name"], []).append(row)
    return nn, groups


def _sweep_line(name: str, group: Rows, setting: str, nn: float | None) -> str:
    test = [r["test_CIDEr_beam3"] for r in group]
    each = ", ".join(f"{t:.3f} ({r['seed']})" for t, r in zip(test, group))
    above = "–" if nn is None else f"{sum(t > nn for t in test)} of {len(test)}"
    cells = [name, setting, _spread([r["val_best"] for r in group]), _spread(test), each, above]
    return "| " + " | ".join(cells) + " |"


def _sweep_note(rows: Rows, nn: dict[str, Any] | None, source: str = "photo_sweep") -> str:
    commits = ", ".join(sorted({_short(r["commit"]) for r in rows}))
    devices = ", ".join(sorted({r["device"] for r in rows}))
    tokenizers = sorted({r["tokenizer"] for r in rows})
    text = (
        f"{len(rows)} rows of `results/{source}.json`, commit {commits}, on {devices}; "
        "test split of 293 photos, beam 3; seeds in brackets, ± the standard deviation "
        "across seeds."
    )
    if nn is not None:
        text += (
            f" The nearest neighbour, on the same grids: test {nn['test_CIDEr_beam3']:.3f} at "
            f"k = {nn['k']} (val {nn['val_CIDEr_by_k'][str(nn['k'])]:.3f})."
        )
    if tokenizers == ["python"]:
        text += (
            " Captions tokenized in Python (no Java on that machine), so scores differ "
            "slightly from `results/photos.json`'s: compare rows within this table."
        )
    commands = sorted({r["command"] for r in rows})
    return text + " Commands: " + "; ".join(f"`{c}`" for c in commands) + "."


def photo_sweep(rows: Rows, source: str = "photo_sweep") -> str:
    """Cross-entropy levers and self-critical training on the photo recipe
    (``tools/photo_sweep.py``): per job, validation and test CIDEr-D over seeds, and on how
    many seeds the test score beats the nearest neighbour of the same run."""
    rows = [r for r in rows if not r["name"].startswith("family-")]
    nn, groups = _sweep_groups(rows)
    lines = [
        "| run | settings (beyond the recipe) | val CIDEr-D | test CIDEr-D | each seed (test) "
        "| above nn |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    order = sorted(groups, key=lambda n: (groups[n][0]["init"] is not None, n != "recipe", n))
    for name in order:
        group = groups[name]
        changed = [o for o in group[0]["set"] if not o.startswith(_PLUMBING)]
        setting = ", ".join(f"`{o}`" for o in changed) or "(the config as it is)"
        if group[0]["init"]:
            setting = f"from `{group[0]['init']}`: " + setting
        lines.append(_sweep_line(name, group, setting, nn and nn["test_CIDEr_beam3"]))
    return "\n".join([*lines, "", _sweep_note(rows, nn, source)]) + "\n"


def photo_budget(rows: Rows) -> str:
    """The photo recipe cut to the 10-minute budget on a 2-core CPU
    (``tools/photo_sweeps/budget.json``), in the form of :func:`photo_sweep`."""
    return photo_sweep(rows, "photo_budget")


def photo_family(rows: Rows) -> str:
    """The attention family on the photo recipe (``tools/photo_sweep.py`` with
    ``tools/photo_sweeps/family.json``), the recipe's additive score (``recipe``) among them,
    best test mean first."""
    nn, groups = _sweep_groups(rows)
    members = {n: g for n, g in groups.items() if n.startswith("family-") or n == "recipe"}
    lines = [
        "| member | settings | val CIDEr-D | test CIDEr-D | each seed (test) | above nn |",
        "| --- | --- | --- | --- | --- | --- |",
    ]

    def mean_test(name: str) -> float:
        return statistics.mean(r["test_CIDEr_beam3"] for r in members[name])

    for name in sorted(members, key=lambda n: -mean_test(n)):
        group = members[name]
        setting = ", ".join(f"`{o}`" for o in group[0]["set"]) or "(additive, the recipe)"
        label = "soft" if name == "recipe" else name.removeprefix("family-")
        lines.append(_sweep_line(label, group, setting, nn and nn["test_CIDEr_beam3"]))
    used = [r for n in members for r in members[n]] + ([nn] if nn else [])
    return "\n".join([*lines, "", _sweep_note(used, nn)]) + "\n"


def estimator_variance(rows: Rows) -> str:
    """Each hard-attention estimator's cost, variance and error on one fixed batch
    (``tools/estimator_variance.py``)."""
    lines = [
        "| estimator | s / estimate | variance | bias² vs ∇log p(y) | MSE vs ∇log p(y) | "
        "MSE vs ∇E_q[r] | MSE × s |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        cells = [f"{r['seconds']:.3f}"] + [
            f"{r[k]:.3g}"
            for k in ("variance", "bias2_marginal", "mse_marginal", "mse_paper", "mse_x_seconds")
        ]
        lines.append(f"| {r['estimator']} | " + " | ".join(cells) + " |")
    first, ref = rows[0], rows[0]["reference"]
    settings = first["settings"]
    lines += [
        "",
        f"{len(rows)} rows of `results/estimator_variance.json`, commit {_short(first['commit'])}, "
        f"seed {settings['seed']}; {settings['batch']} captions, {settings['repeats']} estimates "
        f"each, K = {settings['samples']}; {first['cores']} cores ({first['cpu']}). "
        f"|∇log p(y | a)|² = {ref['marginal_gradient_norm'] ** 2:.3g}, "
        f"|∇E_q[r]|² = {ref['paper_gradient_norm'] ** 2:.3g} (r = log p(y | s, a)), "
        f"cosine {ref['cosine_marginal_paper']:.3f}; REINFORCE's moving-average baseline "
        f"b = {ref['baseline']:.3g} ({ref['baseline_source']}). The checkpoint: "
        f"`{first['trained_by']}`; the rows: `{first['command']}`.",
    ]
    return "\n".join(lines) + "\n"


# the test scores of tools/compare_estimators.py's rows and their column names
ESTIMATOR_COLUMNS = {
    "exact_match": "exact",
    "Bleu_4": "BLEU-4",
    "CIDEr": "CIDEr-D",
    "pointing_game/color": "pointing colour",
    "pointing_game/size": "pointing size",
    "pointing_game/category": "pointing shape",
}


def _setting(value: Any) -> str:
    return "–" if value is None else f"{value:g}"


def hard_estimators(rows: Rows, source: str = "hard_estimators") -> str:
    """Hard attention trained by each estimator (``tools/compare_estimators.py``): one line
    per (estimator, decode mode) with the settings that differ between estimators, the seeds,
    the test scores (mean ± sd over seeds) and the training time."""
    header = ("| estimator | decode | seeds | soft minibatches | λ_r | entropy | K | "
              + " | ".join(ESTIMATOR_COLUMNS.values()) + " | train time |")  # fmt: skip
    lines = [header, "|" + " --- |" * (len(ESTIMATOR_COLUMNS) + 8)]
    groups: dict[tuple[str, str], Rows] = {}
    for row in rows:
        groups.setdefault((row["estimator"], row["decode"]), []).append(row)
    for (estimator, mode), group in groups.items():
        first = group[0]
        share = f"{first['soft_share']:g}"
        if first.get("soft_share_per") == "sample":
            share += " (per caption)"
        settings = [share, *(_setting(first[key]) for key in
                             ("reinforce_weight", "entropy_weight", "hard_samples"))]  # fmt: skip
        cells = [_spread([r.get(key) for r in group]) for key in ESTIMATOR_COLUMNS]
        seeds = ",".join(str(r["seed"]) for r in group)
        # rows trained beside other work (--machine-busy) are not timed
        timed = [r["train_seconds"] / 60 for r in group if r.get("timed_alone", True)]
        minutes = f"{_spread(timed, digits=1)} min" if timed else "–"
        lines.append(f"| {estimator} | {mode} | {seeds} | " + " | ".join(settings + cells)
                     + f" | {minutes} |")  # fmt: skip
    made = [r for r in rows if "commit" in r]
    if made:
        commits = ", ".join(sorted({_short(r["commit"]) for r in made}))
        commands = "; ".join(f"`{c}`" for c in sorted({r["command"] for r in made}))
        lines += ["", f"{len(rows)} rows of `results/{source}.json`, commit {commits}; "
                  f"{made[0]['cores']} cores ({made[0]['cpu']}); test split, METEOR skipped; "
                  f"± the standard deviation over the seeds; train time only from runs with "
                  f"nothing else on the machine. Written by {commands}."]  # fmt: skip
    return "\n".join(lines) + "\n"


def hard_estimators_paper_wiring(rows: Rows) -> str:
    """:func:`hard_estimators` of the paper's wiring (context into the LSTM, scalar gate)."""
    return hard_estimators(rows, "hard_estimators_paper_wiring")


def hard_authors(rows: Rows) -> str:
    """:func:`hard_estimators` of the authors' recipe (REINFORCE, the paper's wiring)."""
    return hard_estimators(rows, "hard_authors")


def hard_recipe(rows: Rows) -> str:
    """``configs/shapes_hard.yaml`` seed by seed: the family study's hard-attention rows at
    the config's own learning rate (``HARD_LR``), decoded with the expected context."""
    group = sorted(
        (r for r in rows if r["member"] == "hard" and r["lr"] == HARD_LR and "test" in r),
        key=lambda r: r["seed"],
    )
    lines = [
        "| seed | exact | 3 objects | BLEU-4 | CIDEr-D | pointing (colour / size / shape) |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for r in group:
        t = r["test_by_hard_context"]["expectation"]
        pointing = " / ".join(
            _score(t[k]) for k in ("pointing_color", "pointing_size", "pointing_shape")
        )
        cells = [str(r["seed"]), _score(t["exact"]), _score(t["exact_3_objects"]),
                 _score(t["Bleu_4"]), f"{t['CIDEr']:.2f}", pointing]  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
    first = group[0]
    lines += [
        "",
        f"{len(group)} rows of `results/attention_family.json` (member hard at lr {HARD_LR:g}, "
        f"the config's), commit {_short(first['commit'])}; {first['cores']} cores "
        f"({first['cpu']}), {first['precision']}, one thread; test split, expectation decoding.",
    ]
    return "\n".join(lines) + "\n"


# --- the speed page (results/speed.json: rows of benchmarks/time_to_quality.py, bench.py,
# beam_floor.py and profile_epoch.py, told apart by ``kind``)


def _kind(rows: Rows, kind: str) -> Rows:
    return [r for r in rows if r.get("kind") == kind]


def _provenance(rows: Rows, what: str) -> str:
    """One line: where the rows came from (commits, machine, whether timed alone, commands)."""
    where = rows[0]["machine"]
    commits = ", ".join(sorted({_short(r["commit"]) for r in rows}))
    alone = "an otherwise idle machine" if all(r["timed_alone"] for r in rows) else (
        "a machine doing other work too")  # fmt: skip
    commands = "; ".join(f"`{c}`" for c in sorted({r["command"] for r in rows}))
    return (f"{len(rows)} {what} rows of `results/speed.json`, commit {commits}, on "
            f"{alone}: {where['cores']} cores ({where['cpu']}), torch {where['torch']}. "
            f"Made by {commands}.")  # fmt: skip


def speed_quality(rows: Rows) -> str:
    """Time to quality (``benchmarks/time_to_quality.py``): each run's wall seconds and test
    scores against its targets."""
    rows = _kind(rows, "quality")
    head = ["run", "target", "seconds", "test exact", "3 objects",
            "pointing: colour / size / shape", ""]  # fmt: skip
    lines = ["| " + " | ".join(head) + " |", "| " + " | ".join(["---"] * len(head)) + " |"]
    for r in rows:
        t = r["target"]
        target = f"≤ {t['seconds']:.0f} s; exact ≥ {t['exact']:.2f}"
        if "three_objects" in t:
            target += f", 3 objects ≥ {t['three_objects']:.2f}"
        if "pointing" in t:
            target += f", pointing ≥ {t['pointing']:.2f}"
        pointing = r["pointing"] if r["recipe"] != "quickstart" else {}
        cells = [
            f"`{r['run_command']}`" if r["recipe"] == "quickstart" else r["name"],
            target,
            f"**{r['seconds']:.0f}**",
            f"{r['exact']:.3f}",
            _score(r.get("three_objects")),
            " / ".join(_score(v) for v in pointing.values()) or "–",
            "met" if r["met"] else "**not met**",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    runs = "; ".join(f"`{r['run_command']}`" for r in rows if r["recipe"] != "quickstart")
    lines += [
        "",
        _provenance(rows, "time-to-quality") + f" The training runs: {runs}; each timed from "
        "start to exit, then its `best.pt` scored on the test split (greedy).",
    ]
    return "\n".join(lines) + "\n"


def _seconds(value: float | None) -> str:
    if value is None:
        return "–"
    return f"{value:.3g} s"


def speed_bench(rows: Rows) -> str:
    """Ours against the reference (``benchmarks/bench.py``): per size, device, precision and
    task the median seconds of the reference, of ours and of ours compiled, and the ratios."""
    rows = _kind(rows, "bench")
    groups: dict[tuple, dict[tuple, dict[str, Any]]] = {}
    for r in rows:
        group = groups.setdefault((r["size"], r["device"], r["precision"], r["task"]), {})
        group[(r["impl"], r["compiled"])] = r
    head = ["size", "device", "precision", "task", "reference", "ours", "speed-up",
            "ours, compiled", "speed-up"]  # fmt: skip
    lines = ["| " + " | ".join(head) + " |", "| " + " | ".join(["---"] * len(head)) + " |"]
    for (size, device, precision, task), group in groups.items():
        reference = (group.get(("reference", False)) or {}).get("median_s")
        cells = [size, device, precision, task.replace("_", " "), _seconds(reference)]
        for compiled in (False, True):
            ours = (group.get(("ours", compiled)) or {}).get("median_s")
            ratio = f"{reference / ours:.1f}×" if reference and ours else "–"
            cells += [_seconds(ours), ratio]
        lines.append("| " + " | ".join(cells) + " |")
    passed = all(r["checks_passed"] for r in rows)
    lines += [
        "",
        _provenance(rows, "timing")
        + (
            " Ours and the reference agreed in every check of the run."
            if passed
            else " **Ours and the reference disagreed in a check.**"
        ),
    ]
    return "\n".join(lines) + "\n"


def speed_floor(rows: Rows) -> str:
    """The beam-search floor (``benchmarks/beam_floor.py``): its parts, the floor, ours, and
    the median ratio of ours to the floor over the rounds, per task, eager and compiled."""
    rows = sorted(_kind(rows, "floor"), key=lambda r: -r["beam_size"])
    columns = [(r, mode) for r in rows for mode in ("eager", "compiled")
               if r.get(f"floor_{mode}") is not None]  # fmt: skip
    names = [f"{'greedy' if r['beam_size'] == 1 else 'beam k=' + str(r['beam_size'])}, {mode}"
             for r, mode in columns]  # fmt: skip
    lines = ["| | " + " | ".join(names) + " |", "| --- |" + " --- |" * len(columns)]

    def line(label: str, cell: Callable[[dict[str, Any], str], str]) -> None:
        lines.append(f"| {label} | " + " | ".join(cell(r, m) for r, m in columns) + " |")

    def parts(r: dict[str, Any], mode: str) -> str:
        p = r["parts"]
        if mode == "compiled":
            return f"fused: {p['fused']:.2g} s"
        return f"{p['add']:.2g} + {p['tanh']:.2g} + {p['projection']:.2g} s"

    def ratio(r: dict[str, Any], mode: str) -> str:
        ratios = r.get(f"ratios_{mode}")
        if not ratios:
            return "–"
        return (f"**{statistics.median(ratios):.2f}×** (rounds {min(ratios):.2f}-"
                f"{max(ratios):.2f}×)")  # fmt: skip

    line("dense layers", lambda r, m: f"{r['parts']['dense']:.3g} s ({r['gflop']:.0f} GFLOP)"
         if m == "eager" else "")  # fmt: skip
    line("score: add + tanh + projection alone", parts)
    line(
        "score, the three passes in sequence",
        lambda r, m: f"{r['parts']['sequence']:.3g} s" if m == "eager" else "",
    )
    line("word choice", lambda r, m: f"{r['parts']['choice']:.2g} s" if m == "eager" else "")
    line("**floor** (each word's parts in turn)", lambda r, m: f"**{r[f'floor_{m}']:.3g} s**")
    line("ours", lambda r, m: _seconds(r.get(f"ours_{m}")))
    line("ours / floor, median of the rounds", ratio)
    line("reference (`bench.py`)", lambda r, m: _seconds(r.get("reference_seconds")))

    def allowed(r: dict[str, Any], mode: str) -> str:
        reference = r.get("reference_seconds")
        return f"{reference / r[f'floor_{mode}']:.1f}×" if reference else "–"

    line("most speed-up the floor allows", allowed)
    lines += ["", _provenance(rows, "floor") + f" {rows[0]['images']} images, "
              f"{rows[0]['max_length']} words, COCO size; each round times the floor, then "
              f"ours right after it."]  # fmt: skip
    return "\n".join(lines) + "\n"


def speed_profile(rows: Rows) -> str:
    """Where a training step's time goes (``benchmarks/profile_epoch.py``): the median
    milliseconds of each phase per step, one column per measured configuration."""
    rows = _kind(rows, "profile")

    def label(r: dict[str, Any]) -> str:
        words = [Path(r["config"]).stem, *r["overrides"]]
        words.append("word loop" if r["step_loop"] else "all words at once")
        words.append("channels-last" if r["channels_last"] else "NCHW")
        return ", ".join(words)

    lines = ["| phase (ms per step) | " + " | ".join(label(r) for r in rows) + " |",
             "| --- |" + " --- |" * len(rows)]  # fmt: skip
    phases = list(dict.fromkeys(name for r in rows for name in r["phases"]))
    for name in phases:
        cells = [f"{r['phases'][name] * 1e3:.0f}" if name in r["phases"] else "–" for r in rows]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    lines.append("| **step** | " + " | ".join(f"**{r['step_seconds'] * 1e3:.0f}**" for r in rows)
                 + " |")  # fmt: skip
    lines.append("| validation (decode + score), per epoch | " + " | ".join(
        f"{(r['validation_decode_seconds'] + r['validation_score_seconds']):.1f} s" for r in rows)
        + " |")  # fmt: skip
    lines.append("| **epoch** | " + " | ".join(f"**{r['epoch_seconds']:.1f} s**" for r in rows)
                 + " |")  # fmt: skip
    lines += [
        "",
        _provenance(rows, "profile") + f" Medians of each run's timed steps; "
        f"{rows[0]['steps_per_epoch']} steps per epoch, batch {rows[0]['batch_size']}.",
    ]
    return "\n".join(lines) + "\n"


# Xu et al. (2015), Table 1, Flickr8k: BLEU-1..4 (without the brevity penalty) and METEOR.
PAPER_FLICKR8K = {
    "soft": (67.0, 44.8, 29.9, 19.5, 18.93),
    "hard": (67.0, 45.7, 31.4, 21.3, 20.30),
}
FLICKR8K_MODELS = ("nn", "none", "soft", "hard", "hard_exact", "scst")
FLICKR8K_SCORES = ("Bleu_1", "Bleu_2", "Bleu_3", "Bleu_4", "METEOR", "Bleu_4_no_bp",
                   "ROUGE_L", "CIDEr")  # fmt: skip


def _device(row: dict[str, Any]) -> str:
    return "GPU" if "NVIDIA" in row["device"] else "CPU"


def _flickr8k_lines(rows: Rows, nn_cider: float | None) -> list[str]:
    """One line per model, beam size and device: the mean of the seeds in percent, each
    seed's CIDEr-D, and how many seeds score above the nearest neighbour's CIDEr-D."""
    groups: dict[tuple, Rows] = {}
    for row in rows:
        groups.setdefault((row["model"], row["beam_size"], _device(row)), []).append(row)
    order = {m: i for i, m in enumerate(FLICKR8K_MODELS)}
    lines = []
    for (model, beam, device), group in sorted(
        groups.items(), key=lambda g: (order[g[0][0]], g[0][2], g[0][1] or 0)
    ):
        group = sorted(group, key=lambda r: r["seed"] or 0)
        means = [_mean([r.get(k) for r in group]) for k in FLICKR8K_SCORES]
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
    found = [r["CIDEr"] for r in rows if r["model"] == "nn" and r["variant"] == "recipe"]
    return found[0] if found else None


FLICKR8K_HEAD = ("| model | beam | trained on | seeds | BLEU-1 | BLEU-2 | BLEU-3 | BLEU-4 | "
                 "METEOR | BLEU-4 without BP | ROUGE-L | CIDEr-D | CIDEr-D of each seed | "
                 "seeds above nn in CIDEr-D |")  # fmt: skip


def _flickr8k_note(rows: Rows) -> str:
    devices = sorted({f"{r['device']} ({r['threads']} threads)" for r in rows})
    commits = sorted({_short(r["commit"]) for r in rows})
    precisions = sorted({r["precision"] for r in rows})
    return (f"Test split, 1,000 images; scores in percent, the mean of the seeds. "
            f"Trained on {'; '.join(devices)}, precision {', '.join(precisions)}; "
            f"commits {', '.join(commits)}; `results/flickr8k.json` holds every row with its "
            f"command.")  # fmt: skip


def flickr8k(rows: Rows) -> str:
    """Show, Attend and Tell's Flickr8k rows beside ours (``benchmarks/flickr8k.py``): the
    recipe's models at beam 3 and the nearest neighbour, the mean of the seeds."""
    head = [FLICKR8K_HEAD, "|" + " --- |" * 14]
    for name, (b1, b2, b3, b4, meteor) in PAPER_FLICKR8K.items():
        bleu = " | ".join(f"{b:.1f}" for b in (b1, b2, b3, b4))
        head.append(f"| **paper: {name}** (Xu et al. 2015; BLEU without BP) | | | | {bleu} | "
                    f"{meteor:.2f} | {b4:.1f} | | | | |")  # fmt: skip
    recipe = [r for r in rows if r["variant"] == "recipe" and r["beam_size"] in (None, 3)]
    lines = _flickr8k_lines(recipe, _nn_cider(rows))
    return "\n".join([*head, *lines, "", _flickr8k_note(recipe)]) + "\n"


def flickr8k_beams(rows: Rows) -> str:
    """The soft model of the Flickr8k recipe decoded with 1, 3 and 5 beams."""
    head = [FLICKR8K_HEAD, "|" + " --- |" * 14]
    soft = [r for r in rows if r["variant"] == "recipe" and r["model"] == "soft"]
    lines = _flickr8k_lines(soft, _nn_cider(rows))
    return "\n".join([*head, *lines, "", _flickr8k_note(soft)]) + "\n"


def flickr8k_brevity(rows: Rows) -> str:
    """What BLEU without the brevity penalty rewards: the soft model's beam-3 test captions
    as decoded and cut to their first N words (variants ``cutN``), scored both ways."""
    lines = ["| captions | runs | words per caption | length ratio | brevity penalty | BLEU-1 "
             "| BLEU-1 without BP | BLEU-4 | BLEU-4 without BP | METEOR | CIDEr-D |",
             "|" + " --- |" * 11]  # fmt: skip
    groups: dict[str, Rows] = {}
    for row in rows:
        cut = row["variant"].startswith("cut")
        if row["model"] == "soft" and row["beam_size"] == 3 and (cut or row["variant"] == "recipe"):
            groups.setdefault(row["variant"], []).append(row)
    for variant in sorted(groups, key=lambda v: -1000 if v == "recipe" else -int(v[3:])):
        group = groups[variant]
        name = "as decoded" if variant == "recipe" else f"first {variant[3:]} words"
        cells = [f"{_mean([r['mean_words'] for r in group]):.1f}",
                 *(f"{_mean([r[k] for r in group]):.3f}"
                   for k in ("Bleu_length_ratio", "Bleu_brevity_penalty")),
                 *(f"{100 * _mean([r[k] for r in group]):.2f}"
                   for k in ("Bleu_1", "Bleu_1_no_bp", "Bleu_4", "Bleu_4_no_bp", "METEOR",
                             "CIDEr"))]  # fmt: skip
        lines.append(f"| {name} | {len(group)} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def flickr8k_levers(rows: Rows) -> str:
    """The Flickr8k soft model against the same model with one setting changed (rows of a
    ``--variant``), beam 3, the seeds' mean in percent."""
    lines = ["| variant | settings | trained on | seeds | BLEU-4 | METEOR | CIDEr-D | best "
             "validation score (selected on) | CIDEr-D of each seed |",
             "|" + " --- |" * 9]  # fmt: skip
    groups: dict[tuple, Rows] = {}
    for row in rows:
        trained = not row["variant"].startswith("cut")  # cut captions are only scored
        if row["model"] == "soft" and row["beam_size"] == 3 and trained:
            groups.setdefault((row["variant"], _device(row)), []).append(row)
    for (variant, device), group in sorted(
        groups.items(), key=lambda g: (g[0][0] != "recipe", g[0])
    ):
        group = sorted(group, key=lambda r: r["seed"])
        settings = [o for o in group[0]["overrides"] if not o.startswith(_PLUMBING)]
        scores = [_mean([r[k] for r in group]) for k in ("Bleu_4", "METEOR", "CIDEr")]
        val = _mean([r["best_val"] for r in group])
        each = ", ".join(f"{100 * r['CIDEr']:.1f} ({r['seed']})" for r in group)
        lines.append(f"| {variant} | {', '.join(f'`{o}`' for o in settings) or 'the recipe'} | "
                     f"{device} | {len(group)} | " + " | ".join(f"{100 * v:.2f}" for v in scores)
                     + f" | {100 * val:.2f} ({group[0]['select_metric']}) | {each} |")  # fmt: skip
    return "\n".join(lines) + "\n"


def flickr8k_attention(rows: Rows) -> str:
    """What the training loss reported of the attention maps at the first and last epoch of
    each Flickr8k run that recorded it (beam-3 rows of the recipe): the doubly stochastic
    penalty and hard attention's entropy, both per caption."""
    lines = ["| model | seed | trained on | penalty: first epoch | last epoch "
             "| entropy (nats): first epoch | last epoch | nll per word: first epoch "
             "| last epoch |", "|" + " --- |" * 9]  # fmt: skip
    kept = [r for r in rows if r.get("training") and r["variant"] == "recipe"
            and r["beam_size"] == 3]  # fmt: skip
    for row in sorted(kept, key=lambda r: (r["model"], _device(r), r["seed"])):
        first, last = row["training"]["first_epoch"], row["training"]["last_epoch"]
        cells = [row["model"], str(row["seed"]), _device(row)]
        for key in ("penalty", "entropy", "nll_per_token"):
            cells += [f"{e[key]:.2f}" if key in e else "–" for e in (first, last)]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def flickr8k_time(rows: Rows) -> str:
    """The Flickr8k recipe's seconds per stage, per run, with the device and whether the run
    had the machine to itself."""
    lines = ["| model | seed | trained on | threads | timed alone | prepare s | extract s | "
             "train s | evaluate s | whole recipe s |", "|" + " --- |" * 10]  # fmt: skip
    order = {m: n for n, m in enumerate(FLICKR8K_MODELS)}
    rows = sorted(rows, key=lambda r: (order[r["model"]], _device(r), r["seed"] or 0))
    for row in rows:
        if row["variant"] != "recipe" or row["beam_size"] not in (None, 3):
            continue
        t = row["seconds"]
        train = (t.get("first_stage") or 0) + t["train"]
        lines.append(f"| {row['model']} | {row['seed'] if row['seed'] is not None else '–'} | "
                     f"{row['device']} | {row['threads']} | "
                     f"{'yes' if row['timed_alone'] else 'no'} "
                     f"| {t['prepare']:.0f} | {t['extract']:.0f} | {train:.0f} | "
                     f"{t.get('evaluate', 0):.0f} | {t.get('recipe', 0):.0f} |")  # fmt: skip
    return "\n".join(lines) + "\n"


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
    return (f"**{model}**, the model's pointing game minus the baseline's, seed by seed: "
            f"{'; '.join(gaps)}; the model's own spread over the seeds (standard deviation) "
            f"{spread:.3f}: it {'beats' if met else 'does not beat'} both on every seed by more "
            f"than that. Its mass in the boxes minus its saliency map's: "
            + ", ".join(f"{d:+.3f}" for d in masses) + ".")  # fmt: skip


def grounding(rows: Rows) -> str:
    """Attention grounding against COCO's boxes (``tools/grounding_study.py``): per model and
    seed the words scored, the pointing game and the mass in the boxes of the model's maps
    and of the baselines, the maps' median peak and mean entropy, then the verdict on the
    target (the model beats the centre prior and its saliency map on every seed)."""
    head = " | ".join(f"pointing {m}" for m in GROUNDING_MAPS) + " | " + " | ".join(
        f"mass {m}" for m in GROUNDING_MAPS)  # fmt: skip
    lines = [f"| model | seed | words | {head} | median peak | mean entropy | other maps "
             "(pointing) | CIDEr-D |", "|" + " --- |" * 15]  # fmt: skip
    verdicts = []
    for (model, variant), group in _grounding_groups(rows).items():
        name = model if variant == "recipe" else f"{model} ({variant})"
        for row in group:
            o = row["grounding"]["overall"]
            others = ", ".join(f"{k} {o[k]['pointing']:.3f}" for k in o
                               if k not in ("words", *GROUNDING_MAPS))  # fmt: skip
            cells = [f"{o[m][k]:.3f}" for k in ("pointing", "mass") for m in GROUNDING_MAPS]
            peak, entropy = o["model"]["median_peak"], o["model"]["mean_entropy"]
            cider = _score(row["scores"].get("CIDEr"))
            cells += [f"{peak:.4f}", f"{entropy:.3f}", others or "–", cider]
            lines.append(f"| {name} | {row['seed']} | {o['words']} | " + " | ".join(cells) + " |")
        verdicts.append(_grounding_verdict(name, group))
    first = rows[0]
    grid, even = first["grounding"]["grid"], first["grounding"]["overall"]["even"]
    lines += ["", *verdicts, "",
              f"{len(rows)} rows of `results/grounding.json`, commit "
              f"{', '.join(sorted({_short(r['commit']) for r in rows}))}; {first['images']} "
              f"images, a {grid[0]} x {grid[1]} grid (an even map's peak is "
              f"{even['median_peak']:.3f}, its entropy {even['mean_entropy']:.3f} nats); "
              f"centre prior sd "
              f"{first['grounding']['centre_sigma']} of the image's sides; decoded "
              f"{_decoding(first)} on {_hosts([r['machine'] for r in rows])}, "
              f"{first['machine']['threads']} thread(s), "
              f"{'timed alone' if first['timed_alone'] else 'beside other work'}. "
              f"The first row's command: `{first['command']}`."]  # fmt: skip
    return "\n".join(lines) + "\n"


def _decoding(row: dict[str, Any]) -> str:
    decoding = row["decoding"]
    beams = "greedy" if decoding["strategy"] == "greedy" else f"beam {decoding['beam_size']}"
    return f"{beams}, {decoding['precision']}"


def _pooled(groups: list[dict[str, Any]]) -> dict[str, Any]:
    """One group's scores over seeds: words summed, each map's pointing weighted by words."""
    words = sum(g["words"] for g in groups)
    pooled = {"words": words, "seeds": len(groups)}
    for m in GROUNDING_MAPS:
        pooled[m] = sum(g[m]["pointing"] * g["words"] for g in groups) / words
    return pooled


def _grounding_breakdown(rows: Rows, key: str, label: str) -> str:
    """Per category (``key`` = categories) or word (words), pooled over each model's seeds."""
    lines = [f"| model | {label} | seeds | words | " + " | ".join(f"pointing {m}"
             for m in GROUNDING_MAPS) + " | model minus the best baseline |",
             "|" + " --- |" * (5 + len(GROUNDING_MAPS))]  # fmt: skip
    for (model, variant), group in _grounding_groups(rows).items():
        name = model if variant == "recipe" else f"{model} ({variant})"
        found: dict[str, list[dict[str, Any]]] = {}
        for row in group:
            for item, scores in row["grounding"][key].items():
                found.setdefault(item, []).append(scores)
        pooled = {item: _pooled(g) for item, g in found.items()}
        for item, p in sorted(pooled.items(), key=lambda kv: (-kv[1]["words"], kv[0])):
            gap = p["model"] - max(p[m] for m in GROUNDING_MAPS if m != "model")
            lines.append(f"| {name} | {item} | {p['seeds']} | {p['words']} | "
                         + " | ".join(f"{p[m]:.2f}" for m in GROUNDING_MAPS)
                         + f" | {gap:+.2f} |")  # fmt: skip
    return "\n".join(lines) + "\n"


def grounding_categories(rows: Rows) -> str:
    """:func:`grounding` per COCO category, pooled over the seeds (weighted by words)."""
    return _grounding_breakdown(rows, "categories", "category")


def grounding_words(rows: Rows) -> str:
    """:func:`grounding` per generated word, pooled over the seeds, and the words that name a
    category their photo lacks."""
    table = _grounding_breakdown(rows, "words", "word")
    absent: dict[str, int] = {}
    for row in rows:
        for word, count in row["grounding"]["absent"].items():
            absent[word] = absent.get(word, 0) + count
    listed = ", ".join(f"{w} {n}" for w, n in sorted(absent.items(), key=lambda kv: -kv[1]))
    note = "Words that name a category their photo lacks (not scored, all rows)"
    return f"{table}\n{note}: {listed}.\n"


TABLES: dict[str, Callable[[Rows], str]] = {
    "photos": photos,
    "photo_levers": photo_levers,
    "photo_budget_timed": photo_budget_timed,
    "serve_latency": serve_latency,
    "attention_family": attention_family,
    "attention_family_sweep": attention_family_sweep,
    "multi_head": multi_head,
    "hard_estimators": hard_estimators,
    "hard_estimators_paper_wiring": hard_estimators_paper_wiring,
    "hard_recipe": hard_recipe,
    "hard_authors": hard_authors,
    "shapes_seeds": shapes_seeds,
    "shapes_recipe": shapes_recipe,
    "shapes_targets": shapes_targets,
    "colour_trace": colour_trace,
    "photo_sweep": photo_sweep,
    "photo_family": photo_family,
    "photo_budget": photo_budget,
    "estimator_variance": estimator_variance,
    "scst_shapes": scst_shapes,
    "speed_quality": speed_quality,
    "speed_bench": speed_bench,
    "speed_floor": speed_floor,
    "speed_profile": speed_profile,
    "flickr8k": flickr8k,
    "flickr8k_beams": flickr8k_beams,
    "flickr8k_levers": flickr8k_levers,
    "flickr8k_attention": flickr8k_attention,
    "flickr8k_brevity": flickr8k_brevity,
    "flickr8k_time": flickr8k_time,
    "grounding": grounding,
    "grounding_categories": grounding_categories,
    "grounding_words": grounding_words,
}
# tables whose rows are in another table's file
SOURCES = {
    "photo_levers": "photos",
    "photo_budget_timed": "photos",
    "attention_family_sweep": "attention_family",
    "multi_head": "attention_family",
    "photo_family": "photo_sweep",
    "shapes_recipe": "shapes_seeds",
    "shapes_targets": "shapes_seeds",
    "hard_recipe": "attention_family",
    "speed_quality": "speed",
    "speed_bench": "speed",
    "speed_floor": "speed",
    "speed_profile": "speed",
    "flickr8k_beams": "flickr8k",
    "flickr8k_levers": "flickr8k",
    "flickr8k_attention": "flickr8k",
    "flickr8k_brevity": "flickr8k",
    "flickr8k_time": "flickr8k",
    "grounding_categories": "grounding",
    "grounding_words": "grounding",
}


def load_rows(name: str, results: Path = ROOT / "results") -> Rows:
    """The committed rows of ``results/<name>.json``."""
    return json.loads((results / f"{name}.json").read_text(encoding="utf-8"))


def render(text: str, results: Path = ROOT / "results") -> str:
    """``text`` with every generated table replaced by what its rows give."""

    def replace(match: re.Match) -> str:
        name = match.group(2)
        if name not in TABLES:
            raise SystemExit(f"unknown table {name!r}; known: {', '.join(TABLES)}")
        source = SOURCES.get(name, name)
        if not (results / f"{source}.json").is_file():  # a study not yet run: say so
            return match.group(1) + f"(results/{source}.json is not there yet.)\n" + match.group(4)
        return match.group(1) + TABLES[name](load_rows(source, results)) + match.group(4)

    return _BLOCK.sub(replace, text)


def documents(root: Path = ROOT) -> list[Path]:
    """The Markdown files that may hold generated tables."""
    return sorted(p for pattern in DOCUMENTS for p in root.glob(pattern))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--check", action="store_true", help="change nothing; exit 1 if a table is out of date"
    )
    args = parser.parse_args(argv)
    stale = []
    for path in documents():
        text = path.read_text(encoding="utf-8")
        new = render(text)
        if new != text:
            stale.append(path)
            if not args.check:
                path.write_text(new, encoding="utf-8")
    for path in stale:
        verb = "out of date" if args.check else "rewritten"
        print(f"{path.relative_to(ROOT)}: {verb}")
    return 1 if args.check and stale else 0


if __name__ == "__main__":
    sys.exit(main())
