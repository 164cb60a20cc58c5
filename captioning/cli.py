"""Command line: argument parsing only; every verb calls the library.

Errors the user can cause print one line (``error: ...``) and exit with code 2.
"""

from __future__ import annotations

import argparse
import codecs
import logging
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from captioning.errors import CaptioningError, ConfigError, Terminated
from captioning.signals import stops_on_signals

if TYPE_CHECKING:
    from captioning.api import Caption, CaptionModel
    from captioning.config import Config

logger = logging.getLogger("captioning")


def _setup_logging() -> None:
    # --quiet hides progress bars; the one-line-per-epoch log always shows.
    logging.basicConfig(
        level=logging.INFO,
        format="%(message)s",
        stream=sys.stderr,
        force=True,
    )


def _is_utf8(stream: object) -> bool:
    try:
        return codecs.lookup(getattr(stream, "encoding", None) or "ascii").name == "utf-8"
    except LookupError:
        return False


def _utf8_output() -> None:
    """Print as UTF-8 where the locale says ASCII or Latin-1 (``LC_ALL=C`` with
    ``PYTHONUTF8=0``, a legacy Windows console): captions and file names may be in any script,
    and the first "ử" would otherwise end the run. An encoding the user chose in
    ``PYTHONIOENCODING`` is kept, with the characters it lacks escaped instead."""
    for stream in (sys.stdout, sys.stderr):
        reconfigure = getattr(stream, "reconfigure", None)
        if reconfigure is None or _is_utf8(stream):
            continue
        if os.environ.get("PYTHONIOENCODING"):
            reconfigure(errors="backslashreplace")
        else:
            reconfigure(encoding="utf-8")


def _add_config_args(parser: argparse.ArgumentParser, required: bool = True) -> None:
    parser.add_argument("--config", required=required, help="YAML config file (see configs/)")
    add_set_option(parser, "override one config key, e.g. --set train.epochs=3 (repeatable)")


def add_set_option(parser: argparse.ArgumentParser, help: str) -> None:
    """``--set KEY=VALUE``, repeatable, into ``overrides`` (for the CLI and the study tools)."""
    parser.add_argument(
        "--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE", help=help
    )


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a whole number of at least 1, got {text!r}")
    return value


def beam_size(text: str) -> int:
    """``--beam-size``: a whole number from 1 to 64 (past that, a beam search only holds more
    memory, and a large one runs out of it after the model has loaded)."""
    value = positive_int(text)
    if value > 64:
        raise argparse.ArgumentTypeError(f"must be at most 64, got {text!r}")
    return value


def _add_checkpoint_args(parser: argparse.ArgumentParser) -> None:
    """A checkpoint, where it runs, and how it decodes (see ``inference.with_decoding``)."""
    parser.add_argument("--checkpoint", required=True, help="a best.pt or last.pt file")
    parser.add_argument(
        "--beam-size",
        type=beam_size,
        default=None,
        help="beam search with this many beams (1 greedy; 64 at most)",
    )
    parser.add_argument(
        "--hard-context",
        choices=["expectation", "argmax", "sample", "marginal"],
        default=None,
        help="hard attention: the expected context (the authors'), the most "
        "likely cell, a sampled cell, or (models without the context in the "
        "LSTM) the exact marginal over the cells",
    )
    parser.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:1, ...")


# --------------------------------------------------------------------------- verbs


def cmd_shapes(args: argparse.Namespace) -> int:
    from captioning.data.shapes import generate_shapes
    from captioning.folders import claim_folder
    from captioning.training.run_folder import SHAPES

    with claim_folder(args.out, SHAPES):
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
    print(
        f"  {summary['captions_per_image']} captions per image, "
        f"{len(summary['vocabulary'])} distinct words"
    )
    return 0


def cmd_check_data(args: argparse.Namespace) -> int:
    from captioning.config import load_config

    return _check_data(load_config(args.config, args.overrides), quiet=args.quiet)


