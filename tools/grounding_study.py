"""Where trained models look on real photos, as data: each checkpoint captions a COCO-format
folder with instance boxes, and its grounding against the boxes becomes one row.

    python -m tools.grounding_study --data SHARED/data/coco_mini --split-name train2017 \\
        --checkpoint 'RUNS/soft-seed{seed}/train/best.pt' --model soft --seeds 0-2 \\
        --out runs/grounding --shared SHARED --runs RUNS --results results/grounding.json

For each seed S, ``captioning evaluate`` scores the checkpoint (``{seed}`` replaced by S) on
the folder's images (``--data``: ``annotations/captions_NAME.json``,
``annotations/instances_NAME.json`` and the images in ``NAME/``, NAME being
``--split-name``), as its own decoding settings say (``--beam-size``, ``--hard-context``
change them), into ``OUT/MODEL-seedS``. Its ``grounding.json`` (the pointing game and the
attention mass in the boxes of every word that names a category of its photo, for the
model's maps and the even, centre and saliency baselines; :mod:`captioning.metrics.pointing`),
the same for the reference captions' words teacher-forced (``references``: every model scored
on the same words, five captions a photo; :func:`captioning.evaluate.reference_grounding`)
and the caption scores become one row of ``--results FILE`` where given
(results/grounding.json), else of ``OUT/rows.json``: the model's settings that studies vary,
the decoding, its precision, threads and device, the machine, the commands (the evaluation's
as ``command``, this study's as ``study``; the folders ``--out``, ``--shared`` and ``--runs``
written as OUT, SHARED and RUNS) and the commit (:class:`lab.runner.Recorder`). Rows
merge by (model, variant, seed); one made under other settings (checkpoint levers, decoding,
data) is replaced only with ``--replace``. ``python -m tools.tables`` renders them into
docs/grounding.md. Run it once per kind of model (``--model hard --hard-context argmax``,
another ``--variant``).
"""

from __future__ import annotations

import argparse
import shlex
import sys
import time
from pathlib import Path
from typing import Any

import torch

from captioning.checkpoint import load_checkpoint
from captioning.cli import add_set_option, positive_int
from captioning.errors import CaptioningError
from captioning.runtime import resolve_device
from lab.options import add_seeds_option, errors_in_one_line, seeds_of
from lab.provenance import add_replace_option, add_result_options, device_name, machine, portable
from lab.runner import Recorder

# The checkpoint settings a grounding study varies (the levers of docs/grounding.md).
LEVERS = (
    "model.encoder",
    "model.image_size",
    "model.grid_size",
    "model.drop_stages",
    "model.summary",
    "model.summary_gate",
    "model.init_state",
    "model.fine_tune",
    "model.attention",
    "model.heads",
    "model.score",
    "model.context_to_lstm",
    "model.query",
    "train.doubly_stochastic_weight",
    "train.attention_entropy_weight",
    "model.context_words",
    "train.context_word_weight",
    "model.word_maps",
    "train.word_map_weight",
    "train.word_map_labels",
    "model.word_map_sharpness",
    "model.word_map_classes",
    "model.word_attention",
    "model.word_attention_words",
    "train.expected_word_weight",
    "model.output_stride",
    "model.tiles",
    "model.tile_size",
    "train.objective",
    "train.hard_estimator",
    "train.epochs",
)
SCORES = ("Bleu_1", "Bleu_4", "METEOR", "ROUGE_L", "CIDEr")
GROUNDING = ("grid", "centre_sigma", "overall", "categories", "words", "absent", "all_words")
# what a row keeps of the references' teacher-forced grounding (every model on the same words)
REFERENCES = ("overall", "categories", "all_words")


def data_overrides(args: argparse.Namespace) -> list[str]:
    """The ``--set`` lines that point a checkpoint's data section at ``--data``."""
    return [
        f"data.root={args.data}",
        "data.format=coco",
        f"data.splits.test={args.split_name}",
        "data.captions=annotations/captions_{split}.json",
        "data.instances=annotations/instances_{split}.json",
        "data.images={split}",
        "data.max_images=null",
        "data.categories=[]",
        *args.overrides,
    ]


def places(args: argparse.Namespace) -> dict[str, Path | None]:
    """The study's folders and their placeholders in a row: no machine's paths."""
    return {"OUT": args.out, "SHARED": args.shared, "RUNS": args.runs}


def levers(checkpoint: Path) -> dict[str, Any]:
    """The checkpoint's values of :data:`LEVERS` and its training seed."""
    config = load_checkpoint(checkpoint)["config"]
    found = {}
    for key in (*LEVERS, "train.seed"):
        section, name = key.split(".")
        found[key] = config.get(section, {}).get(name)
    return found


def evaluate_command(args: argparse.Namespace, checkpoint: Path, folder: Path) -> list[str]:
    """The ``captioning evaluate`` line of one checkpoint (what a user would type)."""
    words = ["captioning", "evaluate", "--checkpoint", str(checkpoint), "--split", "test"]
    for item in data_overrides(args):
        words += ["--set", item]
    if args.beam_size is not None:
        words += ["--beam-size", str(args.beam_size)]
    if args.hard_context is not None:
        words += ["--hard-context", args.hard_context]
    if args.category_words is not None:
        words += ["--category-words", str(args.category_words)]
    return [*words, "--out", str(folder)]


