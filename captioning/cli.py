"""Command line: argument parsing only; every verb calls the library.

Errors the user can cause print one line (``error: ...``) and exit with code 2.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable, Sequence

from captioning.errors import CaptioningError

logger = logging.getLogger("captioning")


def _setup_logging() -> None:
    # --quiet hides progress bars; the one-line-per-epoch log always shows.
    logging.basicConfig(
        level=logging.INFO,
        format="%(message)s",
        stream=sys.stderr,
        force=True,
    )


def _add_config_args(parser: argparse.ArgumentParser, required: bool = True) -> None:
    parser.add_argument("--config", required=required, help="YAML config file (see configs/)")
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override one config key, e.g. --set train.epochs=3 (repeatable)",
    )


# --------------------------------------------------------------------------- verbs


def cmd_shapes(args: argparse.Namespace) -> int:
    from captioning.data.shapes import generate_shapes

    summary = generate_shapes(
        args.out,
        num_train=args.train,
        num_val=args.val,
        num_test=args.test,
        seed=args.seed,
        image_size=args.image_size,
        captions=args.captions,
        progress=not args.quiet,
    )
    splits = ", ".join(f"{k} {v}" for k, v in summary["splits"].items())
    objects = ", ".join(f"{k}: {v}" for k, v in sorted(summary["objects_histogram"].items()))
    print(f"wrote shapes dataset to {summary['out_dir']}")
    print(f"  images: {splits} ({args.image_size} px, {args.captions} captions)")
    print(f"  images by object count: {objects}")
    print(f"  {summary['captions_per_image']} captions per image, "
          f"{len(summary['vocabulary'])} distinct words")  # fmt: skip
    return 0


def cmd_check_data(args: argparse.Namespace) -> int:
    from captioning.config import load_config
    from captioning.data.build import drop_bad_images, load_splits
    from captioning.vocab import Vocabulary

    cfg = load_config(args.config, args.overrides)
    splits = load_splits(cfg.data)
    # Report every bad file, whatever on_bad_image says; the verdict comes after.
    skip_cfg = type(cfg.data)(**{**vars(cfg.data), "on_bad_image": "skip"})
    total = sum(len(r) for r in splits.values())
    bad = drop_bad_images(splits, skip_cfg, progress=not args.quiet)
    train = splits.get("train", [])
    vocab = Vocabulary.build(
        (c for r in train for c in r.captions), cfg.data.min_count, cfg.data.max_vocab
    )
    print(f"data root: {cfg.data.root} ({cfg.data.format} format)")
    for split, records in splits.items():
        captions = sum(len(r.captions) for r in records)
        with_objects = sum(1 for r in records if r.objects)
        print(
            f"  {split:5s}: {len(records)} readable images, {captions} captions, "
            f"{with_objects} with object annotations"
        )
    print(f"  vocabulary (train only, min_count={cfg.data.min_count}): {len(vocab)} words")
    if bad:
        print(f"{len(bad)} of {total} images cannot be read:")
        for path, problem in bad:
            print(f"  {path}: {problem}")
        return 1
    print(f"all {total} images open cleanly")
    return 0


def cmd_train(args: argparse.Namespace) -> int:
    from captioning.config import load_config
    from captioning.train import fit

    overrides = list(args.overrides)
    if args.quiet:
        overrides.append("train.quiet=true")
    cfg = load_config(args.config, overrides)
    fit(cfg, out_dir=args.out, resume=args.resume)
    return 0


# --------------------------------------------------------------------------- parser


def _verb_adder(sub: argparse._SubParsersAction) -> Callable[..., argparse.ArgumentParser]:
    def add_verb(name: str, help: str) -> argparse.ArgumentParser:
        verb = sub.add_parser(name, help=help, description=help)
        verb.add_argument(
            "--quiet", dest="verb_quiet", action="store_true", help="no progress bars"
        )
        return verb

    return add_verb


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="captioning",
        description="Show, Attend and Tell: visual-attention image captioning.",
    )
    parser.add_argument("--quiet", action="store_true", help="no progress bars")
    sub = parser.add_subparsers(dest="verb", required=True, metavar="VERB")
    add_verb = _verb_adder(sub)

    p = add_verb("shapes", help="write the synthetic shapes dataset (COCO format)")
    p.add_argument("--out", default="data/shapes", help="output folder (default data/shapes)")
    p.add_argument("--train", type=int, default=8000, help="training images (default 8000)")
    p.add_argument("--val", type=int, default=500, help="validation images (default 500)")
    p.add_argument("--test", type=int, default=500, help="test images (default 500)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--image-size", type=int, default=96, help="image side in pixels")
    p.add_argument(
        "--captions",
        choices=["canonical", "varied"],
        default="canonical",
        help="canonical: five wordings of one content (default); varied: harder, noisier",
    )
    p.set_defaults(func=cmd_shapes)

    p = add_verb("check-data", help="read a config's data and open every image once")
    _add_config_args(p)
    p.set_defaults(func=cmd_check_data)

    p = add_verb("train", help="train a captioning model")
    _add_config_args(p)
    p.add_argument("--out", default=None, help="run folder (default runs/<config name>)")
    p.add_argument("--resume", default=None, metavar="CKPT", help="continue from a checkpoint")
    p.set_defaults(func=cmd_train)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    # `--quiet` may come before or after the verb
    args.quiet = args.quiet or bool(getattr(args, "verb_quiet", False))
    _setup_logging()
    func: Callable[[argparse.Namespace], int] = args.func
    try:
        return func(args)
    except CaptioningError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
