"""Where the model looked for each object it named, against category boxes and baseline maps.

Every generated word that names a category present in the image (through the map of
:mod:`captioning.metrics.words`) is scored against the boxes of all the image's objects of
that category:

* the **pointing game**: the word's map peaks in a box. A cell counts as in the box when its
  centre lies inside the box grown by half a cell on every side (the cell overlaps or touches
  it), as :mod:`captioning.metrics.grounding` counts it on shapes; where several cells share
  the peak (the even map, the centre prior's middle cells) the share of them that hit counts;
* the **mass in the boxes**: the sum over cells of the weight times the share of the cell's
  area that the union of the boxes covers (exact: the boxes cut the cells into rectangles).

The encoder squashes the whole image to a square (no crop), so a rows x cols grid cuts the
original image's width into cols equal columns and its height into rows equal rows, and the
boxes, in the original image's pixels, are compared with the cells as they are.

The same words are scored with each map the model reports, and with three baselines:
``even`` (1 / L on every cell), ``centre`` (a Gaussian centred in the image, its standard
deviation :data:`CENTRE_SIGMA` of the width across and of the height down, at the cell
centres) and ``saliency`` (the model's own mean map over every word of the caption: a
word-specific map must beat it to show that the word, not the photo, chose where to look).
The model's maps: ``model`` (``alpha``: soft attention's map, hard attention's distribution
over cells, the mean of a multi-head model's heads, local attention's map), ``head_1`` ...
(each head), ``chosen_cell`` (hard attention's chosen cell, when decoded with
``hard_context`` argmax or sample) and ``local_centre`` (local attention's predicted centre: a
point, so pointing only) and ``localiser`` (a model with ``model.word_maps``: its word
localiser's map of the word, m_w, where the localiser finds the word's evidence, which the
attention is drawn toward). Each map's summary also gives its median peak weight and its mean
entropy (nats; an even map over L cells has ln L).
"""

from __future__ import annotations

import statistics
from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from captioning.data.records import ImageRecord, ObjectAnnotation
from captioning.data.vocab import Vocabulary
from captioning.metrics.grounding import decoded_with_objects
from captioning.metrics.words import category_of, named_category
from captioning.models.trace import AttentionTrace

# The centre prior's standard deviation, as a share of the image's width (across) and height
# (down).
CENTRE_SIGMA = 0.25
BASELINES = ("even", "centre", "saliency")
Box = tuple[float, float, float, float]  # x, y, width, height


@dataclass(frozen=True)
class Grid:
    """A rows x cols grid of cells over an image of ``width`` x ``height`` pixels."""

    rows: int
    cols: int
    width: float
    height: float

    @property
    def cell_w(self) -> float:
        return self.width / self.cols

    @property
    def cell_h(self) -> float:
        return self.height / self.rows

    def centres(self) -> tuple[np.ndarray, np.ndarray]:
        """The cell centres in pixels, row-major: x (L,), y (L,)."""
        xs = (np.arange(self.cols) + 0.5) * self.cell_w
        ys = (np.arange(self.rows) + 0.5) * self.cell_h
        return np.tile(xs, self.rows), np.repeat(ys, self.cols)  # (L,), (L,)


def point_in_boxes(x: float, y: float, boxes: Sequence[Box], grid: Grid) -> bool:
    """Whether the point (x, y) in pixels lies in one of ``boxes`` grown by half a cell."""
    dx, dy = grid.cell_w / 2, grid.cell_h / 2
    return any(
        bx - dx <= x <= bx + bw + dx and by - dy <= y <= by + bh + dy for bx, by, bw, bh in boxes
    )


def peak_hit(alpha: np.ndarray, boxes: Sequence[Box], grid: Grid) -> float:
    """The pointing game of one map (L,): the share of its peak cells (all cells within
    1e-12 of the maximum) whose centre lies in a box grown by half a cell."""
    xs, ys = grid.centres()
    peaks = np.flatnonzero(alpha >= alpha.max() - 1e-12)
    return float(np.mean([point_in_boxes(xs[i], ys[i], boxes, grid) for i in peaks]))


