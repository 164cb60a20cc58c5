"""Synthetic "shapes" captioning dataset, written in the exact COCO format.

Each image is a dark, noisy square with one to three coloured shapes (circle, square, triangle;
small or large) that never overlap. Every image gets five captions and one COCO instance
annotation per shape, so the same readers, metrics and attention visualisations that work on
COCO work here, in minutes on a CPU.

Layout on disk (``split`` is ``train``, ``val`` or ``test``)::

    out_dir/images/{split}/{split}_{index:06d}.png
    out_dir/annotations/captions_{split}.json    # COCO captions + "tokens", "object_ids"
    out_dir/annotations/instances_{split}.json   # COCO instances + "color", "size"

Caption modes:

* ``canonical`` (default): the five captions carry the same content in five fixed wordings.
  Objects are listed left to right as ``a {size} {colour} {shape}``; two objects are joined by a
  spatial relation (``to the left of``, ``above``, ``below``), three by ``A , B and C``. The
  target is deterministic given the image, so a good model can reach near-perfect scores.
* ``varied``: harder and noisier, closer to human captions. Each caption draws its own opener
  (``an image with``, ``there are``, ``a picture of`` ...), a random object order, optional size
  words and optional position phrases (``in the top left``, ``on the right``) from a 3x3 grid, or
  a relation for two objects. Everything said is still true of the image, but the references
  disagree with each other, so scores are lower and depend more on the decoding.

Every caption annotation also has ``tokens`` (:func:`captioning.data.vocab.tokenize` of the caption)
and ``object_ids``: for each token the id of the instance annotation it names (its colour, size
or shape word), ``None`` for every other word. That ground truth lets attention maps be scored
against the boxes of the objects the words refer to.

Generation is deterministic: each image draws from its own generator seeded with
``(seed, split, index)``, so the same arguments give byte-identical files, image ``i`` of a split
does not depend on how many images the split has, and both caption modes give the same images.
Ids are unique across the three splits: image ids run 1.. over train, then val, then test;
instance ids are ``(image_id - 1) * 3 + k + 1`` and caption ids ``(image_id - 1) * 5 + j + 1``.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from functools import cache, lru_cache, partial
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image, ImageDraw

from captioning.data.vocab import tokenize
from captioning.errors import DataError
from captioning.files import open_unlinked
from captioning.progress import progress_bar
from captioning.runtime import map_in_threads

# Bright, well-separated colours (nearest-colour lookup stays unambiguous under the jitter and
# noise), all far from the dark background.
COLORS: dict[str, tuple[int, int, int]] = {
    "red": (230, 40, 40),
    "green": (40, 200, 60),
    "blue": (50, 90, 245),
    "yellow": (240, 220, 40),
    "white": (245, 245, 245),
    "purple": (170, 60, 220),
}
SHAPES: tuple[str, ...] = ("circle", "square", "triangle")
SIZES: tuple[str, ...] = ("small", "large")
SPLITS: tuple[str, ...] = ("train", "val", "test")
CAPTION_MODES: tuple[str, ...] = ("canonical", "varied")
CAPTIONS_PER_IMAGE = 5
MAX_OBJECTS = 3
MIN_IMAGE_SIZE = 48
CATEGORIES: list[dict[str, Any]] = [
    {"id": i + 1, "name": name, "supercategory": "shape"} for i, name in enumerate(SHAPES)
]

# Pixel distances are given at 96 px and scaled linearly with the image size.
_REFERENCE_SIZE = 96
_DIAMETER_PX = {"small": (14, 18), "large": (26, 32)}
_MARGIN_PX = 2.0  # gap between two boxes, and between a box and the image border
_MIN_DX_PX = 6.0  # horizontal centre gap: left-to-right order is never ambiguous
_RELATION_RATIO = 1.5  # two objects: the dominant axis offset is >= 1.5x the other one
_POSITION_TRIES = 50  # per object, before the whole layout is resampled
_LAYOUT_TRIES = 1000
_BACKGROUND_LEVELS = (15, 45)  # per-image grey level, inclusive
_NOISE_STD = 6.0
_BRIGHTNESS_JITTER = (0.85, 1.0)
_COUNT_WORDS = {1: "one", 2: "two", 3: "three"}
_SPLIT_CODES = {split: code for code, split in enumerate(SPLITS)}
_CIRCLE_POLYGON_POINTS = 16
_WORKERS = min(8, os.cpu_count() or 1)
_INFO = {
    "description": "Synthetic shapes captioning dataset (captioning.data.shapes)",
    "version": "1.0",
    "contributor": "captioning",
    "url": "",
}

# Varied mode: how often each optional part is used.
_P_OMIT_SIZE = 0.4
_P_POSITION = 0.5
_P_RELATION = 0.5  # two objects: say a relation instead of listing them
_GRID_ROWS = ("top", "middle", "bottom")
_GRID_COLS = ("left", "center", "right")
_POSITION_PHRASES = {
    ("top", "left"): "in the top left",
    ("top", "center"): "at the top",
    ("top", "right"): "in the top right",
    ("middle", "left"): "on the left",
    ("middle", "center"): "in the middle",
    ("middle", "right"): "on the right",
    ("bottom", "left"): "in the bottom left",
    ("bottom", "center"): "at the bottom",
    ("bottom", "right"): "in the bottom right",
}

# A caption is built from pieces: one word (or punctuation mark) and the instance id it names.
Piece = tuple[str, int | None]


@dataclass(frozen=True)
class ShapeObject:
    """One drawn shape.

    Args:
        ann_id: the id of its instance annotation.
        shape: one of :data:`SHAPES`.
        color: one of the names in :data:`COLORS`.
        size: ``small`` or ``large``.
        bbox: tight ``(x, y, width, height)`` of the drawn pixels.
    """

    ann_id: int
    shape: str
    color: str
    size: str
    bbox: tuple[float, float, float, float]

    @property
    def cx(self) -> float:
        return self.bbox[0] + self.bbox[2] / 2

    @property
    def cy(self) -> float:
        return self.bbox[1] + self.bbox[3] / 2


# ----------------------------------------------------------------------------------------------
# Captions
# ----------------------------------------------------------------------------------------------


def _words(text: str) -> list[Piece]:
    """Pieces for words that name no object."""
    return [(word, None) for word in text.split()]


def _object_words(obj: ShapeObject, with_size: bool = True) -> list[Piece]:
    """``a [size] colour shape``, each attribute word pointing at the object."""
    pieces: list[Piece] = [("a", None)]
    if with_size:
        pieces.append((obj.size, obj.ann_id))
    pieces += [(obj.color, obj.ann_id), (obj.shape, obj.ann_id)]
    return pieces


def _relation(a: ShapeObject, b: ShapeObject) -> str:
    """Where ``a`` is relative to ``b``, along the axis with the larger centre offset."""
    dx, dy = b.cx - a.cx, b.cy - a.cy
    if abs(dx) >= abs(dy):
        return "to the left of" if dx > 0 else "to the right of"
    return "above" if dy > 0 else "below"


def _join_list(parts: Sequence[list[Piece]]) -> list[Piece]:
    """``A``, ``A and B`` or ``A , B and C``."""
    pieces: list[Piece] = []
    for i, part in enumerate(parts):
        if i == len(parts) - 1 and i > 0:
            pieces.append(("and", None))
        elif i > 0:
            pieces.append((",", None))
        pieces += part
    return pieces


def _canonical_content(objects: Sequence[ShapeObject]) -> list[Piece]:
    """Objects left to right; two objects are joined by their relation."""
    ordered = sorted(objects, key=lambda o: o.cx)
    if len(ordered) == 2:
        left, right = ordered
        return _object_words(left) + _words(_relation(left, right)) + _object_words(right)
    return _join_list([_object_words(o) for o in ordered])


def _count_words(n: int) -> list[Piece]:
    return _words(f"{_COUNT_WORDS[n]} {'shape' if n == 1 else 'shapes'} :")


def _canonical_captions(objects: Sequence[ShapeObject]) -> list[list[Piece]]:
    """The same content in the five fixed wordings, always in this order."""
    content = _canonical_content(objects)
    return [
        content,
        _words("there is") + content,
        _count_words(len(objects)) + content,
        _words("from left to right :") + content,
        content + _words("on a dark background"),
    ]


def _position_phrase(obj: ShapeObject, image_size: int) -> str:
    """The 3x3 grid cell of the object's centre, in words."""
    row = _GRID_ROWS[min(int(obj.cy * 3 / image_size), 2)]
    col = _GRID_COLS[min(int(obj.cx * 3 / image_size), 2)]
    return _POSITION_PHRASES[(row, col)]


