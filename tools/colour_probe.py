"""The colour probe: whether a shapes model's grid features still say each object's colour.

A logistic regression from the feature under each object's centre to the object's colour,
fit on the objects of the first images and scored on the rest (chance: one over the
colours). ``tools.seed_study`` reads it from a finished model's grid, ``tools.colour_trace``
from every encoder stage over the first training steps.
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

import torch
from PIL import Image

from captioning.api import load

PROBE_IMAGES = 400  # the first validation images whose objects the probe reads
PROBE_FIT = 2 / 3  # the share of those objects (in image order) the probe is fit on
PROBE_STEPS, PROBE_SEED = 500, 0


def colour_probe(
    features: torch.Tensor,
    labels: torch.Tensor,
    *,
    classes: int,
    fit_share: float = PROBE_FIT,
    steps: int = PROBE_STEPS,
    seed: int = PROBE_SEED,
) -> float:
    """Held-out accuracy of a multinomial logistic regression from ``features`` to ``labels``.

    The first ``fit_share`` of the rows (in the order given, so that held-out objects come from
    held-out images) are standardised with their own mean and deviation, then fit by Adam
    (``steps`` full-batch steps, learning rate 0.05, L2 weight 1e-3) from zero weights; the
    rest are scored. Deterministic: the same inputs give the same number.

    Args:
        features: (N, D) one feature vector per object.
        labels: (N,) class indices in ``0 .. classes - 1``.
        classes: the number of classes (chance is ``1 / classes`` for balanced labels).
        fit_share: the share of rows fit on; the others are held out.
        steps: optimiser steps.
        seed: the seed of the generator that the fit runs under.
    """
    n = int(len(labels) * fit_share)
    if n < 1 or n >= len(labels):
        raise ValueError(f"the probe needs rows both to fit and to hold out, got {len(labels)}")
    features = features.detach().float()
    mean, std = features[:n].mean(0), features[:n].std(0)
    x = (features - mean) / (std + 1e-6)  # (N, D)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        weight = torch.zeros(x.shape[1], classes, requires_grad=True)  # (D, C)
        bias = torch.zeros(classes, requires_grad=True)  # (C,)
        optimiser = torch.optim.Adam([weight, bias], lr=0.05)
        with torch.enable_grad():
            for _ in range(steps):
                optimiser.zero_grad()
                logits = x[:n] @ weight + bias  # (n, C)
                loss = torch.nn.functional.cross_entropy(logits, labels[:n])
                (loss + 1e-3 * weight.pow(2).sum()).backward()
                optimiser.step()
    with torch.no_grad():
        predicted = (x[n:] @ weight + bias).argmax(1)  # (N - n,)
    return (predicted == labels[n:]).float().mean().item()


def centre_cell(bbox: list[float], width: int, height: int, rows: int, cols: int) -> int:
    """The flat index (row-major) of the grid cell under the centre of a COCO ``bbox``
    (x, y, w, h in the image's pixels), for an image resized whole onto a rows x cols grid."""
    x, y, w, h = bbox
    col = min(int((x + w / 2) / width * cols), cols - 1)
    row = min(int((y + h / 2) / height * rows), rows - 1)
    return row * cols + col


def object_features(
    checkpoint: Path, data_root: Path, images: int = PROBE_IMAGES, batch_size: int = 1
) -> tuple[torch.Tensor, torch.Tensor, list[str]]:
    """The decoder's grid feature at each object's centre cell, over the objects of the first
    ``images`` validation images: features (N, D), colour indices (N,) and the colour names
    (sorted). One image at a time by default: batched encoding moves the features by about
    1e-5, and on a stalled grid that moves the held-out score by a few objects."""
    instances = json.loads((data_root / "annotations" / "instances_val.json").read_text())
    objects = defaultdict(list)
    for annotation in instances["annotations"]:
        objects[annotation["image_id"]].append(annotation)
    colours = sorted({a["color"] for a in instances["annotations"]})
    loaded = load(checkpoint, device="cpu")
    rows, cols = loaded.grid_shape
    chosen = instances["images"][:images]
    features, labels = [], []
    for start in range(0, len(chosen), batch_size):
        batch = chosen[start : start + batch_size]
        pictures = [
            Image.open(data_root / "images" / "val" / image["file_name"]).convert("RGB")
            for image in batch
        ]
        inputs = torch.stack([loaded.prepare(p) for p in pictures])  # (B, 3, S, S) uint8
        with torch.no_grad():
            grid = loaded.model.encode(inputs).float()  # (B, L, D)
        for image, cells in zip(batch, grid):
            for annotation in objects[image["id"]]:
                cell = centre_cell(annotation["bbox"], image["width"], image["height"], rows, cols)
                features.append(cells[cell])  # (D,)
                labels.append(colours.index(annotation["color"]))
    return torch.stack(features), torch.tensor(labels), colours
