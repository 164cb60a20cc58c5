"""Mean caption length and the share of captions that end in a function word ("a", "and",
"of", "the": the known failure of self-critical training, which learns that a dangling word
costs CIDEr-D little) for ``captioning evaluate`` output folders.

    python tools/caption_endings.py runs/eval_xe runs/eval_scst_greedy ...

Prints one Markdown row per folder: its metrics.json's CIDEr-D, BLEU-4, METEOR and exact
match beside the two caption statistics of its predictions.json.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

DANGLING = ("a", "and", "of", "the")


def caption_statistics(captions: list[str]) -> tuple[float, float]:
    """Mean length in words, and the share of captions whose last word is in DANGLING."""
    words = [c.split() for c in captions]
    mean_length = sum(len(w) for w in words) / max(len(words), 1)
    dangling = sum(1 for w in words if w and w[-1] in DANGLING) / max(len(words), 1)
    return mean_length, dangling


def row(folder: Path) -> str:
    metrics = json.loads((folder / "metrics.json").read_text())
    captions = [p["caption"] for p in json.loads((folder / "predictions.json").read_text())]
    length, dangling = caption_statistics(captions)

    def number(key: str) -> str:
        value = metrics.get(key)
        return "missing" if value is None else f"{value:.3f}"

    return (
        f"| {folder.name} | {number('CIDEr')} | {number('Bleu_4')} | {number('METEOR')} | "
        f"{number('exact_match')} | {length:.2f} | {dangling:.3f} |"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folders", nargs="+", type=Path, help="captioning evaluate --out folders")
    args = parser.parse_args(argv)
    missing = [f for f in args.folders if not (f / "metrics.json").is_file()]
    if missing:
        print(
            f"error: {missing[0]}: no metrics.json (run captioning evaluate --out)", file=sys.stderr
        )
        return 2
    print("| run | CIDEr-D | BLEU-4 | METEOR | exact match | mean length | ends in a/and/of/the |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for folder in args.folders:
        print(row(folder))
    return 0


if __name__ == "__main__":
    sys.exit(main())