def _varied_object(
    obj: ShapeObject, rng: np.random.Generator, image_size: int, allow_position: bool
) -> list[Piece]:
    with_size = rng.random() >= _P_OMIT_SIZE
    pieces = _object_words(obj, with_size)
    if allow_position and rng.random() < _P_POSITION:
        pieces += _words(_position_phrase(obj, image_size))
    return pieces


def _varied_content(
    objects: Sequence[ShapeObject], rng: np.random.Generator, image_size: int
) -> list[Piece]:
    order = [objects[i] for i in rng.permutation(len(objects))]
    if len(order) == 2 and rng.random() < _P_RELATION:
        a, b = order
        a_words = _varied_object(a, rng, image_size, allow_position=False)
        b_words = _varied_object(b, rng, image_size, allow_position=False)
        return a_words + _words(_relation(a, b)) + b_words
    return _join_list([_varied_object(o, rng, image_size, allow_position=True) for o in order])


def _varied_caption(
    objects: Sequence[ShapeObject], rng: np.random.Generator, image_size: int
) -> list[Piece]:
    content = _varied_content(objects, rng, image_size)
    n = len(objects)
    templates = [
        lambda: content,
        lambda: _words("there is" if n == 1 else "there are") + content,
        lambda: _words("an image with") + content,
        lambda: _words("a picture of") + content,
        lambda: _words("a dark image showing") + content,
        lambda: content + _words("on a black background"),
        lambda: _count_words(n) + content,
    ]
    return templates[int(rng.integers(len(templates)))]()