def score_seed(args: argparse.Namespace, seed: int) -> dict[str, Any]:
    """Evaluate one seed's checkpoint on ``--data`` and make its row."""
    from captioning.evaluate import evaluate_checkpoint

    checkpoint = Path(args.checkpoint.replace("{seed}", str(seed)))
    if not checkpoint.is_file():
        raise CaptioningError(
            f"--checkpoint {checkpoint}: no such file for seed {seed}; "
            "name each seed's file with {seed} in the pattern"
        )
    folder = args.out / f"{args.model}-seed{seed}"
    began = time.perf_counter()
    metrics = evaluate_checkpoint(
        checkpoint,
        split="test",
        beam_size=args.beam_size,
        out_dir=folder,
        hard_context=args.hard_context,
        progress=not args.quiet,
        overrides=data_overrides(args),
        category_words=args.category_words,
    )
    seconds = time.perf_counter() - began
    if "grounding" not in metrics:
        raise CaptioningError(
            f"--data {args.data}: its images have no instance boxes "
            "(annotations/instances_NAME.json) to ground words in"
        )
    return make_row(args, seed, checkpoint, folder, metrics, seconds)


def make_row(
    args: argparse.Namespace,
    seed: int,
    checkpoint: Path,
    folder: Path,
    metrics: dict[str, Any],
    seconds: float,
) -> dict[str, Any]:
    """One row: what was scored, how, on what, and its caption and grounding scores."""
    grounding = metrics["grounding"]
    return {
        "model": args.model,
        "variant": args.variant,
        "seed": seed,
        "settings": levers(checkpoint),
        "checkpoint": portable(str(checkpoint), places(args)),
        "data": portable(str(args.data), places(args)),
        "images": metrics["num_images"],
        "decoding": metrics["decoding"],
        "precision": metrics["decoding"]["precision"],
        "threads": torch.get_num_threads(),
        "device": device_name(resolve_device("auto")),
        "scores": {k: metrics[k] for k in SCORES if metrics.get(k) is not None},
        "grounding": {k: grounding[k] for k in GROUNDING},
        "references": {k: grounding["references"][k] for k in REFERENCES},
        "seconds": round(seconds, 1),
        "command": shlex.join(
            portable(word, places(args)) for word in evaluate_command(args, checkpoint, folder)
        ),
        "machine": machine(),
    }


def settings(row: dict[str, Any]) -> dict[str, Any]:
    """What a row was made under, for the merge: the checkpoint's levers, the decoding and
    the data."""
    return {k: row[k] for k in ("settings", "decoding", "data") if k in row}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--data",
        type=Path,
        required=True,
        help="a COCO-format folder with captions and instances files",
    )
    parser.add_argument(
        "--split-name",
        default="train2017",
        help="NAME of its annotations/*_NAME.json and image folder",
    )
    parser.add_argument(
        "--checkpoint", required=True, help="each seed's checkpoint, {seed} standing for the seed"
    )
    parser.add_argument("--model", required=True, help="the rows' model name (soft, hard, ...)")
    parser.add_argument("--variant", default="recipe", help="the rows' variant (default recipe)")
    add_seeds_option(parser, "0,1,2")
    parser.add_argument("--out", type=Path, required=True, help="the evaluations' folder")
    parser.add_argument(
        "--shared",
        type=Path,
        default=None,
        help="the shared data folder, written SHARED in the rows",
    )
    parser.add_argument(
        "--runs",
        type=Path,
        default=None,
        help="the folder of the checkpoints, written RUNS in the rows",
    )
    parser.add_argument("--beam-size", type=int, default=None, help="default: the checkpoint's")
    parser.add_argument(
        "--hard-context", default=None, choices=["expectation", "argmax", "sample", "marginal"]
    )
    parser.add_argument(
        "--category-words",
        type=Path,
        default=None,
        metavar="FILE",
        help="word: category entries over the shipped map",
    )
    parser.add_argument("--quiet", action="store_true", help="no progress bars")
    add_set_option(parser, "a config override of every evaluation (data, decode, runtime)")
    parser.add_argument("--threads", type=positive_int, help="torch's threads")
    add_result_options(parser, "the rows")
    add_replace_option(parser)
    return parser.parse_args(argv)


@errors_in_one_line
def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    seeds = seeds_of(args)
    if not (args.data / "annotations").is_dir():
        raise CaptioningError(
            f"--data {args.data}: no annotations/ folder there; give "
            "a COCO-format folder (captions, instances, images)"
        )
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    recorder = Recorder(
        "tools.grounding_study",
        argv,
        args.out,
        lambda r: (r["model"], r["variant"], r["seed"]),
        results=args.results,
        replace=args.replace,
        timed_alone=not args.machine_busy,
        places={"SHARED": args.shared, "RUNS": args.runs},
        settings=settings,
    )
    for seed in seeds:
        row = {**score_seed(args, seed), "study": recorder.stamp["command"]}
        recorder.write([row])
        overall = row["grounding"]["overall"]
        shown = ", ".join(f"{k} {overall[k]['pointing']:.3f}" for k in overall if k != "words")
        print(f"{args.model} seed {seed}: {overall['words']} words; pointing {shown}", flush=True)
    print(f"wrote {len(seeds)} rows to {recorder.path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
