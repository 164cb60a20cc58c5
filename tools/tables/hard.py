"""Hard attention's tables: the estimators compared on shapes (``results/hard_estimators*.json``,
``results/hard_authors.json``, rows of ``tools/compare_estimators.py``), their variance on one
batch (``results/estimator_variance.json``), and ``configs/shapes_hard.yaml`` seed by seed."""

from __future__ import annotations

from typing import Any

from tools.tables.common import Rows, commands, portable, provenance, score, spread

# configs/shapes_hard.yaml's learning rate (tests/test_tables.py holds the two equal)
HARD_LR = 0.004

# the test scores of tools/compare_estimators.py's rows and their column names
ESTIMATOR_COLUMNS = {
    "exact_match": "exact",
    "Bleu_4": "BLEU-4",
    "CIDEr": "CIDEr-D",
    "pointing_game/color": "pointing colour",
    "pointing_game/size": "pointing size",
    "pointing_game/category": "pointing shape",
}


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
        f"{len(rows)} rows of `results/estimator_variance.json`, seed {settings['seed']}; "
        f"{settings['batch']} captions, {settings['repeats']} estimates each, K = "
        f"{settings['samples']}: {provenance(rows)}. "
        f"|∇log p(y | a)|² = {ref['marginal_gradient_norm'] ** 2:.3g}, "
        f"|∇E_q[r]|² = {ref['paper_gradient_norm'] ** 2:.3g} (r = log p(y | s, a)), "
        f"cosine {ref['cosine_marginal_paper']:.3f}; REINFORCE's moving-average baseline "
        f"b = {ref['baseline']:.3g} ({ref['baseline_source']}). The checkpoint: "
        f"`{portable(first['trained_by'])}`; the rows: `{portable(first['command'])}`.",
    ]
    return "\n".join(lines) + "\n"


def _setting(value: Any) -> str:
    return "–" if value is None else f"{value:g}"


def hard_estimators(rows: Rows, source: str = "hard_estimators") -> str:
    """Hard attention trained by each estimator (``tools/compare_estimators.py``): one line
    per (estimator, decode mode) with the settings that differ between estimators, the seeds,
    the test scores (mean ± sd over seeds) and the training time."""
    header = (
        "| estimator | decode | seeds | soft minibatches | λ_r | entropy | K | "
        + " | ".join(ESTIMATOR_COLUMNS.values())
        + " | train time |"
    )
    lines = [header, "|" + " --- |" * (len(ESTIMATOR_COLUMNS) + 8)]
    groups: dict[tuple[str, str], Rows] = {}
    for row in rows:
        groups.setdefault((row["estimator"], row["decode"]), []).append(row)
    for (estimator, mode), group in groups.items():
        first = group[0]
        share = f"{first['soft_share']:g}"
        if first.get("soft_share_per") == "sample":
            share += " (per caption)"
        settings = [
            share,
            *(
                _setting(first[key])
                for key in ("reinforce_weight", "entropy_weight", "hard_samples")
            ),
        ]
        cells = [spread([r.get(key) for r in group]) for key in ESTIMATOR_COLUMNS]
        seeds = ",".join(str(r["seed"]) for r in group)
        # rows trained beside other work (--machine-busy) are not timed
        timed = [r["train_seconds"] / 60 for r in group if r.get("timed_alone", True)]
        minutes = f"{spread(timed, digits=1)} min" if timed else "–"
        lines.append(
            f"| {estimator} | {mode} | {seeds} | "
            + " | ".join(settings + cells)
            + f" | {minutes} |"
        )
    written = commands(rows)
    lines += [
        "",
        f"{len(rows)} rows of `results/{source}.json`: {provenance(rows)}. Test "
        f"split, METEOR skipped; ± the standard deviation over the seeds; train time only "
        f"from runs with nothing else on the machine."
        + (f" Written by {written}." if written else ""),
    ]
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
            score(t[k]) for k in ("pointing_color", "pointing_size", "pointing_shape")
        )
        cells = [
            str(r["seed"]),
            score(t["exact"]),
            score(t["exact_3_objects"]),
            score(t["Bleu_4"]),
            f"{t['CIDEr']:.2f}",
            pointing,
        ]
        lines.append("| " + " | ".join(cells) + " |")
    lines += [
        "",
        f"{len(group)} rows of `results/attention_family.json` (member hard at lr {HARD_LR:g}, "
        f"the config's): {provenance(group)}. Test split, expectation decoding.",
    ]
    return "\n".join(lines) + "\n"