@lru_cache(maxsize=1 << 16)
def _tokens(text: str) -> tuple[str, ...]:
    """:func:`captioning.data.vocab.tokenize`, cached: it dominates the run time otherwise, and the
    words and many captions repeat."""
    return tuple(tokenize(text))


def _finish_caption(pieces: Sequence[Piece]) -> tuple[str, list[str], list[int | None]]:
    """The caption text, its tokens and the object id of each token.

    Each piece is tokenized on its own so every token inherits its piece's object id; the check
    against tokenizing the whole caption guarantees the alignment is exact.
    """
    caption = " ".join(word for word, _ in pieces)
    tokens = list(_tokens(caption))
    piece_tokens: list[str] = []
    object_ids: list[int | None] = []
    for word, object_id in pieces:
        for token in _tokens(word):
            piece_tokens.append(token)
            object_ids.append(object_id)
    if piece_tokens != tokens or len(object_ids) != len(tokens):
        raise AssertionError(f"token alignment broke for caption {caption!r}")
    return caption, tokens, object_ids


def describe_objects(objects: Iterable[Mapping[str, Any]]) -> str:
    """The canonical content caption for objects, e.g. ``a small red circle above a large ...``.

    Args:
        objects: mappings with ``shape``, ``color``, ``size`` and ``bbox`` (``x, y, w, h``); an
            instance annotation with its category name added as ``shape`` works.

    Returns:
        The caption text (the first of the five canonical wordings).
    """
    shapes = [
        ShapeObject(i + 1, o["shape"], o["color"], o["size"], tuple(map(float, o["bbox"])))
        for i, o in enumerate(objects)
    ]
    if not 1 <= len(shapes) <= MAX_OBJECTS:
        raise DataError(f"describe_objects needs 1 to {MAX_OBJECTS} objects, got {len(shapes)}")
    return _finish_caption(_canonical_content(shapes))[0]


# ----------------------------------------------------------------------------------------------
# Layout and drawing
# ----------------------------------------------------------------------------------------------


@cache
def _shape_mask(shape: str, diameter: int) -> np.ndarray:
    """Boolean mask of a shape drawn in a ``diameter`` box, cropped to its drawn pixels."""
    patch = Image.new("L", (diameter, diameter), 0)
    draw = ImageDraw.Draw(patch)
    last = diameter - 1
    if shape == "circle":
        draw.ellipse((0, 0, last, last), fill=255)
    elif shape == "square":
        draw.rectangle((0, 0, last, last), fill=255)
    else:  # upward-pointing isoceles triangle filling its box
        draw.polygon([(0, last), (last, last), (last / 2, 0)], fill=255)
    mask = np.asarray(patch) > 0
    rows, cols = np.flatnonzero(mask.any(axis=1)), np.flatnonzero(mask.any(axis=0))
    mask = mask[rows[0] : rows[-1] + 1, cols[0] : cols[-1] + 1].copy()
    mask.setflags(write=False)  # shared through the cache
    return mask


