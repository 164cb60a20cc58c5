"""Train the attention family on shapes and tabulate it on the test split: "Which attention?"

    python tools/compare_attention.py --out runs/compare [--only soft local ...] [--set ...]
    python tools/compare_attention.py --list

Every model is the shipped config with one change (``RUNS``): no attention, soft attention
with each score function (additive, additive_relu, dot, scaled_dot, general, cosine) and the
location score, hard attention (configs/shapes_hard.yaml), local attention, key-value
attention, multi-head attention (H = 4) and grid self-attention (N = 2). Each is evaluated
with greedy decoding; the hard model also with each hard_context mode. The table gives test
exact match, three-object exact match, pointing game by word type (and of local attention's
predicted centre), attention mass in the box, trainable parameters and training time. Writes
results.json and results.md into --out. A run folder that already holds last.pt (for example
one made with `captioning train --config ... --out runs/compare/soft`) is evaluated as it
is, not retrained.
"""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path

from captioning.checkpoint import load_checkpoint
from captioning.config import load_config
from captioning.evaluate import evaluate_checkpoint
from captioning.inference import load_model
from captioning.train import fit

ROOT = Path(__file__).resolve().parent.parent
SOFT, HARD = "configs/shapes_soft.yaml", "configs/shapes_hard.yaml"
RUNS = {
    "none": (SOFT, ["model.attention=none"]),
    "soft": (SOFT, []),  # the additive score, the paper's
    **{f"soft-{score}": (SOFT, [f"model.score={score}"])
       for score in ("additive_relu", "dot", "scaled_dot", "general", "cosine", "location")},
    "hard": (HARD, []),
    "local": (SOFT, ["model.attention=local"]),
    "key-value": (SOFT, ["model.values=projected", "model.value_dim=128"]),
    "multi-head": (SOFT, ["model.heads=4"]),
    "grid-self-attention": (SOFT, ["model.grid_layers=2"]),
}  # fmt: skip
# (label, key in metrics.json, where: None for the top level, else the sub-dict's name)
COLUMNS = [
    ("exact", "exact_match", None),
    ("exact, 3 objects", "3", "exact_match_by_objects"),
    ("pointing colour", "pointing_game/color", "grounding_by_word_type"),
    ("pointing size", "pointing_game/size", "grounding_by_word_type"),
    ("pointing shape", "pointing_game/category", "grounding_by_word_type"),
    ("pointing, local centre", "centre_pointing_game", None),
    ("mass in box", "attention_in_box", None),
    ("BLEU-4", "Bleu_4", None),
    ("CIDEr-D", "CIDEr", None),
]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="runs/compare")
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    parser.add_argument("--only", nargs="*", default=list(RUNS), choices=list(RUNS))
    parser.add_argument("--list", action="store_true", help="print the runs and their changes")
    args = parser.parse_args(argv)
    if args.list:
        for name, (config, overrides) in RUNS.items():
            print(f"{name:22s} {config} {' '.join(overrides)}")
        return
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
        model = load_model(run_dir / "last.pt")[0]
        parameters = sum(p.numel() for p in model.parameters() if p.requires_grad)
        modes = ["expectation", "argmax", "sample"] if name == "hard" else [None]
        for mode in modes:
            metrics = evaluate_checkpoint(run_dir / "best.pt", split="test", hard_context=mode,
                                          out_dir=run_dir / f"eval_{mode or 'greedy'}")  # fmt: skip
            label = name if mode is None else f"hard ({mode})"
            rows.append({"model": label, "change": " ".join(RUNS[name][1]), "parameters":
                         parameters, "train_seconds": seconds, **metrics})  # fmt: skip
    (out / "results.json").write_text(json.dumps(rows, indent=2))
    labels = [label for label, _, _ in COLUMNS]
    header = "| model | " + " | ".join(labels) + " | parameters | train time |"
    lines = [header, "|" + " --- |" * (len(COLUMNS) + 3)]
    for row in rows:
        values = [row.get(key) if where is None else (row.get(where) or {}).get(key)
                  for _, key, where in COLUMNS]  # fmt: skip
        cells = ["–" if v is None else f"{v:.3f}" for v in values]
        size, minutes = row["parameters"] / 1e6, row["train_seconds"] / 60
        lines.append(f"| {row['model']} | " + " | ".join(cells)
                     + f" | {size:.2f}M | {minutes:.1f} min |")  # fmt: skip
    (out / "results.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
