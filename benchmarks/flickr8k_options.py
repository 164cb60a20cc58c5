"""The command line of :mod:`benchmarks.flickr8k`: its options, checked, and the command a
row records."""

from __future__ import annotations

import argparse
from pathlib import Path

from benchmarks.flickr8k_runs import FIRST_STAGE, MODELS, OWN, RECIPE
from lab import options
from lab.options import StudyError
from lab.provenance import module_command


def parse_cuts(text: str) -> list[int]:
    try:
        cuts = options.parse_seeds(text)
    except StudyError:
        cuts = [0]
    if min(cuts) < 1:
        raise argparse.ArgumentTypeError(f"must be word counts of at least 1, got {text!r}")
    return cuts


def command_of(argv: list[str] | None, out: Path, shared: Path) -> str:
    """This study's command in module form, ``--out`` and ``--shared`` as OUT and SHARED."""
    return module_command("benchmarks.flickr8k", argv, {"OUT": out, "SHARED": shared})


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--shared", required=True, type=Path, help="the shared folder")
    parser.add_argument("--out", required=True, type=Path, help="working folder")
    parser.add_argument(
        "--models", default=",".join(MODELS), help=f"comma-separated, of {', '.join(MODELS)}"
    )
    options.add_seeds_option(parser, "0,1,2", " (training seeds)")
    parser.add_argument(
        "--variant", default=RECIPE, help="a name for rows trained with --set overrides"
    )
    parser.add_argument(
        "--first-stage",
        metavar="VARIANT",
        help="the variant of the first-stage runs a second stage starts "
        "from (default: --variant; recipe: the shipped recipes')",
    )
    parser.add_argument(
        "--no-score", action="store_true", help="train and decode only; score later"
    )
    parser.add_argument(
        "--no-train", action="store_true", help="score the finished runs only; train none"
    )
    parser.add_argument(
        "--cut",
        type=parse_cuts,
        default=[],
        help="also score the soft model's beam-3 captions cut to their first N "
        "words, for each N of this comma-separated list",
    )
    parser.add_argument("--commit", help="the commit to record (where the copy has no .git)")
    options.add_runner_options(parser, each="every trained model")
    args = parser.parse_args(argv)
    args.models = [m for m in args.models.split(",") if m]
    unknown = sorted(set(args.models) - set(MODELS))
    if unknown:
        parser.error(f"unknown model {unknown[0]!r}; choose from {', '.join(MODELS)}")
    try:
        args.seeds = options.seeds_of(args)
        options.refuse_plumbing(args.overrides, OWN)
    except StudyError as exc:
        parser.error(str(exc))
    if not args.variant.isidentifier():
        parser.error(f"--variant must be a plain name (letters, digits, _), got {args.variant!r}")
    if args.first_stage and not set(args.models) & set(FIRST_STAGE):
        parser.error(
            f"--first-stage names where a second stage starts, and --models has none; "
            f"add one of {', '.join(FIRST_STAGE)} or leave --first-stage out"
        )
    args.first_stage = args.first_stage or args.variant
    if not args.first_stage.isidentifier():
        parser.error(f"--first-stage must be a plain name, got {args.first_stage!r}")
    if args.no_train and args.no_score:
        parser.error("--no-train --no-score would do nothing")
    if args.variant != RECIPE and "nn" in args.models:
        parser.error("--variant trains decoders; leave nn out of --models")
    return args