def _check_data(cfg: Config, quiet: bool) -> int:
    """Read ``cfg.data``, open every image once, print a report; 1 when an image is bad."""
    from captioning.data import build_vocabulary, drop_bad_images, load_splits

    splits = load_splits(cfg.data)
    # Report every bad file, whatever on_bad_image says; the verdict comes after.
    skip_cfg = type(cfg.data)(**{**vars(cfg.data), "on_bad_image": "skip"})
    total = sum(len(r) for r in splits.values())
    bad = drop_bad_images(splits, skip_cfg, progress=not quiet)
    vocab = build_vocabulary(splits, cfg.data)
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


def cmd_prepare_coco(args: argparse.Namespace) -> int:
    import shlex

    from captioning.config import load_config
    from captioning.prepare import prepare_coco

    overrides = prepare_coco(
        args.root,
        year=args.year,
        karpathy=args.karpathy,
        base_url=args.base_url,
        keep_archives=args.keep_archives,
        progress=not args.quiet,
    )
    status = 0 if args.no_check else _check_data(load_config(None, overrides), args.quiet)
    # The shipped COCO configs read Karpathy's 2014 layout; any other needs its data keys.
    sets = overrides[:1] if args.karpathy else overrides
    print(f"COCO {args.year} is ready in {args.root}; train on it with")
    print(
        "  captioning train --config configs/coco_soft_vgg19.yaml "
        + " ".join(f"--set {shlex.quote(o)}" for o in sets)
    )
    return status


def cmd_prepare_folder(args: argparse.Namespace) -> int:
    import shlex

    from captioning.prepare import prepare_folder

    summary = prepare_folder(
        args.images,
        args.captions,
        args.out,
        val=args.val,
        test=args.test,
        seed=args.seed,
        progress=not args.quiet,
        format=args.format,
    )
    counts = ", ".join(
        f"{s} {n} ({summary.captions[s]} captions)" for s, n in summary.images.items()
    )
    print(f"wrote {summary.out_dir}: images {counts}")
    print(
        f"read {args.captions} as {summary.format}: {len(summary.skipped)} rows skipped, "
        f"{len(summary.uncaptioned)} images without a caption (each listed in "
        f"{summary.report})"
    )
    print("train on it with")
    print(
        f"  captioning train --config configs/photos_soft_vgg19.yaml "
        f"--set {shlex.quote('data.root=' + summary.out_dir)}"
    )
    return 0


def _print_flickr(summary, captions: str, config: str) -> None:  # noqa: ANN001
    import shlex

    counts = ", ".join(
        f"{s} {n} ({summary.captions[s]} captions)" for s, n in summary.images.items()
    )
    print(f"wrote {summary.out_dir}: images {counts}")
    print(
        f"read {captions}: {len(summary.skipped)} rows skipped, "
        f"{len(summary.uncaptioned)} images without a caption, "
        f"{len(summary.split_problems)} split-file problems (each listed in "
        f"{summary.report})"
    )
    print("train on it with")
    print(
        f"  captioning train --config {config} --set {shlex.quote('data.root=' + summary.out_dir)}"
    )


def cmd_prepare_flickr8k(args: argparse.Namespace) -> int:
    from captioning.prepare.flickr import FLICKR8K_TOKENS, prepare_flickr8k

    summary = prepare_flickr8k(args.images, args.text, args.out, progress=not args.quiet)
    _print_flickr(summary, f"{args.text}/{FLICKR8K_TOKENS}", "configs/flickr8k_best.yaml")
    return 0


def cmd_prepare_flickr30k(args: argparse.Namespace) -> int:
    from captioning.prepare.flickr import prepare_flickr

    splits = {"train": args.train, "val": args.val, "test": args.test}
    summary = prepare_flickr(
        args.images, args.captions, splits, args.out, progress=not args.quiet, verb="flickr30k"
    )
    _print_flickr(summary, args.captions, "configs/flickr8k_mobilenet.yaml")
    return 0


def cmd_train(args: argparse.Namespace) -> int:
    from captioning.config import load_config
    from captioning.training.train import fit

    overrides = list(args.overrides)
    if args.quiet:
        overrides.append("train.quiet=true")
    cfg = load_config(args.config, overrides)
    out_dir = args.out or Path("runs") / Path(args.config).stem
    fit(cfg, out_dir=out_dir, resume=args.resume, init=args.init)
    return 0