def box_coverage(boxes: Sequence[Box], grid: Grid) -> np.ndarray:
    """The share of each cell's area (L,) inside the union of ``boxes``, exactly: the box and
    cell edges cut the image into rectangles that each lie in one cell and are inside a box
    or outside all of them."""
    xs = _edges(grid.width, grid.cols, [(b[0], b[0] + b[2]) for b in boxes])
    ys = _edges(grid.height, grid.rows, [(b[1], b[1] + b[3]) for b in boxes])
    mid_x, mid_y = (xs[:-1] + xs[1:]) / 2, (ys[:-1] + ys[1:]) / 2
    inside = np.zeros((len(mid_y), len(mid_x)), dtype=bool)  # (ny, nx)
    for bx, by, bw, bh in boxes:
        inside |= ((by <= mid_y) & (mid_y <= by + bh))[:, None] & (
            (bx <= mid_x) & (mid_x <= bx + bw)
        )[None, :]
    area = np.diff(ys)[:, None] * np.diff(xs)[None, :] * inside  # (ny, nx)
    col = np.minimum((mid_x // grid.cell_w).astype(int), grid.cols - 1)  # (nx,)
    row = np.minimum((mid_y // grid.cell_h).astype(int), grid.rows - 1)  # (ny,)
    covered = np.zeros((grid.rows, grid.cols))
    np.add.at(covered, (row[:, None], col[None, :]), area)
    return covered.reshape(-1) / (grid.cell_w * grid.cell_h)  # (L,)


def _edges(size: float, cells: int, spans: Iterable[tuple[float, float]]) -> np.ndarray:
    """The sorted cut positions along one side: cell edges and the spans' ends, clipped."""
    ends = [v for span in spans for v in span]
    cuts = np.concatenate([np.linspace(0.0, size, cells + 1), np.clip(ends, 0.0, size)])
    return np.unique(cuts)


def centre_prior(grid: Grid, sigma: float = CENTRE_SIGMA) -> np.ndarray:
    """A Gaussian centred in the image, ``sigma`` of its width across and of its height
    down, at the cell centres, normalised to sum to one: (L,)."""
    xs, ys = grid.centres()
    u, v = xs / grid.width - 0.5, ys / grid.height - 0.5
    density = np.exp(-(u**2 + v**2) / (2 * sigma**2))
    return density / density.sum()


def entropy(alpha: np.ndarray) -> float:
    """The entropy of a map in nats (0 log 0 = 0)."""
    p = alpha[alpha > 0]
    return float(-(p * np.log(p)).sum())


@dataclass
class MapScores:
    """The scores of one kind of map over a group of words."""

    hits: list[float] = field(default_factory=list)
    masses: list[float] = field(default_factory=list)
    peaks: list[float] = field(default_factory=list)
    entropies: list[float] = field(default_factory=list)

    def add_map(
        self, alpha: np.ndarray, boxes: Sequence[Box], coverage: np.ndarray, grid: Grid
    ) -> None:
        self.hits.append(peak_hit(alpha, boxes, grid))
        self.masses.append(float((alpha * coverage).sum()))
        self.peaks.append(float(alpha.max()))
        self.entropies.append(entropy(alpha))

    def summary(self) -> dict[str, float | None]:
        return {
            "pointing": _mean(self.hits),
            "mass": _mean(self.masses),
            "median_peak": statistics.median(self.peaks) if self.peaks else None,
            "mean_entropy": _mean(self.entropies),
        }


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


@dataclass
class Group:
    """Every map's scores over one group of words (all, one category, one word)."""

    words: int = 0
    maps: dict[str, MapScores] = field(default_factory=lambda: defaultdict(MapScores))

    def summary(self) -> dict[str, Any]:
        return {
            "words": self.words,
            **{name: scores.summary() for name, scores in self.maps.items()},
        }


def word_maps(trace: AttentionTrace, t: int) -> dict[str, np.ndarray]:
    """The model's maps of word ``t`` of a caption's ``trace`` (T, ...), by name."""
    alpha = _numpy(trace.alpha[t])  # (L,)
    maps = {"model": alpha}
    if trace.heads is not None:
        for h, head in enumerate(trace.heads[t]):  # (H, L)
            maps[f"head_{h + 1}"] = _numpy(head)
    if trace.cell is not None:
        maps["chosen_cell"] = np.eye(len(alpha))[int(trace.cell[t])]
    return maps


def baseline_maps(grid: Grid, saliency: np.ndarray) -> dict[str, np.ndarray]:
    """The maps that know nothing of the word: even, the centre prior, the caption's mean."""
    cells = grid.rows * grid.cols
    return {"even": np.full(cells, 1.0 / cells), "centre": centre_prior(grid), "saliency": saliency}


def _numpy(values: Any) -> np.ndarray:
    return values.detach().float().cpu().numpy().astype(np.float64)


def category_boxes(objects: Sequence[ObjectAnnotation]) -> dict[str, list[Box]]:
    """The boxes of each category among ``objects``."""
    boxes: dict[str, list[Box]] = defaultdict(list)
    for obj in objects:
        boxes[obj.category].append(tuple(float(v) for v in obj.bbox))
    return boxes


@dataclass
class PointingTally:
    """Scores gathered caption by caption: overall, per category and per word."""

    grid_shape: tuple[int, int]
    category_words: Mapping[str, str]
    overall: Group = field(default_factory=Group)
    categories: dict[str, Group] = field(default_factory=lambda: defaultdict(Group))
    words: dict[str, Group] = field(default_factory=lambda: defaultdict(Group))
    absent: Counter = field(default_factory=Counter)
    all_peaks: list[float] = field(default_factory=list)
    all_entropies: list[float] = field(default_factory=list)
    images: int = 0

    def add_caption(
        self,
        words: Sequence[str],
        trace: AttentionTrace,
        record: ImageRecord,
        extra: Mapping[str, Any] | None = None,
    ) -> None:
        """Score the words of one caption of ``record`` (its ``trace`` (T, ...)); ``extra``
        holds more named maps of each word (name: (T, L)), scored beside the model's."""
        boxes = category_boxes(record.objects)
        grid = Grid(*self.grid_shape, float(record.width), float(record.height))
        alphas = _numpy(trace.alpha[: len(words)])  # (T, L)
        self.images += 1
        self.all_peaks += alphas.max(axis=1).tolist() if len(words) else []
        self.all_entropies += [entropy(a) for a in alphas]
        baselines = baseline_maps(grid, alphas.mean(axis=0)) if len(words) else {}
        for t, word in enumerate(words):
            category = category_of(word, self.category_words, set(boxes))
            if category is None:
                if named_category(word, self.category_words) is not None:
                    self.absent[word] += 1
                continue
            maps = word_maps(trace, t)
            for name, values in (extra or {}).items():
                maps[name] = _numpy(values[t])
            self._add_word(
                word,
                category,
                maps,
                _points(trace, t, grid),
                baselines,
                boxes[category],
                grid,
            )

    def _add_word(
        self,
        word: str,
        category: str,
        maps: dict[str, np.ndarray],
        points: dict[str, tuple[float, float]],
        baselines: dict[str, np.ndarray],
        boxes: list[Box],
        grid: Grid,
    ) -> None:
        coverage = box_coverage(boxes, grid)
        for group in (self.overall, self.categories[category], self.words[word]):
            group.words += 1
            for name, alpha in maps.items():
                group.maps[name].add_map(alpha, boxes, coverage, grid)
            for name, (x, y) in points.items():
                group.maps[name].hits.append(float(point_in_boxes(x, y, boxes, grid)))
            for name, alpha in baselines.items():
                group.maps[name].add_map(alpha, boxes, coverage, grid)

    def report(self) -> dict[str, Any]:
        """The ``grounding.json`` content (see :func:`category_grounding`)."""
        return {
            "grid": list(self.grid_shape),
            "centre_sigma": CENTRE_SIGMA,
            "images": self.images,
            "overall": self.overall.summary(),
            "categories": {c: g.summary() for c, g in sorted(self.categories.items())},
            "words": {
                w: {"category": named_category(w, self.category_words) or w, **g.summary()}
                for w, g in sorted(self.words.items())
            },
            "absent": dict(sorted(self.absent.items())),
            "all_words": {
                "words": len(self.all_peaks),
                "median_peak": statistics.median(self.all_peaks) if self.all_peaks else None,
                "mean_entropy": _mean(self.all_entropies),
            },
        }


def _points(trace: AttentionTrace, t: int, grid: Grid) -> dict[str, tuple[float, float]]:
    """Local attention's predicted centre of word ``t`` in pixels (column gives x)."""
    if trace.centre is None:
        return {}
    row, col = (float(v) for v in trace.centre[t])
    return {"local_centre": (col * grid.cell_w, row * grid.cell_h)}


def category_grounding(
    records: Sequence[ImageRecord],
    decoded: Mapping[int, Any],
    vocab: Vocabulary,
    grid_shape: tuple[int, int],
    category_words: Mapping[str, str],
    extra_maps: Mapping[int, Mapping[str, Any]] | None = None,
) -> dict[str, Any]:
    """The pointing game and the mass in the boxes of every generated word that names a
    category present in its image, for the model's maps and the baselines.

    Args:
        records: the scored images; those with objects (and ``width``/``height``) count.
        decoded: per image id, a single-image :class:`captioning.inference.decoding.Decoded`.
        vocab: the vocabulary of the tokens.
        grid_shape: the model's attention grid (rows, columns).
        category_words: word to category (:func:`captioning.metrics.words.load_category_words`).
        extra_maps: per image id, more named maps of each generated word (name: (T, L)),
            such as the word localiser's (``localiser``), scored as the model's are.
    Returns:
        ``grid``, ``centre_sigma``, ``images`` (captions scored), ``overall``, ``categories``
        and ``words`` (each: ``words``, the count, and per map ``pointing``, ``mass``,
        ``median_peak``, ``mean_entropy``), ``absent`` (generated words whose category the
        image lacks, with their counts) and ``all_words`` (the model's maps over every word).
    """
    tally = PointingTally(grid_shape, category_words)
    for record, result, words in decoded_with_objects(records, decoded, vocab):
        extra = (extra_maps or {}).get(record.image_id)
        tally.add_caption(words, result.trace[: int(result.lengths)], record, extra)
    return tally.report()


def word_boxes(
    words: Sequence[str],
    objects: Sequence[ObjectAnnotation],
    size: tuple[float, float],
    category_words: Mapping[str, str],
) -> list[list[Box]]:
    """Per word, the boxes of the image's objects of the category it names (none for the
    other words), as shares (x, y, width, height) of the image's ``size`` (width, height):
    what the figures and the web page outline."""
    width, height = size
    boxes = category_boxes(objects)
    shown = []
    for word in words:
        category = category_of(word, category_words, set(boxes))
        shown.append(
            [
                (x / width, y / height, w / width, h / height)
                for x, y, w, h in boxes.get(category, [])
            ]
        )
    return shown
