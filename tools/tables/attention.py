"""The attention family on shapes (``results/attention_family.json``, rows of
``tools/compare_attention.py``): each member at its chosen rate, one head against several,
and the learning-rate sweep that chose the rates."""

from __future__ import annotations

import statistics
from typing import Any

from tools.tables.common import (
    Rows,
    commands,
    commits,
    header,
    hosts,
    line,
    mean,
    precisions,
    provenance,
    score,
    spread,
    threads,
    timed,
    torch_versions,
)


def _chosen_lr(rows: Rows) -> float | None:
    """The learning rate of the best validation score among one member's sweep rows (the
    lower rate on a tie), as tools/compare_attention.py chooses it; None if none scored."""
    scored = [r for r in rows if r.get("phase") == "sweep" and "val" in r]
    if not scored:
        return None
    return max(scored, key=lambda r: (r["val_select"], -r["lr"]))["lr"]


def _plain(rows: Rows) -> Rows:
    """The rows trained with plain blocks (the family's first study): rows of other blocks
    are :func:`attention_family_blocks`'s."""
    return [r for r in rows if r.get("blocks", "plain") == "plain"]


def _members(rows: Rows) -> dict[str, Rows]:
    """The rows of each member, in the order the file holds them."""
    members: dict[str, Rows] = {}
    for row in rows:
        members.setdefault(row["member"], []).append(row)
    return members


def _test(row: dict[str, Any], hard_context: str | None) -> dict[str, Any]:
    """A row's test scores, or those of one decoding mode of hard attention."""
    return row["test"] if hard_context is None else row["test_by_hard_context"][hard_context]


def attention_family(rows: Rows) -> str:
    """The attention family on shapes (``tools/compare_attention.py``): one line per member
    at its chosen learning rate, test exact match as mean ± sd over the seeds and each seed,
    and the means of the other test scores; hard attention gets a line per decoding mode."""
    rows = _plain(rows)
    head = [
        "member",
        "lr",
        "exact",
        "each seed",
        "exact, 3 objects",
        "pointing colour / size / shape",
        "pointing, local centre",
        "mass in box",
        "BLEU-4",
        "CIDEr-D",
        "parameters",
        "train time",
    ]
    lines = header(head)
    for member, group in _members(rows).items():
        lr = _chosen_lr(group)
        if lr is None:
            failed = sorted(f"{r['lr']:g}" for r in group if r.get("phase") == "sweep")
            cells = [member, "–", f"failed at every rate ({', '.join(failed)})"]
            lines.append(line(cells + ["–"] * (len(head) - 3)))
            continue
        seeds = sorted((r for r in group if r["lr"] == lr), key=lambda r: r["seed"])
        scored = [r for r in seeds if "test" in r]
        minutes = [r["train_seconds"] / 60 for r in scored if r.get("timed_alone", True)]
        hard = scored[0].get("test_by_hard_context")
        for mode in [None] if hard is None else list(hard):
            tests = [_test(r, mode) for r in scored]
            each = ", ".join(
                f"{_test(r, mode)['exact']:.3f} ({r['seed']})"
                if "test" in r
                else f"failed ({r['seed']})"
                for r in seeds
            )
            pointing = " / ".join(
                score(mean([t[k] for t in tests]))
                for k in ("pointing_color", "pointing_size", "pointing_shape")
            )
            cells = [
                member if mode is None else f"{member} ({mode})",
                f"{lr:g}",
                spread([t["exact"] for t in tests]),
                each,
                score(mean([t["exact_3_objects"] for t in tests])),
                pointing,
                *(
                    score(mean([t[k] for t in tests]))
                    for k in ("centre_pointing", "mass_in_box", "Bleu_4", "CIDEr")
                ),
                f"{scored[0]['parameters'] / 1e6:.2f}M",
                "–" if not minutes else f"{statistics.mean(minutes):.1f} min",
            ]
            lines.append(line(cells))
    lines.append("")
    lines.append(_family_note(rows))
    return "\n".join(lines) + "\n"


def _family_note(rows: Rows) -> str:
    """Where the attention family's rows come from: commits, machine, precision, threads,
    timing, commands."""
    note = (
        f"{len(rows)} rows of `results/attention_family.json`, commit {commits(rows)}; "
        f"{hosts(rows)}, torch {torch_versions(rows)}, {precisions(rows)}, {threads(rows)}, "
        f"{timed(rows)}. "
        f"The learning rate is each member's best on validation exact match in the sweep "
        f"below; test split, greedy decoding; seeds in brackets, ± the standard deviation "
        f"across seeds, the other scores the mean over the seeds; train time the mean of the "
        f"epochs' seconds"
    )
    busy = [r for r in rows if not r.get("timed_alone", True)]
    if busy:
        note += ", from runs with nothing else on the machine"
    return note + f". Written by {commands(rows)}."