def cmd_extract_features(args: argparse.Namespace) -> int:
    from captioning.config import load_config
    from captioning.data.feature_cache import extract_features

    cfg = load_config(args.config, args.overrides)
    summary = extract_features(
        cfg,
        args.split,
        batch_size=args.batch_size,
        progress=not args.quiet,
        overwrite=args.overwrite,
    )
    gib = summary["bytes"] / 2**30
    print(
        f"cached {summary['images']} {args.split} grids {summary['shape'][1:]} "
        f"(float16, {gib:.2f} GiB) in {summary['folder']}"
    )
    print("training with this config (model.fine_tune=none) now reads them")
    return 0


def cmd_evaluate(args: argparse.Namespace) -> int:
    from captioning.evaluate import evaluate_checkpoint, format_table

    metrics = evaluate_checkpoint(
        args.checkpoint,
        split=args.split,
        beam_size=args.beam_size,
        out_dir=args.out,
        data_root=args.data_root,
        hard_context=args.hard_context,
        max_images=args.max_images,
        spice=args.spice,
        progress=not args.quiet,
        device=args.device,
        overrides=args.overrides,
        category_words=args.category_words,
    )
    print(format_table(metrics))
    if "grounding" in metrics:
        print(grounding_line(metrics["grounding"]))
        references = metrics["grounding"].get("references")
        if references is not None:
            print(grounding_line(references, "the references, teacher-forced"))
    if args.out:
        also = " and grounding.json" if "grounding" in metrics else ""
        print(f"wrote {args.out}/metrics.json, predictions.json{also}")
    return 0


def grounding_line(grounding: dict, words: str = "the captions") -> str:
    """One line of ``grounding.json``: the words scored and each map's pointing game."""
    overall = grounding["overall"]
    maps = [k for k in overall if k != "words"]
    shown = ", ".join(f"{k} {overall[k]['pointing']:.3f}" for k in maps)
    return f"grounding of {words}: {overall['words']} words name an object of their image; " + (
        f"pointing game {shown}" if maps else "none to score"
    )


def cmd_caption(args: argparse.Namespace) -> int:
    from captioning.api import load
    from captioning.folders import claim_folder
    from captioning.inference.caption import CAPTION

    if args.per_head and not args.attention_dir:
        raise ConfigError("--per-head writes its figures into --attention-dir: give one")
    if args.instances and not args.attention_dir:
        raise ConfigError(
            "--instances outlines object boxes in the figures of --attention-dir: give one"
        )
    if args.attention_dir:
        _check_folder_path(Path(args.attention_dir), "--attention-dir")
    boxes = _object_boxes(args)
    model = load(args.checkpoint, args.device)
    if args.per_head and model.heads == 1:
        raise ConfigError(
            f"--per-head draws each attention head, but {args.checkpoint} has a single head: "
            "give a multi-head checkpoint (trained with --set model.heads=H, H > 1), or leave "
            "out --per-head"
        )
    if not args.attention_dir:
        return _caption(model, args, None, boxes)
    with claim_folder(args.attention_dir, CAPTION, "--attention-dir") as out:
        return _caption(model, args, out, boxes)


def _object_boxes(args: argparse.Namespace) -> Callable[[Caption], list | None]:
    """Per caption, each word's boxes of the objects it names, from ``--instances`` (None
    for an image the file does not list, or without the option)."""
    if not args.instances:
        return lambda result: None
    from captioning.data.coco import read_instance_images
    from captioning.metrics.pointing import word_boxes
    from captioning.metrics.words import load_category_words

    images = read_instance_images(args.instances)
    words = load_category_words(args.category_words)

    def boxes(result: Caption) -> list | None:
        found = images.get(Path(result.source).name)
        if found is None:
            logger.info("%s is not in %s: its figure has no boxes", result.source, args.instances)
            return None
        size, objects = found
        return word_boxes(result.words, objects, size, words)

    return boxes


