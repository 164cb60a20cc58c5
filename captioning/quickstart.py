"""The whole pipeline on shapes in a few minutes: data, training, evaluation, heatmaps."""

from __future__ import annotations

import json
import logging
import shutil
import time
from pathlib import Path
from typing import Any

from captioning.api import load
from captioning.config import load_config
from captioning.data import load_splits
from captioning.data.shapes import generate_shapes
from captioning.evaluate import evaluate_checkpoint, format_table
from captioning.inference import figure_stem
from captioning.train import fit

logger = logging.getLogger("captioning")

DEFAULT_CONFIG = Path(__file__).resolve().parent.parent / "configs" / "shapes_soft.yaml"
# The shipped shapes config is itself the short schedule (2 to 2.5 minutes on two CPU cores).
QUICK_OVERRIDES: list[str] = []


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

    Returns a summary with the paths of everything written; ``out_dir`` is replaced.
    """
    started = time.time()
    data_root = Path(data_root)
    if not (data_root / "annotations" / "captions_train.json").is_file():
        logger.info("writing the shapes dataset to %s", data_root)
        generate_shapes(data_root, seed=0, progress=not quiet)
    cfg_path = Path(config) if config else DEFAULT_CONFIG
    settings = [*QUICK_OVERRIDES, f"data.root={data_root}", *(overrides or [])]
    if quiet:
        settings.append("train.quiet=true")
    cfg = load_config(cfg_path, settings)
    out_dir = Path(out_dir)
    if out_dir.exists():
        shutil.rmtree(out_dir)  # the quickstart owns its folder
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
        figure = result.save(out_dir / "attention" / f"{stem}.png") if result.words else None
        examples.append({"image": result.source, "caption": result.caption,
                         "attention": figure and str(figure)})  # fmt: skip
    summary = {
        "run": str(out_dir),
        "checkpoint": str(checkpoint),
        "train_seconds": training["seconds"],
        "total_seconds": time.time() - started,
        "metrics": str(out_dir / "eval" / "metrics.json"),
        "examples": examples,
    }
    (out_dir / "quickstart.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(f"\nTest split ({metrics['num_images']} images), greedy decoding:")
    print(format_table(metrics))
    print("\nThree test images:")
    for example in examples:
        print(f"  {example['image']}: {example['caption']}")
        print(f"    attention: {example['attention']}")
    print(f"\nrun folder: {out_dir} (config.yaml, best.pt, last.pt, TensorBoard events, figures/)")
    print(f"metrics:    {out_dir / 'eval' / 'metrics.json'} and predictions.json")
    print(f"caption your own images: captioning caption IMG --checkpoint {checkpoint} "
          f"--attention-dir {out_dir / 'attention'}")  # fmt: skip
    print(f"done in {summary['total_seconds']:.0f}s")
    return summary