@dataclass(frozen=True)
class _Geometry:
    """Pixel distances for one image size."""

    image_size: int
    margin: float
    border: int
    min_dx: float

    @classmethod
    def for_size(cls, image_size: int) -> _Geometry:
        scale = image_size / _REFERENCE_SIZE
        margin = _MARGIN_PX * scale
        return cls(image_size, margin, math.ceil(margin), _MIN_DX_PX * scale)

    def diameter_range(self, size: str) -> tuple[int, int]:
        scale = self.image_size / _REFERENCE_SIZE
        low, high = _DIAMETER_PX[size]
        return round(low * scale), round(high * scale)


Box = tuple[int, int, int, int]  # x, y, w, h


def _fits(box: Box, placed: Sequence[Box], geo: _Geometry) -> bool:
    """Apart from every placed box by the margin, and never at the same horizontal position."""
    x, y, w, h = box
    for px, py, pw, ph in placed:
        apart = (
            x + w + geo.margin <= px
            or px + pw + geo.margin <= x
            or y + h + geo.margin <= py
            or py + ph + geo.margin <= y
        )
        if not apart or abs((x + w / 2) - (px + pw / 2)) < geo.min_dx:
            return False
    return True


def _relation_is_clear(a: Box, b: Box) -> bool:
    """Two objects: one axis's centre offset dominates the other's by the ratio."""
    dx = abs((a[0] + a[2] / 2) - (b[0] + b[2] / 2))
    dy = abs((a[1] + a[3] / 2) - (b[1] + b[3] / 2))
    return max(dx, dy) >= _RELATION_RATIO * min(dx, dy)


def _try_layout(
    rng: np.random.Generator, sizes: Sequence[tuple[int, int]], geo: _Geometry
) -> list[Box] | None:
    """Place boxes of the given ``(w, h)`` one after the other; ``None`` when stuck."""
    placed: list[Box] = []
    for w, h in sizes:
        for _ in range(_POSITION_TRIES):
            x = int(rng.integers(geo.border, geo.image_size - geo.border - w + 1))
            y = int(rng.integers(geo.border, geo.image_size - geo.border - h + 1))
            if _fits((x, y, w, h), placed, geo):
                placed.append((x, y, w, h))
                break
        else:
            return None
    if len(placed) == 2 and not _relation_is_clear(*placed):
        return None
    return placed


def _sample_layout(
    rng: np.random.Generator, geo: _Geometry
) -> list[tuple[str, str, str, np.ndarray, Box]]:
    """``(shape, colour, size, mask, box)`` per object; attributes are drawn once, then only the
    positions are resampled, so rejection does not bias the attribute distribution."""
    count = int(rng.integers(1, MAX_OBJECTS + 1))
    color_names = list(COLORS)
    specs = []
    for _ in range(count):
        shape = SHAPES[int(rng.integers(len(SHAPES)))]
        color = color_names[int(rng.integers(len(color_names)))]
        size = SIZES[int(rng.integers(len(SIZES)))]
        low, high = geo.diameter_range(size)
        specs.append((shape, color, size, _shape_mask(shape, int(rng.integers(low, high + 1)))))
    sizes = [(mask.shape[1], mask.shape[0]) for *_, mask in specs]
    for _ in range(_LAYOUT_TRIES):
        boxes = _try_layout(rng, sizes, geo)
        if boxes is not None:
            return [(*spec, box) for spec, box in zip(specs, boxes)]
    raise RuntimeError(f"could not place {sizes} in a {geo.image_size} px image")


def _render(
    rng: np.random.Generator,
    image_size: int,
    shapes: Sequence[tuple[np.ndarray, Box, tuple[int, int, int]]],
) -> np.ndarray:
    """Dark grey background, flat-coloured shapes, then pixel noise over everything."""
    level = int(rng.integers(_BACKGROUND_LEVELS[0], _BACKGROUND_LEVELS[1] + 1))
    canvas = np.full((image_size, image_size, 3), level, dtype=np.float32)
    for mask, (x, y, w, h), rgb in shapes:
        canvas[y : y + h, x : x + w][mask] = rgb
    canvas += rng.standard_normal(canvas.shape, dtype=np.float32) * _NOISE_STD
    return np.clip(np.rint(canvas), 0, 255).astype(np.uint8)


