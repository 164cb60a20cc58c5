"""Self-critical training on the varied shapes captions, as data: what one epoch of SCST buys
over the cross-entropy model it starts from, with each baseline, against one more epoch of
cross-entropy (the control), seed by seed.

    captioning shapes --captions varied --out data/shapes_varied
    python tools/scst_study.py --data data/shapes_varied --out runs/scst_study --seeds 0,1,2

For each seed S this trains ``configs/shapes_soft.yaml`` on ``--data`` with CIDEr-D as the
validation score into ``OUT/xe-sS``, then three one-epoch runs of
``configs/shapes_varied_scst.yaml`` started from its ``best.pt`` (``--init``): SCST with the
``loo`` baseline, SCST with the ``greedy`` baseline, and the control (``train.objective=xe``,
the same learning rate and epoch). Each of the four models is scored on the test split with
beam 3 (CIDEr-D, BLEU-4, METEOR, exact match, with the captions' mean length and the share
that end in "a", "and", "of" or "the") and becomes one row of ``--results`` (default
results/scst_shapes.json): the variant, the seed, the scores, the train seconds, the
commands, the commit and the machine. A run folder that finished (``summary.json``) is scored
again, not retrained. Rows merge by (variant, seed); ``python tools/tables.py`` renders them
into docs/scst.md.
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: the repository root holds benchmarks/
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import argparse
import json
import shlex
import time
from typing import Any

from benchmarks.provenance import add_study_options, git_commit, machine, write_rows
from captioning.config import load_config
from captioning.errors import CaptioningError

ROOT = Path(__file__).resolve().parent.parent
XE_CONFIG = "configs/shapes_soft.yaml"
SCST_CONFIG = "configs/shapes_varied_scst.yaml"
BEAM = 3
VAL_IMAGES = 200  # the fine-tunes validate on the first 200 validation images
# variant -> the overrides of its one-epoch run from the cross-entropy model
FINE_TUNES = {
    "scst_loo": ["train.scst_baseline=loo"],
    "scst_greedy": ["train.scst_baseline=greedy"],
    "xe_control": ["train.objective=xe"],
}
VARIANTS = ("xe", *FINE_TUNES)
DANGLING = ("a", "and", "of", "the")


def caption_statistics(captions: list[str]) -> tuple[float, float]:
    """Mean length in words, and the share of captions whose last word is in DANGLING."""
    words = [c.split() for c in captions]
    mean_length = sum(len(w) for w in words) / max(len(words), 1)
    dangling = sum(1 for w in words if w and w[-1] in DANGLING) / max(len(words), 1)
    return mean_length, dangling


def settings(args: argparse.Namespace, variant: str, seed: int) -> list[str]:
    """The overrides of one run: the data, the seed, the thread count, then the variant's own
    and the study's ``--set`` (which win)."""
    common = [f"data.root={args.data}", f"train.seed={seed}", "train.quiet=true"]
    if args.threads is not None:
        common.append(f"train.threads={args.threads}")
    if variant == "xe":
        own = ["train.select_metric=CIDEr"]
    else:
        own = [*FINE_TUNES[variant], "train.epochs=1", f"train.val_max_images={VAL_IMAGES}"]
    return [*common, *own, *args.overrides]


def train_command(config: str, overrides: list[str], out: Path, init: Path | None) -> str:
    words = ["captioning", "train", "--config", config]
    if init is not None:
        words += ["--init", str(init)]
    for item in overrides:
        words += ["--set", item]
    return shlex.join([*words, "--out", str(out)])


def run_variant(args: argparse.Namespace, variant: str, seed: int) -> dict[str, Any]:
    """Train one variant of one seed (unless its folder finished) and score its ``best.pt``."""
    from captioning.evaluate import evaluate_checkpoint
    from captioning.train import fit

    config = XE_CONFIG if variant == "xe" else SCST_CONFIG
    overrides = settings(args, variant, seed)
    folder = args.out / f"{variant}-s{seed}"
    init = None if variant == "xe" else args.out / f"xe-s{seed}" / "best.pt"
    summary_path = folder / "summary.json"
    if not summary_path.is_file():
        began = time.perf_counter()
        fit(load_config(str(ROOT / config), overrides), folder, init=init and str(init))
        summary_path.write_text(
            json.dumps({"seconds": round(time.perf_counter() - began, 1)}, indent=1) + "\n"
        )
    seconds = json.loads(summary_path.read_text())["seconds"]
    scored = args.out / f"eval-{variant}-s{seed}"
    metrics = evaluate_checkpoint(
        folder / "best.pt", split="test", beam_size=BEAM, out_dir=scored, progress=False
    )
    predictions = json.loads((scored / "predictions.json").read_text())
    length, dangling = caption_statistics([p["caption"] for p in predictions])
    return {
        "variant": variant,
        "seed": seed,
        "config": config,
        "overrides": [o for o in overrides if not o.startswith(("data.root=", "train.seed="))],
        "init": None if init is None else f"xe-s{seed}/best.pt",
        "test_images": len(predictions),
        "beam_size": BEAM,
        **{
            k: round(metrics[k], 4)
            for k in ("CIDEr", "Bleu_4", "METEOR", "exact_match")
            if k in metrics
        },  # fmt: skip
        "mean_length": round(length, 3),
        "dangling": round(dangling, 4),
        "train_seconds": seconds,
        "command": train_command(config, overrides, folder, init),
        "evaluate": shlex.join(
            [
                "captioning",
                "evaluate",
                "--checkpoint",
                str(folder / "best.pt"),
                "--split",
                "test",
                "--beam-size",
                str(BEAM),
                "--out",
                str(scored),
            ]
        ),  # fmt: skip
    }


def parse_seeds(text: str) -> list[int]:
    try:
        seeds = [int(s) for s in text.split(",") if s.strip()]
    except ValueError:
        raise CaptioningError(f"--seeds {text!r}: give whole numbers such as 0,1,2") from None
    if not seeds or len(set(seeds)) != len(seeds) or min(seeds) < 0:
        raise CaptioningError(f"--seeds {text!r}: give distinct seeds of 0 or more, e.g. 0,1,2")
    return seeds


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, required=True,
                        help="a `captioning shapes --captions varied` folder")  # fmt: skip
    parser.add_argument("--out", type=Path, required=True, help="the runs' folder")
    parser.add_argument("--seeds", default="0,1,2", help="comma-separated (default 0,1,2)")
    add_study_options(parser, results=ROOT / "results" / "scst_shapes.json")
    args = parser.parse_args(argv)
    try:
        seeds = parse_seeds(args.seeds)
        if not (args.data / "annotations").is_dir():
            raise CaptioningError(
                f"--data {args.data}: no shapes data there "
                f"(make it with: captioning shapes --captions varied --out {args.data})"
            )
        commit, where = git_commit(), machine()
        if args.threads is not None:
            where["threads"] = args.threads
        rows = []
        for seed in seeds:
            for variant in VARIANTS:
                row = run_variant(args, variant, seed)
                row.update(commit=commit, machine=where, timed_alone=not args.machine_busy)
                rows.append(row)
                write_rows(args.results, [row], lambda r: (r["variant"], r["seed"]))
                print(f"{variant} seed {seed}: test CIDEr-D {row['CIDEr']:.3f}", flush=True)
    except CaptioningError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {len(rows)} rows to {args.results}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
