"""Self-critical training on the varied shapes captions (``results/scst_shapes.json``, rows
of ``tools/scst_study.py``)."""

from __future__ import annotations

from tools.tables.common import Rows, header, line, provenance, spread, torch_versions

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
    lines = header(
        [
            "model",
            "test CIDEr-D per seed",
            "mean",
            "× cross-entropy",
            "BLEU-4",
            "METEOR",
            "exact match",
            "mean length",
            "ends in a / and / of / the",
        ]
    )
    for variant, name in _SCST_NAMES.items():
        group = [by_seed[(variant, s)] for s in seeds if (variant, s) in by_seed]
        if not group:
            continue
        ratios = [
            r["CIDEr"] / by_seed[("xe", r["seed"])]["CIDEr"]
            for r in group
            if ("xe", r["seed"]) in by_seed
        ]
        cells = [
            name,
            " / ".join(f"{r['CIDEr']:.3f}" for r in group),
            spread([r["CIDEr"] for r in group]),
            spread(ratios),
            *(spread([r.get(k) for r in group]) for k in ("Bleu_4", "METEOR", "exact_match")),
            spread([r["mean_length"] for r in group], 2),
            spread([r["dangling"] for r in group]),
        ]
        lines.append(line(cells))
    first = rows[0]
    lines += [
        "",
        f"{len(rows)} rows of `results/scst_shapes.json`, seeds "
        f"{', '.join(str(s) for s in seeds)}: {provenance(rows)}; torch {torch_versions(rows)}. "
        f"Test split ({first['test_images']} images), beam {first['beam_size']}; per seed in "
        f"the order {' / '.join(str(s) for s in seeds)}; mean ± the standard deviation across "
        "seeds; × cross-entropy is the mean over seeds of the ratio to that seed's "
        "cross-entropy model. Made by `python -m tools.scst_study --data data/shapes_varied "
        "--out runs/scst_study`; each row holds its `captioning train` command.",
    ]
    return "\n".join(lines) + "\n"
