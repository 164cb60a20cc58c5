"""Self-critical training on the varied shapes captions, as data: what one epoch of SCST buys
over the cross-entropy model it starts from, with each baseline, against one more epoch of
cross-entropy (the control), seed by seed.

    captioning shapes --captions varied --out data/shapes_varied
    python -m tools.scst_study --data data/shapes_varied --out runs/scst_study --seeds 0,1,2 \
        --results results/scst_shapes.json

For each seed S this trains ``configs/shapes_soft.yaml`` on ``--data`` with CIDEr-D as the
validation score into ``OUT/xe-sS``, then three one-epoch runs of
``configs/shapes_varied_scst.yaml`` started from its ``best.pt`` (``--init``): SCST with the
``loo`` baseline, SCST with the ``greedy`` baseline, and the control (``train.objective=xe``,
the same learning rate and epoch). Each of the four models is scored on the test split with
beam 3 (CIDEr-D, BLEU-4, METEOR, exact match, with the captions' mean length and the share
that end in "a", "and", "of" or "the") and becomes one row of ``--results FILE`` where given
(results/scst_shapes.json), else of ``OUT/rows.json``: the variant, the seed, the scores, the
train seconds, the ``captioning`` commands, the study's command, the commit, precision,
threads, device and machine. The runner (:mod:`lab.runner`) scores a run folder that
finished (``summary.json``) again without retraining it; ``--jobs N`` trains N seeds (then
N fine-tunes) side by side. Rows merge by (variant, seed); the table in docs/scst.md is
rendered from results/scst_shapes.json.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path
from typing import Any

from lab.options import (
    StudyError,
    add_runner_options,
    add_seeds_option,
    errors_in_one_line,
    seeds_of,
    threads_for,
)
from lab.provenance import portable
from lab.runner import Evaluation, Outcome, Recorder, RunSpec, plan, run_fields, run_study

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


def variant_spec(out: Path, data: Path, variant: str, seed: int, extra: list[str]) -> RunSpec:
    """One run: the cross-entropy model, or a one-epoch fine-tune from its ``best.pt``; the
    variant's own overrides, then the study's ``--set`` (which win)."""
    if variant == "xe":
        config, own, init = XE_CONFIG, ["train.select_metric=CIDEr"], None
    else:
        config, init = SCST_CONFIG, out / f"xe-s{seed}" / "best.pt"
        own = [*FINE_TUNES[variant], "train.epochs=1", f"train.val_max_images={VAL_IMAGES}"]
    return RunSpec(
        variant,
        config,
        (*own, *extra),
        seed,
        out / f"{variant}-s{seed}",
        plumbing=(f"data.root={data}", "train.quiet=true"),
        init=init,
        evaluations=(Evaluation("test", beam_size=BEAM, options=()),),
        meta={"out": str(out), "data": str(data)},
    )


def variant_row(outcome: Outcome) -> dict[str, Any]:
    """The row of one variant and seed: its scores on the test split with beam 3."""
    spec = outcome.spec
    if outcome.failed is not None:
        raise StudyError(f"{spec.folder} diverged: {outcome.failed}")
    places = {"OUT": Path(spec.meta["out"]), "DATA": Path(spec.meta["data"])}
    metrics = outcome.metrics[f"test_beam{BEAM}"]
    scored = spec.folder / f"eval_test_beam{BEAM}"
    predictions = json.loads((scored / "predictions.json").read_text())
    length, dangling = caption_statistics([p["caption"] for p in predictions])
    train = ["captioning", "train", "--config", spec.config]
    if spec.init is not None:
        train += ["--init", str(spec.init)]
    train += [w for item in spec.settings() for w in ("--set", item)]
    train += ["--out", str(spec.folder)]
    evaluate = [
        "captioning",
        "evaluate",
        "--checkpoint",
        str(spec.folder / "best.pt"),
        "--split",
        "test",
        "--beam-size",
        str(BEAM),
        "--out",
        str(scored),
    ]
    return {
        "variant": spec.name,
        "seed": spec.seed,
        "config": spec.config,
        "overrides": [*spec.overrides, *(p for p in spec.plumbing if p.startswith("train."))],
        "init": None if spec.init is None else f"xe-s{spec.seed}/best.pt",
        "test_images": len(predictions),
        "beam_size": BEAM,
        **{
            k: round(metrics[k], 4)
            for k in ("CIDEr", "Bleu_4", "METEOR", "exact_match")
            if k in metrics
        },
        "mean_length": round(length, 3),
        "dangling": round(dangling, 4),
        "train_seconds": round(outcome.summary.get("seconds", outcome.train_seconds), 1),
        "train_command": shlex.join(portable(w, places) for w in train),
        "evaluate": shlex.join(portable(w, places) for w in evaluate),
        **run_fields(outcome),
    }


@errors_in_one_line
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tools.scst_study", description=__doc__.splitlines()[0]
    )
    parser.add_argument(
        "--data", type=Path, required=True, help="a `captioning shapes --captions varied` folder"
    )
    parser.add_argument("--out", type=Path, required=True, help="the runs' folder")
    add_seeds_option(parser, "0,1,2")
    add_runner_options(parser)
    args = parser.parse_args(argv)
    seeds, threads = seeds_of(args), threads_for(args.jobs, args.threads)
    if not (args.data / "annotations").is_dir():
        raise StudyError(
            f"--data {args.data}: no shapes data there "
            f"(make it with: captioning shapes --captions varied --out {args.data})"
        )
    recorder = Recorder.from_args(
        "tools.scst_study",
        argv,
        args,
        lambda r: (r["variant"], r["seed"]),
        places={"DATA": args.data},
    )
    rows = []
    # the cross-entropy models first: each fine-tune starts from its seed's
    for variants in (["xe"], list(FINE_TUNES)):
        specs = [
            variant_spec(args.out, args.data, v, seed, args.overrides)
            for seed in seeds
            for v in variants
        ]
        for (row,) in run_study(plan(specs, threads), variant_row, jobs=args.jobs):
            stamp = recorder.stamp  # the machine as the table reads it
            row["machine"] = {
                "cpu": stamp["cpu"],
                "cores": stamp["cores"],
                "threads": row["threads"],
                "torch": stamp["torch"],
            }
            rows.append(row)
            recorder.write([row])
            print(f"{row['variant']} seed {row['seed']}: test CIDEr-D {row['CIDEr']:.3f}")
    print(f"wrote {len(rows)} rows to {recorder.path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
