"""Train hard attention with each gradient estimator and several seeds; tabulate the test split.

    python tools/compare_estimators.py --config configs/shapes_hard.yaml --out runs/estimators \
        [--estimators reinforce exact ...] [--seeds 0 1 2] [--set train.epochs=6 ...]

Each (estimator, seed) trains ``--config`` with ``train.hard_estimator`` and ``train.seed``
set (plus ``--set`` overrides) into ``OUT/<estimator>/seed<k>``, unless that folder already
holds a finished run. Its ``best.pt`` is then decoded on the test split with every decode mode
(``marginal`` too, without the context in the LSTM) and scored without METEOR: exact match,
BLEU-4, CIDEr-D and the pointing game by word type. Writes ``results.json`` (every run) and
``results.md`` (mean ± standard deviation over the seeds, and the wall time of training).
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
from pathlib import Path

from captioning.checkpoint import load_checkpoint
from captioning.config import load_config
from captioning.evaluate import evaluate_checkpoint
from captioning.hard_attention import ESTIMATORS
from captioning.train import fit

COLUMNS = {
    "exact_match": "exact",
    "Bleu_4": "BLEU-4",
    "CIDEr": "CIDEr-D",
    "pointing_game/color": "pointing colour",
    "pointing_game/size": "pointing size",
    "pointing_game/category": "pointing shape",
}


def train_and_evaluate(config: str, estimator: str, seed: int, overrides: list[str], out: Path):
    run_dir = out / estimator / f"seed{seed}"
    cfg = load_config(config, [*overrides, f"train.hard_estimator={estimator}",
                               f"train.seed={seed}", "train.quiet=true"])  # fmt: skip
    done = (run_dir / "last.pt").exists() and (
        load_checkpoint(run_dir / "last.pt")["epoch"] >= cfg.train.epochs
    )
    if not done:
        resume = str(run_dir / "last.pt") if (run_dir / "last.pt").exists() else None
        fit(cfg, out_dir=run_dir, resume=resume)
    history = load_checkpoint(run_dir / "last.pt")["history"]
    modes = ["expectation", "argmax", "sample"]
    if not cfg.model.context_to_lstm:
        modes.append("marginal")
    rows = []
    for mode in modes:
        metrics = evaluate_checkpoint(run_dir / "best.pt", split="test", hard_context=mode,
                                      meteor=False, progress=False)  # fmt: skip
        flat = {**metrics, **{f"pointing_game/{k.split('/')[-1]}": v
                              for k, v in metrics.get("grounding_by_word_type", {}).items()
                              if k.startswith("pointing_game/")}}  # fmt: skip
        rows.append({
            "estimator": estimator, "seed": seed, "decode": mode,
            "train_seconds": sum(epoch["seconds"] for epoch in history),
            "epochs": len(history),
            **{key: flat.get(key) for key in COLUMNS},
        })  # fmt: skip
        logging.info("%s seed %d %s: %s", estimator, seed, mode, json.dumps(rows[-1]))
    return rows


def summary(rows: list[dict]) -> str:
    def cell(values):
        values = [v for v in values if v is not None]
        if not values:
            return "–"
        spread = statistics.stdev(values) if len(values) > 1 else 0.0
        return f"{statistics.mean(values):.3f} ± {spread:.3f}"

    header = "| estimator | decode | seeds | " + " | ".join(COLUMNS.values()) + " | train time |"
    lines = [header, "|" + " --- |" * (len(COLUMNS) + 4)]
    groups: dict[tuple[str, str], list[dict]] = {}
    for row in rows:
        groups.setdefault((row["estimator"], row["decode"]), []).append(row)
    for (estimator, mode), group in groups.items():
        minutes = [r["train_seconds"] / 60 for r in group]
        spread = statistics.stdev(minutes) if len(minutes) > 1 else 0.0
        cells = [cell([r[key] for r in group]) for key in COLUMNS]
        seeds = ",".join(str(r["seed"]) for r in group)
        lines.append(f"| {estimator} | {mode} | {seeds} | " + " | ".join(cells)
                     + f" | {statistics.mean(minutes):.1f} ± {spread:.1f} min |")  # fmt: skip
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/shapes_hard.yaml")
    parser.add_argument("--out", default="runs/estimators")
    parser.add_argument("--estimators", nargs="*", default=list(ESTIMATORS), choices=ESTIMATORS)
    parser.add_argument("--seeds", nargs="*", type=int, default=[0, 1, 2])
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    out = Path(args.out)
    rows = []
    for seed in args.seeds:
        for estimator in args.estimators:
            rows += train_and_evaluate(args.config, estimator, seed, args.overrides, out)
            (out / "results.json").write_text(json.dumps(rows, indent=2))
            (out / "results.md").write_text(summary(rows) + "\n")
    print(summary(rows))


if __name__ == "__main__":
    main()
