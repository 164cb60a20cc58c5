"""Decoding chosen on the dev split: for each finished Flickr8k run (:mod:`benchmarks.flickr8k`),
decode the 1,000 dev photos at every beam size and length penalty of a grid, keep the setting
with the best dev score, and decode and score the test split once with it.

    python -m benchmarks.flickr8k_decoding --out runs/flickr8k --models best --seeds 0,1,2 \\
        --results results/flickr8k.json

The study's rows decode with 3 beams and no length penalty, as the recipe's config says.
This asks what choosing those on held-out data (as the paper chose its checkpoint, on dev
BLEU) is worth on the test split: nothing is retrained, and the test split is decoded once
per run, with the setting the dev split chose. The dev decodings go to
``RUN/decoding/val_beamB_lpA/`` (a finished one is reused), the test decoding to
``RUN/decoding/test_beamB_lpA/``.

One row per run goes to ``--results`` (else ``OUT/rows.json``), with variant ``--variant``
(``dev_decode`` for the recipe's runs, ``NAME_dev_decode`` for lever ``NAME``'s, as the tables
read them), ``beam_size`` null and the chosen setting under ``decode``, every dev score
of the grid under ``dev_grid``, the test scores as in the study's rows, and the training's
device, precision and threads (the rows merge with the study's by variant, model, seed, beam
and device). They record no seconds: a stopped sweep goes on where it stopped.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path
from typing import Any

from benchmarks.flickr8k_runs import KINDS, MODELS, run_dir
from benchmarks.flickr8k_scores import references, score
from captioning.errors import CaptioningError
from lab import options, runner
from lab.options import StudyError
from lab.provenance import portable

logger = logging.getLogger("captioning")

VARIANT = "dev_decode"
METRICS = ("Bleu_4", "CIDEr", "ROUGE_L")  # of each dev decoding (no METEOR: a Java run each)


def grid_of(beams: list[int], penalties: list[float]) -> list[tuple[int, float]]:
    """Every (beam size, length penalty) of the grid; greedy decoding (one beam) has no
    length penalty to choose, so it appears once."""
    return sorted({(b, 0.0 if b == 1 else a) for b in beams for a in penalties})


def setting_name(beam: int, penalty: float) -> str:
    return f"beam{beam}_lp{penalty:g}"


def decode(
    checkpoint: Path, split: str, beam: int, penalty: float, folder: Path, meteor: bool
) -> tuple[dict[int, str], dict[str, Any]]:
    """The captions of ``split`` at one setting and the scores the evaluation wrote beside
    them (read back when an earlier call wrote them: a stopped sweep goes on where it
    stopped, so the rows record no seconds)."""
    from captioning.evaluate import evaluate_checkpoint

    found = folder / "predictions.json"
    if not found.is_file():
        evaluate_checkpoint(
            checkpoint,
            split=split,
            beam_size=beam,
            meteor=meteor,
            progress=False,
            out_dir=folder,
            overrides=[f"decode.length_penalty={penalty}"],
        )
    captions = {p["image_id"]: p["caption"] for p in json.loads(found.read_text())}
    return captions, json.loads((folder / "metrics.json").read_text())


def choose(dev: dict[tuple[int, float], dict[str, Any]], metric: str) -> tuple[int, float]:
    """The setting with the best dev ``metric``; of equals, the fewest beams, then the
    smallest penalty (the cheaper decoding)."""
    return max(sorted(dev), key=lambda s: (dev[s][metric], -s[0], -s[1]))


def run_folder(out: Path, model: str, seed: int, variant: str) -> Path | None:
    """The finished run of ``model`` and ``seed`` (its ``job.json``), of either device kind."""
    for kind in KINDS:
        folder = run_dir(out, variant, model, seed, kind)
        if (folder / "job.json").is_file():
            return folder
    return None


def row_of_run(args: argparse.Namespace, folder: Path, refs: dict) -> dict:
    """Decode the dev split over the grid, choose, decode and score the test split."""
    job = json.loads((folder / "job.json").read_text())
    checkpoint = folder / "train" / "best.pt"
    dev = {}
    for beam, penalty in grid_of(args.beams, args.length_penalties):
        out = folder / "decoding" / f"val_{setting_name(beam, penalty)}"
        _, dev[beam, penalty] = decode(checkpoint, "val", beam, penalty, out, meteor=False)
        logger.info(
            "%s seed %d, dev, %s: %s %.4f",
            job["model"],
            job["seed"],
            setting_name(beam, penalty),
            args.select,
            dev[beam, penalty][args.select],
        )
    beam, penalty = choose(dev, args.select)
    out = folder / "decoding" / f"test_{setting_name(beam, penalty)}"
    captions, _ = decode(checkpoint, "test", beam, penalty, out, meteor=False)
    return {
        "variant": args.variant,
        "model": job["model"],
        "seed": job["seed"],
        "beam_size": None,
        "decode": {"beam_size": beam, "length_penalty": penalty, "chosen_on": f"val {args.select}"},
        **score(captions, refs),
        "dev_grid": {
            setting_name(b, a): {k: round(s[k], 5) for k in METRICS}
            for (b, a), s in sorted(dev.items())
        },
        **{k: job[k] for k in ("select_metric", "best_val", "best_epoch", "epochs", "steps")},
        "config": job["config"],
        "overrides": [portable(o, {"OUT": args.out}) for o in job["settings"]],
        **{k: job[k] for k in ("precision", "device", "threads")},
        "trained_at": job["commit"],
    }


def _key(row: dict[str, Any]) -> tuple:
    return (row["variant"], row["model"], row["seed"], row["beam_size"], row["device"])


def parse_numbers(kind: type) -> Any:
    def parse(text: str) -> list:
        try:
            values = [kind(v) for v in text.split(",") if v]
        except ValueError:
            values = []
        if not values or min(values) < (1 if kind is int else 0):
            raise argparse.ArgumentTypeError(
                f"must be a comma-separated list of "
                f"{'beam sizes' if kind is int else 'penalties'} "
                f"({'1 or more' if kind is int else '0 or more'}), "
                f"got {text!r}"
            )
        return values

    return parse


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--out", required=True, type=Path, help="the working folder of benchmarks.flickr8k"
    )
    parser.add_argument(
        "--models", default="best", help=f"comma-separated, of {', '.join(MODELS[1:])} (best)"
    )
    options.add_seeds_option(parser, "0,1,2", " (training seeds)")
    parser.add_argument(
        "--run-variant",
        default="recipe",
        help="the variant of the runs to decode (recipe: the shipped configs')",
    )
    parser.add_argument(
        "--beams",
        type=parse_numbers(int),
        default=[3, 5, 7, 10],
        help="beam sizes to try on the dev split (3,5,7,10)",
    )
    parser.add_argument(
        "--length-penalties",
        type=parse_numbers(float),
        default=[0.0, 1.0],
        help="GNMT length penalties to try (0,1)",
    )
    parser.add_argument(
        "--select",
        default="Bleu_4",
        choices=("Bleu_4", "CIDEr", "ROUGE_L"),
        help="the dev score that chooses (Bleu_4, the paper's choice of checkpoint)",
    )
    parser.add_argument(
        "--variant",
        help=f"the rows' variant ({VARIANT} for the recipe's runs, else RUN_VARIANT_{VARIANT}, "
        "the name the tables read the decoded runs from)",
    )
    parser.add_argument(
        "--results", type=Path, help="merge the rows into this results file (results/flickr8k.json)"
    )
    parser.add_argument(
        "--replace",
        action="store_true",
        help="with --results: also replace rows made under other settings",
    )
    args = parser.parse_args(argv)
    args.models = [m for m in args.models.split(",") if m]
    unknown = sorted(set(args.models) - set(MODELS[1:]))
    if unknown:
        parser.error(f"unknown model {unknown[0]!r}; choose from {', '.join(MODELS[1:])}")
    try:
        args.seeds = options.seeds_of(args)
    except StudyError as exc:
        parser.error(str(exc))
    if args.variant is None:
        args.variant = VARIANT if args.run_variant == "recipe" else f"{args.run_variant}_{VARIANT}"
    if not args.variant.isidentifier():
        parser.error(f"--variant must be a plain name (letters, digits, _), got {args.variant!r}")
    args.jobs = 1
    args.machine_busy = True  # the rows record no seconds, so none claims to be timed alone
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    args.out = args.out.resolve()
    try:
        if not (args.out / "data" / "annotations").is_dir():
            raise CaptioningError(
                f"{args.out} has no prepared Flickr8k data; run "
                f"python -m benchmarks.flickr8k --out {args.out} first"
            )
        folders = []
        for model in args.models:
            for seed in args.seeds:
                folder = run_folder(args.out, model, seed, args.run_variant)
                if folder is None:
                    raise CaptioningError(
                        f"{model} seed {seed} has no finished run in "
                        f"{args.out / 'runs'}; train it with "
                        f"python -m benchmarks.flickr8k first"
                    )
                folders.append(folder)
        recorder = runner.Recorder.from_args("benchmarks.flickr8k_decoding", argv, args, _key)
        refs = references(args.out, "test")
        rows = [row_of_run(args, folder, refs) for folder in folders]
        recorder.write(rows)
    except CaptioningError as exc:
        return options.fail(exc)
    for row in rows:
        chosen = row["decode"]
        print(
            f"{row['model']} seed {row['seed']}: beam {chosen['beam_size']}, length penalty "
            f"{chosen['length_penalty']:g} chosen on {chosen['chosen_on']}; test BLEU-4 "
            f"{100 * row['Bleu_4']:.2f}, METEOR {100 * (row['METEOR'] or 0):.2f}, "
            f"CIDEr-D {100 * row['CIDEr']:.2f}"
        )
    print(f"wrote {recorder.path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