def _segmentation(shape: str, box: Box) -> list[list[float]]:
    """A COCO polygon outlining the shape inside its tight box."""
    x, y, w, h = (float(v) for v in box)
    if shape == "square":
        points = [(x, y), (x + w, y), (x + w, y + h), (x, y + h)]
    elif shape == "triangle":
        points = [(x, y + h), (x + w, y + h), (x + w / 2, y)]
    else:
        cx, cy = x + w / 2, y + h / 2
        angles = (2 * math.pi * k / _CIRCLE_POLYGON_POINTS for k in range(_CIRCLE_POLYGON_POINTS))
        points = [(cx + w / 2 * math.cos(t), cy + h / 2 * math.sin(t)) for t in angles]
    return [[round(v, 2) for point in points for v in point]]


# ----------------------------------------------------------------------------------------------
# One image, one split, the whole dataset
# ----------------------------------------------------------------------------------------------


@dataclass
class _ImageResult:
    image: dict[str, Any]
    instances: list[dict[str, Any]]
    captions: list[dict[str, Any]]


def _make_image(
    seed: int,
    split: str,
    index: int,
    first_image_id: int,
    image_size: int,
    mode: str,
    image_dir: Path,
) -> _ImageResult:
    """Draw, save and annotate image ``index`` of ``split``, whose first image has id
    ``first_image_id``."""
    image_id = first_image_id + index
    # The image and its captions use separate streams, so both caption modes share the images.
    rng = np.random.default_rng([seed, _SPLIT_CODES[split], index])
    caption_rng = np.random.default_rng([seed, _SPLIT_CODES[split], index, 1])
    geo = _Geometry.for_size(image_size)

    layout = _sample_layout(rng, geo)
    objects, drawn, instances = [], [], []
    for k, (shape, color, size, mask, box) in enumerate(layout):
        ann_id = (image_id - 1) * MAX_OBJECTS + k + 1
        jitter = rng.uniform(*_BRIGHTNESS_JITTER)
        rgb = tuple(min(255, round(c * jitter)) for c in COLORS[color])
        bbox = tuple(float(v) for v in box)
        objects.append(ShapeObject(ann_id, shape, color, size, bbox))
        drawn.append((mask, box, rgb))
        instances.append(
            {
                "id": ann_id,
                "image_id": image_id,
                "category_id": SHAPES.index(shape) + 1,
                "bbox": list(bbox),
                "area": float(mask.sum()),
                "iscrowd": 0,
                "segmentation": _segmentation(shape, box),
                "color": color,
                "size": size,
            }
        )

    file_name = f"{split}_{index:06d}.png"
    # No pnginfo: PIL then writes no text chunks, so the bytes depend on the pixels only.
    with open_unlinked(image_dir / file_name) as handle:  # never through a link left there
        Image.fromarray(_render(rng, image_size, drawn), "RGB").save(handle, "PNG")

    if mode == "canonical":
        pieces = _canonical_captions(objects)
    else:
        pieces = [
            _varied_caption(objects, caption_rng, image_size) for _ in range(CAPTIONS_PER_IMAGE)
        ]
    captions = []
    for j, caption_pieces in enumerate(pieces):
        caption, tokens, object_ids = _finish_caption(caption_pieces)
        captions.append(
            {
                "id": (image_id - 1) * CAPTIONS_PER_IMAGE + j + 1,
                "image_id": image_id,
                "caption": caption,
                "tokens": tokens,
                "object_ids": object_ids,
            }
        )
    image = {"id": image_id, "file_name": file_name, "width": image_size, "height": image_size}
    return _ImageResult(image, instances, captions)


def _generate_split(
    split: str,
    count: int,
    first_image_id: int,
    seed: int,
    image_size: int,
    mode: str,
    image_dir: Path,
    progress: bool,
) -> list[_ImageResult]:
    """Make the images of one split, in index order."""
    make = partial(
        _make_image,
        seed,
        split,
        first_image_id=first_image_id,
        image_size=image_size,
        mode=mode,
        image_dir=image_dir,
    )
    # Threads overlap PNG encoding and file writes, which release the GIL; every image has its
    # own generator, so the results do not depend on the scheduling, and map keeps the order.
    images = map_in_threads(make, range(count), _WORKERS)
    bar = progress_bar(images, total=count, desc=f"shapes {split}", unit="img", enabled=progress)
    return list(bar)


