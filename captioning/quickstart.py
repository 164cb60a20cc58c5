"""The whole pipeline on shapes in a few minutes: data, training, evaluation, heatmaps.

The quickstart's folder (``--out``) is its own: a new or empty folder, or one that an
earlier quickstart wrote (its marker says so). Run again into it, the quickstart takes the
folder's lock, then removes what the earlier run wrote, and nothing else.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any

from captioning.api import load
from captioning.config import Config, load_config
from captioning.data import load_splits
from captioning.data.shapes import generate_shapes
from captioning.evaluate import evaluate_checkpoint, format_table
from captioning.files import write_atomically
from captioning.folders import LOCK, Writer, claim_folder, holds_only
from captioning.inference.caption import CAPTION, figure_stem
from captioning.training.run_folder import CONFIG_FILE, SHAPES
from captioning.training.train import fit

logger = logging.getLogger("captioning")

DEFAULT_CONFIG = Path(__file__).resolve().parent.parent / "configs" / "shapes_soft.yaml"
# The shipped shapes config is itself the short schedule (2 to 2.5 minutes on two CPU cores).
QUICK_OVERRIDES: list[str] = []
SUMMARY = "quickstart.json"
# Written before folders were marked, a quickstart's folder held only these.
WRITTEN = (
    LOCK,
    CONFIG_FILE,
    "best.pt",
    "last.pt",
    "events.out.tfevents.*",
    "figures",
    "eval",
    "attention",
    SUMMARY,
    ".*.pt.*.tmp",
)
QUICKSTART = Writer("quickstart", holds_only(WRITTEN, SUMMARY))
# The files an earlier quickstart wrote (besides the attention figures its summary lists).
EARLIER = (
    CONFIG_FILE,
    "best.pt",
    "last.pt",
    "events.out.tfevents.*",
    "figures/epoch_*.png",
    "eval/metrics.json",
    "eval/predictions.json",
    SUMMARY,
)


def quickstart(
    out_dir: str | Path = "runs/quickstart",
    data_root: str | Path = "data/shapes",
    config: str | Path | None = None,
    overrides: list[str] | None = None,
    num_examples: int = 3,
    quiet: bool = False,
    meteor: bool = False,
) -> dict[str, Any]:
    """Generate shapes if absent, train the default soft model briefly, evaluate it on the
    test split, and caption ``num_examples`` test images with per-word heatmaps.

    METEOR (a Java process, about 10 s on 500 images) is left out unless ``meteor``;
    ``captioning evaluate`` computes it.

    Returns a summary with the paths of everything written. ``out_dir`` must be new, empty
    or an earlier quickstart's, whose outputs are replaced (see the module docstring).

    Raises:
        CaptioningError: ``out_dir`` or ``data_root`` holds files that are not the
            quickstart's (or the shapes generator's), or is in use by another command.
    """
    started = time.time()
    data_root = Path(data_root)
    if not (data_root / "annotations" / "captions_train.json").is_file():
        logger.info("writing the shapes dataset to %s", data_root)
        with claim_folder(data_root, SHAPES, "--data-root"):
            generate_shapes(data_root, seed=0, progress=not quiet)
    cfg_path = Path(config) if config else DEFAULT_CONFIG
    settings = [*QUICK_OVERRIDES, f"data.root={data_root}", *(overrides or [])]
    if quiet:
        settings.append("train.quiet=true")
    cfg = load_config(cfg_path, settings)
    out_dir = Path(out_dir)
    with claim_folder(out_dir, QUICKSTART):
        removed = remove_earlier_run(out_dir)
        if removed:
            logger.info(
                "removed the %d files an earlier quickstart wrote in %s", len(removed), out_dir
            )
        # Marked as the caption verb's: `captioning caption --attention-dir` may add to it.
        with claim_folder(out_dir / "attention", CAPTION, "--attention-dir") as figures:
            summary, metrics = _run(cfg, out_dir, figures, num_examples, quiet, meteor)
        summary["total_seconds"] = time.time() - started
        write_atomically(out_dir / SUMMARY, json.dumps(summary, indent=2) + "\n")
    _report(summary, metrics)
    return summary


def remove_earlier_run(out_dir: Path) -> list[Path]:
    """Remove what an earlier quickstart wrote into ``out_dir`` (held by the caller): its
    training's config, checkpoints, events and figures, its evaluation, the attention
    figures its summary lists, and the summary. Anything else in the folder stays. Returns
    the files removed."""
    paths = [p for pattern in EARLIER for p in sorted(out_dir.glob(pattern))]
    paths += _listed_figures(out_dir)
    removed = [path for path in paths if path.is_file()]
    for path in removed:
        path.unlink()
    return removed


def _listed_figures(out_dir: Path) -> list[Path]:
    """The attention figures an earlier quickstart's summary lists, in ``out_dir/attention``."""
    try:
        examples = json.loads((out_dir / SUMMARY).read_text(encoding="utf-8"))["examples"]
        figures = [Path(e["attention"]).name for e in examples if e.get("attention")]
    except (OSError, ValueError, TypeError, KeyError, AttributeError):
        return []  # no summary (the earlier run stopped before it), or not a readable one
    return [out_dir / "attention" / name for name in figures if name.endswith(".png")]


def _run(
    cfg: Config, out_dir: Path, figures: Path, num_examples: int, quiet: bool, meteor: bool
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Train into ``out_dir``, evaluate on the test split, caption a few test images with
    their attention drawn into ``figures``; returns the summary and the metrics."""
    training = fit(cfg, out_dir=out_dir)
    checkpoint = out_dir / "best.pt"
    metrics = evaluate_checkpoint(
        checkpoint, split="test", out_dir=out_dir / "eval", progress=not quiet, meteor=meteor
    )
    if not meteor:
        metrics.pop("METEOR", None)  # not "missing": it was not asked for
    model = load(checkpoint, cfg.train.device)
    test = load_splits(model.config.data)["test"]
    paths = [r.path for r in test[:num_examples]]
    examples, used = [], set()
    for result in model.caption(paths):
        stem = figure_stem(result.source, used)
        # an empty caption has no heatmap to show
        figure = result.save(figures / f"{stem}.png") if result.words else None
        examples.append(
            {"image": result.source, "caption": result.caption, "attention": figure and str(figure)}
        )
    summary = {
        "run": str(out_dir),
        "checkpoint": str(checkpoint),
        "train_seconds": training["seconds"],
        "metrics": str(out_dir / "eval" / "metrics.json"),
        "examples": examples,
    }
    return summary, metrics


def _report(summary: dict[str, Any], metrics: dict[str, Any]) -> None:
    out_dir, checkpoint = summary["run"], summary["checkpoint"]
    print(f"\nTest split ({metrics['num_images']} images), greedy decoding:")
    print(format_table(metrics))
    print("\nThree test images:")
    for example in summary["examples"]:
        print(f"  {example['image']}: {example['caption']}")
        print(f"    attention: {example['attention']}")
    print(f"\nrun folder: {out_dir} (config.yaml, best.pt, last.pt, TensorBoard events, figures/)")
    print(f"metrics:    {summary['metrics']} and predictions.json")
    print(
        f"caption your own images: captioning caption IMG --checkpoint {checkpoint} "
        f"--attention-dir {Path(out_dir) / 'attention'}"
    )
    print(f"done in {summary['total_seconds']:.0f}s")