def _caption(
    model: CaptionModel,
    args: argparse.Namespace,
    out: Path | None,
    boxes: Callable[[Caption], list | None],
) -> int:
    """Caption ``args.images`` and print each; figures into ``out`` (held) when given, with
    each word's object ``boxes``; 2 when an image could not be captioned."""
    import json

    from captioning.api import Failed
    from captioning.inference.caption import figure_stem

    decoding = dict(beam_size=args.beam_size, hard_context=args.hard_context)
    # Letters as they are; \u escapes only where stdout was forced to another encoding.
    escape = not _is_utf8(sys.stdout)
    failures = 0
    used: set[str] = set()
    for result in model.caption_each(args.images, **decoding):
        if isinstance(result, Failed):
            failures += 1
            print(f"error: {result.error}", file=sys.stderr)
            if args.json:
                line = json.dumps(
                    {"image": result.source, "error": result.error}, ensure_ascii=escape
                )
                print(line, flush=True)
            continue
        record = {"image": result.source, "caption": result.caption}
        if out is not None and result.words:  # an empty caption has nothing to show
            stem = figure_stem(result.source, used)
            record["attention"] = str(
                result.save(out / f"{stem}.png", not args.no_smooth, boxes=boxes(result))
            )
            if args.gif:
                result.save_gif(out / f"{stem}.gif", smooth=not args.no_smooth)
            if args.per_head:
                path = result.save_heads(out / f"{stem}_heads.png", not args.no_smooth)
                record["heads_figure"] = str(path)
        if args.json:
            record.update(result.extras())
            print(json.dumps(record, ensure_ascii=escape), flush=True)
        else:
            print(f"{result.source}: {result.caption}", flush=True)
    return 2 if failures else 0


def _check_folder_path(path: Path, flag: str) -> None:
    """Refuse a folder to write into that is, or lies under, a file (made later if missing)."""
    existing = next((p for p in (path, *path.parents) if p.exists()), None)
    if existing is not None and not existing.is_dir():
        raise ConfigError(
            f"{flag} {path}: {existing} is a file, not a folder; name a folder "
            f"(it is made when missing)"
        )


def cmd_quickstart(args: argparse.Namespace) -> int:
    from captioning.quickstart import quickstart

    quickstart(
        out_dir=args.out,
        data_root=args.data_root,
        config=args.config,
        overrides=args.overrides,
        quiet=args.quiet,
        meteor=args.meteor,
    )
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    from captioning.serve import require

    require()
    from captioning.serve.server import serve

    serve(
        args.checkpoint,
        host=args.host,
        port=args.port,
        max_upload_mb=args.max_upload_mb,
        device=args.device,
        quiet=args.quiet,
        allow_hosts=args.allow_host,
        max_in_flight=args.max_in_flight,
        max_queue=args.max_queue,
        timeout=args.timeout,
        max_batch=args.max_batch,
        batch_wait_ms=args.batch_wait_ms,
    )
    return 0


def _port(text: str) -> int:
    if not text.isdigit() or not 0 < int(text) < 65536:
        raise argparse.ArgumentTypeError(f"must be a port number from 1 to 65535, got {text!r}")
    return int(text)


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text!r}")
    return value


# --------------------------------------------------------------------------- parser


def _verb_adder(sub: argparse._SubParsersAction) -> Callable[..., argparse.ArgumentParser]:
    def add_verb(name: str, help: str) -> argparse.ArgumentParser:
        verb = sub.add_parser(name, help=help, description=help)
        verb.add_argument(
            "--quiet", dest="verb_quiet", action="store_true", help="no progress bars"
        )
        return verb

    return add_verb


def _fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 <= value < 1:
        raise argparse.ArgumentTypeError(f"must be a fraction from 0 to below 1, got {text!r}")
    return value