def _write_json(path: Path, data: dict[str, Any]) -> None:
    with open_unlinked(path, text=True) as f:
        f.write(json.dumps(data, separators=(",", ":")))  # json.dump encodes in Python
        f.write("\n")


def _write_split_annotations(
    annotation_dir: Path, split: str, info: dict[str, Any], results: Sequence[_ImageResult]
) -> None:
    images = [r.image for r in results]
    _write_json(
        annotation_dir / f"captions_{split}.json",
        {
            "info": info,
            "licenses": [],
            "images": images,
            "annotations": [c for r in results for c in r.captions],
        },
    )
    _write_json(
        annotation_dir / f"instances_{split}.json",
        {
            "info": info,
            "licenses": [],
            "images": images,
            "annotations": [a for r in results for a in r.instances],
            "categories": CATEGORIES,
        },
    )


def _check_arguments(counts: Mapping[str, Any], seed: Any, image_size: Any, captions: Any) -> None:
    for split, count in counts.items():
        if isinstance(count, bool) or not isinstance(count, int) or count < 0:
            raise DataError(f"number of {split} images must be an integer >= 0, got {count!r}")
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise DataError(f"seed must be an integer >= 0, got {seed!r}")
    if isinstance(image_size, bool) or not isinstance(image_size, int):
        raise DataError(f"image_size must be an integer, got {image_size!r}")
    if image_size < MIN_IMAGE_SIZE:
        raise DataError(f"image_size must be at least {MIN_IMAGE_SIZE}, got {image_size}")
    if captions not in CAPTION_MODES:
        raise DataError(
            f"unknown captions mode {captions!r}; expected one of {', '.join(CAPTION_MODES)}"
        )


def generate_shapes(
    out_dir: str | Path,
    num_train: int = 8000,
    num_val: int = 500,
    num_test: int = 500,
    seed: int = 0,
    image_size: int = 96,
    captions: str = "canonical",
    progress: bool = False,
) -> dict:
    """Generate the shapes dataset in COCO format under ``out_dir``.

    Files of an earlier run with more images are not removed; the json files list only the
    images of this run.

    Args:
        out_dir: dataset root; ``images/`` and ``annotations/`` are created inside it.
        num_train: number of training images.
        num_val: number of validation images.
        num_test: number of test images.
        seed: base seed; the same arguments always give byte-identical files.
        image_size: width and height in pixels, at least 48; object sizes scale with it.
        captions: ``canonical`` (five fixed wordings of the same content) or ``varied``
            (random templates; harder and noisier, see the module docstring).
        progress: show a progress bar per split.

    Returns:
        A summary: ``out_dir``, ``splits`` (images per split), ``captions_per_image``,
        ``objects_histogram`` (images with 1, 2 and 3 objects, over all splits) and
        ``vocabulary`` (the sorted distinct caption tokens).

    Raises:
        DataError: for a negative count, an image size below 48 or an unknown captions mode.
    """
    counts = {"train": num_train, "val": num_val, "test": num_test}
    _check_arguments(counts, seed, image_size, captions)
    root = Path(out_dir)
    annotation_dir = root / "annotations"
    annotation_dir.mkdir(parents=True, exist_ok=True)

    histogram = {n: 0 for n in range(1, MAX_OBJECTS + 1)}
    vocabulary: set[str] = set()
    next_image_id = 1
    for split in SPLITS:
        image_dir = root / "images" / split
        if counts[split]:
            image_dir.mkdir(parents=True, exist_ok=True)
        results = _generate_split(
            split, counts[split], next_image_id, seed, image_size, captions, image_dir, progress
        )
        for result in results:
            histogram[len(result.instances)] += 1
            for caption in result.captions:
                vocabulary.update(caption["tokens"])
        next_image_id += counts[split]
        info = {**_INFO, "split": split, "seed": seed, "image_size": image_size}
        _write_split_annotations(annotation_dir, split, {**info, "captions": captions}, results)

    return {
        "out_dir": str(root),
        "splits": dict(counts),
        "captions_per_image": CAPTIONS_PER_IMAGE,
        "objects_histogram": histogram,
        "vocabulary": sorted(vocabulary),
    }
