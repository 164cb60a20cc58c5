"""How :mod:`tools.grid_probe` scores its maps against COCO's boxes: the probe's classes of
a caption's words, and the pointing game and mass of each class's map on the ``coco_mini``
pairs and on the words of the photos' captions (the captioners' ``references`` words)."""

from __future__ import annotations

import re
from collections import defaultdict
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from captioning.data.records import ImageRecord
from captioning.data.vocab import tokenize
from captioning.metrics.pointing import Grid, Group, baseline_maps, box_coverage, category_boxes
from captioning.metrics.words import category_of, named_category, shipped_category_words

if TYPE_CHECKING:
    from tools.grid_probe import Probe

WORD = re.compile(r"[a-z]+")


def class_of(word: str, words: dict[str, str], classes: str) -> str | None:
    """The probe's class of ``word``: the category it names (``classes`` "categories"), or
    the word itself when it names one ("words"); None when it names none."""
    category = named_category(word, words)
    if category is None:
        return None
    return category if classes == "categories" else word


def caption_categories(
    captions: list[str], words: dict[str, str], classes: str = "categories"
) -> set[str]:
    """The classes (:func:`class_of`) some word of ``captions`` names."""
    found = set()
    for caption in captions:
        for word in WORD.findall(caption.lower()):
            key = class_of(word, words, classes)
            if key is not None:
                found.add(key)
    return found


def ground(
    probe: Probe,
    grids: torch.Tensor,
    records: list[ImageRecord],
    categories: list[str],
    grid_shape: tuple[int, int],
    classes: str = "categories",
) -> dict[str, Any]:
    """The pointing game and the mass in the boxes of each (photo, class) pair: the class
    (``categories``: a category; with ``classes`` "words", a word naming one) named in one
    of the photo's captions, probed, and its category among the photo's boxes; and of each
    word of the photo's captions whose class is probed and whose category is among its
    boxes (``references``: the words the captioners' ``references`` grounding scores, each
    with its class's map)."""
    words = shipped_category_words()
    overall: Group = Group()
    per_category: dict[str, Group] = defaultdict(Group)
    references: Group = Group()
    reference_categories: dict[str, Group] = defaultdict(Group)
    unprobed = 0
    with torch.no_grad():
        maps = probe.maps(grids).double().numpy()  # (N, L, C)
    for record, cells in zip(records, maps):
        boxes = category_boxes(record.objects)
        grid = Grid(*grid_shape, float(record.width), float(record.height))
        named = caption_categories(list(record.captions), words, classes) & set(categories)
        for key in sorted(named):
            category = key if classes == "categories" else words[key]
            if category in boxes:
                groups = (overall, per_category[category])
                _add_pair(groups, cells, categories.index(key), boxes[category], grid)
        for caption in record.captions:
            for word in tokenize(caption):
                category = category_of(word, words, set(boxes))
                if category is None:
                    continue
                key = category if classes == "categories" else word
                if key not in categories:
                    unprobed += 1
                    continue
                groups = (references, reference_categories[category])
                _add_pair(groups, cells, categories.index(key), boxes[category], grid)
    return {
        "overall": overall.summary(),
        "categories": {c: g.summary() for c, g in sorted(per_category.items())},
        "references": {
            "overall": references.summary(),
            "categories": {c: g.summary() for c, g in sorted(reference_categories.items())},
            "unprobed_words": unprobed,
        },
    }


def _add_pair(
    groups: tuple[Group, ...],
    cells: np.ndarray,
    index: int,
    boxes: list[tuple[float, float, float, float]],
    grid: Grid,
) -> None:
    """Score class ``index``'s map of a photo's ``cells`` (L, C) and the baselines (the
    photo's saliency map: the mean of its classes' maps) against its category's ``boxes``."""
    coverage = box_coverage(boxes, grid)
    shown = {"probe": cells[:, index], **baseline_maps(grid, cells.mean(1))}
    for group in groups:
        group.words += 1
        for name, alpha in shown.items():
            group.maps[name].add_map(alpha, boxes, coverage, grid)
