"""The command line of :mod:`benchmarks.photos`: its options, checked."""

from __future__ import annotations

import argparse
from pathlib import Path

from lab import options
from lab.provenance import ROOT

CONFIG = "configs/photos_mobilenet.yaml"
MODELS = ("nn", "none", "soft", "hard")
RECIPE = "recipe"  # the variant name of rows trained with the config as it is


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--shared", required=True, type=Path, help="the shared folder (data/photos_vi and weights)"
    )
    parser.add_argument("--out", required=True, type=Path, help="working folder")
    parser.add_argument(
        "--models", default=",".join(MODELS), help=f"comma-separated, of {', '.join(MODELS)}"
    )
    options.add_seeds_option(parser, "0,1,2", " (training seeds)")
    parser.add_argument("--config", default=CONFIG, help=f"the recipe ({CONFIG})")
    parser.add_argument("--beam-size", type=int, default=3)
    parser.add_argument(
        "--variant",
        default=RECIPE,
        help="a name for rows trained with --set overrides (a lever tried against the recipe)",
    )
    parser.add_argument(
        "--then",
        metavar="CONFIG",
        help="a second stage: train CONFIG from each model's best.pt (needs --variant)",
    )
    parser.add_argument(
        "--then-set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a config override of the second stage (repeatable)",
    )
    options.add_runner_options(parser, each="every model")
    args = parser.parse_args(argv)
    args.models = [m for m in args.models.split(",") if m]
    unknown = sorted(set(args.models) - set(MODELS))
    if unknown:
        parser.error(f"unknown model {unknown[0]!r}; choose from {', '.join(MODELS)}")
    if not args.variant.isidentifier():
        parser.error(f"--variant must be a plain name (letters, digits, _), got {args.variant!r}")
    if args.variant != RECIPE and "nn" in args.models:
        parser.error("--variant trains decoders; leave nn out of --models")
    if args.then_set and args.then is None:
        parser.error("--then-set overrides the second stage: name its config with --then")
    if args.then is not None and args.variant == RECIPE:
        parser.error("--then makes another recipe: name its rows with --variant")
    return args


def repository_path(text: str) -> str:
    """A config path as rows name it: relative to the checkout where it lies inside it."""
    path = Path(text).resolve() if Path(text).exists() else ROOT / text
    try:
        return path.relative_to(ROOT).as_posix()
    except ValueError:
        return path.as_posix()