def _add_prepare(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="what", required=True, metavar="WHAT")
    add = _verb_adder(sub)
    p = add("coco", help="download and unpack COCO (and Karpathy's split), then check it")
    p.add_argument("--root", default="data/coco", help="dataset folder (default data/coco)")
    p.add_argument("--year", choices=["2014", "2017"], default="2014")
    p.add_argument(
        "--karpathy",
        action="store_true",
        help="also Karpathy's split file dataset_coco.json (2014 only)",
    )
    p.add_argument(
        "--base-url", default=None, help="fetch every file as BASE_URL/NAME (a mirror) instead"
    )
    p.add_argument("--keep-archives", action="store_true", help="keep the zips once unpacked")
    p.add_argument(
        "--no-check",
        action="store_true",
        help="do not run check-data afterwards (it opens every image)",
    )
    p.set_defaults(func=cmd_prepare_coco)
    p = add("folder", help="your images and a caption file into a COCO-style dataset")
    p.add_argument("--images", required=True, help="folder the caption file's paths are in")
    p.add_argument(
        "--captions",
        required=True,
        metavar="FILE",
        help="caption file: CSV/TSV with columns image,caption, JSONL, NAME,CAPTION "
        "lines, a Flickr token file or a COCO captions json",
    )
    p.add_argument(
        "--format",
        default="auto",
        choices=["auto", "csv", "tsv", "jsonl", "lines", "flickr", "coco"],
        help="caption file format (default auto: told from the content)",
    )
    p.add_argument("--out", required=True, help="new dataset folder")
    p.add_argument("--val", type=_fraction, default=0.1, help="share of images (default 0.1)")
    p.add_argument("--test", type=_fraction, default=0.1, help="share of images (default 0.1)")
    p.add_argument("--seed", type=int, default=0, help="seed of the split (default 0)")
    p.set_defaults(func=cmd_prepare_folder)
    p = add("flickr8k", help="Flickr8k as downloaded, with its official split")
    p.add_argument(
        "--images",
        required=True,
        metavar="DIR",
        help="the unpacked image archive, Flicker8k_Dataset",
    )
    p.add_argument(
        "--text", required=True, metavar="DIR", help="the unpacked text release, Flickr8k_text"
    )
    p.add_argument("--out", required=True, help="new dataset folder")
    p.set_defaults(func=cmd_prepare_flickr8k)
    p = add("flickr30k", help="Flickr30k's token file with split files of image names")
    p.add_argument("--images", required=True, metavar="DIR", help="flickr30k-images")
    p.add_argument(
        "--captions", required=True, metavar="FILE", help="results_20130124.token or results.csv"
    )
    for split in ("train", "val", "test"):
        p.add_argument(
            f"--{split}",
            required=True,
            metavar="FILE",
            help=f"the {split} split: image names or ids, one a line",
        )
    p.add_argument("--out", required=True, help="new dataset folder")
    p.set_defaults(func=cmd_prepare_flickr30k)


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
    p.add_argument(
        "--train", type=positive_int, default=8000, help="training images (default 8000)"
    )
    p.add_argument("--val", type=positive_int, default=500, help="validation images (default 500)")
    p.add_argument("--test", type=positive_int, default=500, help="test images (default 500)")
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

    _add_prepare(
        add_verb(
            "prepare", help="download COCO, read Flickr8k/30k, or make a dataset of your photos"
        )
    )

    p = add_verb("train", help="train a captioning model")
    _add_config_args(p)
    p.add_argument("--out", default=None, help="run folder (default runs/<config name>)")
    p.add_argument("--resume", default=None, metavar="CKPT", help="continue from a checkpoint")
    p.add_argument(
        "--init",
        default=None,
        metavar="CKPT",
        help="start a new run from a checkpoint's weights (fresh optimiser and schedule), "
        "e.g. self-critical training from a cross-entropy model",
    )
    p.set_defaults(func=cmd_train)

    p = add_verb("extract-features", help="cache a frozen encoder's grids (float16) on disk")
    _add_config_args(p)
    p.add_argument("--split", default="train", choices=["train", "val", "test"])
    p.add_argument(
        "--batch-size", type=positive_int, default=None, help="default: train.batch_size"
    )
    p.add_argument("--overwrite", action="store_true", help="replace an existing cache")
    p.set_defaults(func=cmd_extract_features)

    _add_evaluate(add_verb("evaluate", help="decode a split with a checkpoint and score it"))

    _add_caption(add_verb("caption", help="caption image files and draw per-word attention"))

    p = add_verb("quickstart", help="shapes data, a short training run, evaluation, heatmaps")
    p.add_argument("--out", default="runs/quickstart", help="run folder: new, empty or its own")
    p.add_argument("--data-root", default="data/shapes", help="where the shapes data lives")
    p.add_argument(
        "--meteor",
        action="store_true",
        help="also METEOR in the test evaluation (a Java run, about 10 s)",
    )
    _add_config_args(p, required=False)
    p.set_defaults(func=cmd_quickstart)

    _add_serve(add_verb("serve", help="a web page and a JSON API that caption uploaded images"))
    return parser