def multi_head(rows: Rows) -> str:
    """One head against H = 2, 4, 8 seed by seed, each at its chosen rate of the family study
    (``tools/compare_attention.py``): test exact match and the pointing game by word type."""
    rows = _plain(rows)
    lines = [
        "| heads | lr | seed | exact | pointing colour / size / shape |",
        "| --- | --- | --- | --- | --- |",
    ]
    members = _members(rows)
    shown = []
    for heads, member in (
        (1, "soft"),
        (2, "multi-head-2"),
        (4, "multi-head-4"),
        (8, "multi-head-8"),
    ):
        group = members.get(member, [])
        lr = _chosen_lr(group)
        if lr is None:
            continue
        for r in sorted(
            (r for r in group if r["lr"] == lr and "test" in r), key=lambda r: r["seed"]
        ):
            t = r["test"]
            exact = f"**{t['exact']:.3f}**" if t["exact"] < 0.5 else f"{t['exact']:.3f}"
            pointing = " / ".join(
                score(t[k]) for k in ("pointing_color", "pointing_size", "pointing_shape")
            )
            lines.append(f"| {heads} | {lr:g} | {r['seed']} | {exact} | {pointing} |")
            shown.append(r)
    lines += [
        "",
        f"{len(shown)} rows of `results/attention_family.json`, the family study "
        f"below: {provenance(shown)}. Bold: stalled (below 0.5).",
    ]
    return "\n".join(lines) + "\n"


def attention_family_sweep(rows: Rows) -> str:
    """The attention family's learning-rate sweep: validation exact match of each member at
    each rate (the sweep's seed), the chosen rate in bold."""
    rows = _plain(rows)
    sweep = [r for r in rows if r.get("phase") == "sweep"]
    lrs = sorted({r["lr"] for r in sweep})
    lines = header(["member", *(f"lr {lr:g}" for lr in lrs)])
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
        lines.append(line(cells))
    seeds = ", ".join(str(s) for s in sorted({r["seed"] for r in sweep}))
    metrics = ", ".join(sorted({r["select_metric"] for r in sweep}))
    lines.append("")
    lines.append(
        f"Validation {metrics} at seed {seeds}, greedy decoding; a rate sets `train.lr` and "
        f"`train.encoder_lr` together; bold: the chosen rate; failed: the training stopped "
        f"(a non-finite loss or weights); –: not run. {len(sweep)} rows of "
        f"`results/attention_family.json`: {provenance(sweep)}."
    )
    return "\n".join(lines) + "\n"


STALL = 0.5  # test exact match below which a run has stalled


def attention_family_blocks(rows: Rows) -> str:
    """The family members re-run with another block of the small CNN (rows with a
    ``blocks`` other than plain), each at the rate its plain sweep chose, over more seeds: the
    stalls (test exact match below 0.5) counted, every seed shown."""
    rows = [r for r in rows if r.get("blocks", "plain") != "plain"]
    head = [
        "member",
        "blocks",
        "lr",
        "seeds",
        "stalled",
        "exact",
        "each seed",
        "pointing colour / size / shape",
        "CIDEr-D",
    ]
    lines = header(head)
    for member, group in _members(rows).items():
        group = sorted(group, key=lambda r: r["seed"])
        tests = [r["test"] for r in group if "test" in r]
        stalled = sum(1 for r in group if "test" not in r or r["test"]["exact"] < STALL)
        each = ", ".join(
            f"{r['test']['exact']:.3f} ({r['seed']})" if "test" in r else f"failed ({r['seed']})"
            for r in group
        )
        pointing = " / ".join(
            score(mean([t[k] for t in tests]))
            for k in ("pointing_color", "pointing_size", "pointing_shape")
        )
        lines.append(
            line(
                [
                    member,
                    group[0]["blocks"],
                    f"{group[0]['lr']:g}",
                    str(len(group)),
                    f"{stalled} of {len(group)}",
                    spread([t["exact"] for t in tests]),
                    each,
                    pointing,
                    score(mean([t["CIDEr"] for t in tests])),
                ]
            )
        )
    if len(lines) == 2:
        return "No rows of `results/attention_family.json` with other blocks yet.\n"
    return (
        "\n".join(
            [
                *lines,
                "",
                f"{len(rows)} rows of `results/attention_family.json`: "
                f"{provenance(rows)}. Test split, greedy decoding; stalled: test exact "
                f"match below {STALL}. Written by {commands(rows)}.",
            ]
        )
        + "\n"
    )
