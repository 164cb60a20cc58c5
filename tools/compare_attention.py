"""Train no-attention, soft and hard models on shapes and tabulate them on the test split.

    python tools/compare_attention.py --out runs/compare [--set train.epochs=4 ...]

Each model is trained with its shipped config (configs/shapes_soft.yaml with
model.attention=none, configs/shapes_soft.yaml, configs/shapes_hard.yaml), then evaluated
with greedy decoding; the hard model also with each hard_context mode. Writes results.json
and results.md (a Markdown table) into --out. A run folder that already holds last.pt
(for example one made with `captioning train --config ... --out runs/compare/soft`) is
evaluated as it is, not retrained.
"""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path

from captioning.checkpoint import load_checkpoint
from captioning.config import load_config
from captioning.evaluate import evaluate_checkpoint
from captioning.train import fit

ROOT = Path(__file__).resolve().parent.parent
RUNS = {
    "none": ("configs/shapes_soft.yaml", ["model.attention=none"]),
    "soft": ("configs/shapes_soft.yaml", []),
    "hard": ("configs/shapes_hard.yaml", []),
}
COLUMNS = ["exact_match", "Bleu_1", "Bleu_2", "Bleu_3", "Bleu_4", "METEOR", "ROUGE_L", "CIDEr",
           "pointing_game"]  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="runs/compare")
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    parser.add_argument("--only", nargs="*", default=list(RUNS), choices=list(RUNS))
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    out = Path(args.out)
    rows = []
    for name in args.only:
        config, overrides = RUNS[name]
        run_dir = out / name
        if not (run_dir / "last.pt").exists():
            fit(load_config(ROOT / config, overrides + args.overrides), out_dir=run_dir)
        # training time: the epochs themselves (training and validation), from the history
        seconds = sum(epoch["seconds"] for epoch in load_checkpoint(run_dir / "last.pt")["history"])
        modes = ["expectation", "argmax", "sample"] if name == "hard" else [None]
        for mode in modes:
            metrics = evaluate_checkpoint(run_dir / "best.pt", split="test", hard_context=mode,
                                          out_dir=run_dir / f"eval_{mode or 'greedy'}")  # fmt: skip
            label = name if mode is None else f"hard ({mode})"
            rows.append({"model": label, "train_seconds": seconds, **metrics})
    (out / "results.json").write_text(json.dumps(rows, indent=2))
    header = "| model | " + " | ".join(COLUMNS) + " | train time |"
    lines = [header, "|" + " --- |" * (len(COLUMNS) + 2)]
    for row in rows:
        cells = ["–" if row.get(c) is None else f"{row[c]:.3f}" for c in COLUMNS]
        lines.append(f"| {row['model']} | " + " | ".join(cells)
                     + f" | {row['train_seconds'] / 60:.1f} min |")  # fmt: skip
    (out / "results.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