def _add_evaluate(p: argparse.ArgumentParser) -> None:
    _add_checkpoint_args(p)
    p.add_argument("--split", default="test", choices=["train", "val", "test"])
    p.add_argument(
        "--out",
        default=None,
        help="folder for metrics.json, predictions.json and, where the data has "
        "instance boxes, grounding.json",
    )
    p.add_argument("--data-root", default=None, help="read the data from here instead")
    p.add_argument("--max-images", type=positive_int, default=None, help="score only the first N")
    p.add_argument("--spice", action="store_true", help="also SPICE (downloads its models)")
    add_set_option(
        p,
        "override a data, decode or runtime key of the checkpoint's config, "
        "e.g. --set data.root=DIR (repeatable)",
    )
    _add_category_words(p)
    p.set_defaults(func=cmd_evaluate)


def _add_category_words(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--category-words",
        default=None,
        metavar="FILE",
        help="a JSON or YAML file of word: category entries (null drops a word) "
        "over the shipped map of words to COCO categories",
    )


def _add_caption(p: argparse.ArgumentParser) -> None:
    p.add_argument("images", nargs="+", metavar="IMG", help="image files (JPEG, PNG, WebP, ...)")
    _add_checkpoint_args(p)
    p.add_argument("--attention-dir", default=None, help="write per-word heatmaps here")
    p.add_argument("--gif", action="store_true", help="also an animated GIF per image")
    p.add_argument("--no-smooth", action="store_true", help="blocky cells, not interpolated")
    p.add_argument(
        "--per-head",
        action="store_true",
        help="multi-head models: also a figure of each head's maps per word "
        "(NAME_heads.png in --attention-dir)",
    )
    p.add_argument(
        "--json",
        action="store_true",
        help="one JSON object per line (with hard attention's cells, multi-head "
        "weights and local centres, null for other models)",
    )
    p.add_argument(
        "--instances",
        default=None,
        metavar="FILE",
        help="a COCO instances file: in each figure of an image it lists (by file "
        "name), outline the boxes of the objects each word names",
    )
    _add_category_words(p)
    p.set_defaults(func=cmd_caption)


def _add_serve(p: argparse.ArgumentParser) -> None:
    p.add_argument("--checkpoint", required=True, help="a best.pt or last.pt file")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=_port, default=8000, help="port (default 8000)")
    p.add_argument(
        "--max-upload-mb",
        type=_positive_float,
        default=10.0,
        help="the largest upload taken, in MB (default 10)",
    )
    p.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:1, ...")
    p.add_argument(
        "--allow-host",
        action="append",
        default=[],
        metavar="NAME",
        help="answer requests for this Host name too (repeat; '*' for any); "
        "by default only --host's own (and loopback names)",
    )
    p.add_argument(
        "--max-in-flight",
        type=positive_int,
        default=32,
        help="caption requests worked on at once (default 32)",
    )
    p.add_argument(
        "--max-queue",
        type=int,
        default=256,
        help="requests waiting for one; past it, 503 at once (default 256)",
    )
    p.add_argument(
        "--timeout",
        type=_positive_float,
        default=30.0,
        help="seconds from a request's arrival to its answer (default 30)",
    )
    p.add_argument(
        "--max-batch",
        type=positive_int,
        default=16,
        help="the most images captioned together (default 16)",
    )
    p.add_argument(
        "--batch-wait-ms",
        type=float,
        default=5.0,
        help="how long to gather concurrent requests (default 5)",
    )
    p.set_defaults(func=cmd_serve)


def _run(argv: Sequence[str] | None) -> int:
    _utf8_output()
    parser = build_parser()
    args = parser.parse_args(argv)
    # `--quiet` may come before or after the verb
    args.quiet = args.quiet or bool(getattr(args, "verb_quiet", False))
    _setup_logging()
    func: Callable[[argparse.Namespace], int] = args.func
    return func(args)


def main(argv: Sequence[str] | None = None) -> int:
    try:
        with stops_on_signals():  # from the first line: parsing the command line included
            return _run(argv)
    except CaptioningError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except Terminated:  # SIGTERM
        print("terminated", file=sys.stderr)
        return 143
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
