"""Attention grounding: did the model look at the object it named?

For every generated word that names exactly one object of the image, take the attention map
that produced the word and score

* the **pointing game**: the centre of the peak cell lies inside the object's box, dilated by
  half a grid cell (a coarse grid cannot point more precisely than that);
* the **attention mass in the box**: the attention of each cell times the share of the cell
  that the box covers, summed;
* for local attention, the **centre pointing game**: the centre the model predicted for the
  word (row, column in cells, carried to image pixels) lies inside the box, dilated as for
  the peak cell.

Which words name an object: a category word (COCO: through :data:`COCO_SYNONYMS`, the map of
:mod:`captioning.metrics.words`; shapes: the shape) or an attribute value stored on the
instance (shapes: ``color`` and ``size``), when exactly one object of the image has it.
Scores are reported overall and per word type (``category``, ``color``, ``size``).
:mod:`captioning.metrics.pointing` scores every word that names a category present in the
image instead, against the boxes of all its objects and against baseline maps.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch

from captioning.data.records import ImageRecord, ObjectAnnotation
from captioning.data.vocab import Vocabulary
from captioning.metrics.words import shipped_category_words

# Words that name a COCO category (words.py; the category names themselves map too).
COCO_SYNONYMS: dict[str, str] = shipped_category_words()


def named_object(
    word: str, objects: Sequence[ObjectAnnotation], synonyms: Mapping[str, str]
) -> tuple[str, ObjectAnnotation] | None:
    """The (word type, object) that ``word`` picks out, if it names exactly one object."""
    category = synonyms.get(word, word)
    matches = [o for o in objects if o.category == category]
    if matches:
        return ("category", matches[0]) if len(matches) == 1 else None
    for key in sorted({k for o in objects for k in o.attributes}):
        matches = [o for o in objects if o.attributes.get(key) == word]
        if matches:
            return (key, matches[0]) if len(matches) == 1 else None
    return None


def _cell_geometry(
    grid_shape: tuple[int, int], width: float, height: float
) -> tuple[torch.Tensor, torch.Tensor, float, float]:
    rows, cols = grid_shape
    cell_w, cell_h = width / cols, height / rows
    ys = (torch.arange(rows, dtype=torch.float64) + 0.5) * cell_h
    xs = (torch.arange(cols, dtype=torch.float64) + 0.5) * cell_w
    centre_y = ys[:, None].expand(rows, cols).reshape(-1)  # (L,)
    centre_x = xs[None, :].expand(rows, cols).reshape(-1)  # (L,)
    return centre_x, centre_y, cell_w, cell_h


def point_and_mass(
    alpha: torch.Tensor,
    bbox: Sequence[float],
    grid_shape: tuple[int, int],
    width: float,
    height: float,
) -> tuple[bool, float]:
    """Pointing-game hit and attention mass inside ``bbox`` (x, y, w, h) for one map (L,)."""
    centre_x, centre_y, cell_w, cell_h = _cell_geometry(grid_shape, width, height)
    x, y, w, h = (float(v) for v in bbox)
    peak = int(alpha.argmax())
    hit = (x - cell_w / 2 <= centre_x[peak] <= x + w + cell_w / 2) and (
        y - cell_h / 2 <= centre_y[peak] <= y + h + cell_h / 2
    )
    # the share of each cell covered by the box
    overlap_x = (
        torch.minimum(centre_x + cell_w / 2, torch.tensor(x + w))
        - torch.maximum(centre_x - cell_w / 2, torch.tensor(x))
    ).clamp_min(0)
    overlap_y = (
        torch.minimum(centre_y + cell_h / 2, torch.tensor(y + h))
        - torch.maximum(centre_y - cell_h / 2, torch.tensor(y))
    ).clamp_min(0)
    covered = overlap_x * overlap_y / (cell_w * cell_h)  # (L,)
    mass = float((alpha.double() * covered).sum())
    return bool(hit), mass


def centre_in_box(
    centre: Sequence[float] | torch.Tensor,
    bbox: Sequence[float],
    grid_shape: tuple[int, int],
    width: float,
    height: float,
) -> bool:
    """Pointing-game hit of a local-attention ``centre`` (row, column, in cells): the point
    (column * cell width, row * cell height) in pixels lies inside ``bbox`` (x, y, w, h)
    dilated by half a cell, as :func:`point_and_mass` dilates it for the peak cell."""
    rows, cols = grid_shape
    cell_w, cell_h = width / cols, height / rows
    row, col = (float(v) for v in centre)
    point_x, point_y = col * cell_w, row * cell_h
    x, y, w, h = (float(v) for v in bbox)
    return (x - cell_w / 2 <= point_x <= x + w + cell_w / 2) and (
        y - cell_h / 2 <= point_y <= y + h + cell_h / 2
    )


def decoded_with_objects(
    records: Sequence[ImageRecord], decoded: Mapping[Any, Any], vocab: Vocabulary
) -> Iterator[tuple[ImageRecord, Any, list[str]]]:
    """Each record that has objects and a decoded caption, with the caption's words: what
    every grounding score walks over. A record without its image's size is an error."""
    for record in records:
        result = decoded.get(record.image_id)
        if result is None or not record.objects:
            continue
        if record.width is None or record.height is None:
            raise ValueError(f"image {record.image_id} has no width/height for grounding")
        length = int(result.lengths)
        yield record, result, vocab.decode_tokens(result.tokens[:length].tolist())


def grounding_scores(
    records: Sequence[ImageRecord],
    decoded: Mapping[int, Any],
    vocab: Vocabulary,
    grid_shape: tuple[int, int],
    synonyms: Mapping[str, str] = COCO_SYNONYMS,
) -> dict[str, Any]:
    """Pointing game and attention-in-box over all grounded words of ``records``.

    Args:
        records: images with object annotations (and ``width``/``height``).
        decoded: per image id, a single-image :class:`captioning.inference.decoding.Decoded`
            (``tokens`` (T,), ``lengths`` (), and its ``trace``: ``alpha`` (T, L), and
            ``centre`` (T, 2) for local attention).
        vocab: the vocabulary of the tokens.
        grid_shape: the model's attention grid (rows, columns).
    Returns:
        ``pointing_game``, ``attention_in_box`` (None when no word was grounded),
        ``grounded_words`` and ``grounding_by_word_type`` with keys such as
        ``pointing_game/color``. When the decoded captions carry centres, also
        ``centre_pointing_game`` and, per word type, ``centre_pointing_game/color`` etc.
    """
    hits: dict[str, list[float]] = defaultdict(list)
    masses: dict[str, list[float]] = defaultdict(list)
    centre_hits: dict[str, list[float]] = defaultdict(list)
    with_centres = any(d.trace.centre is not None for d in decoded.values())
    for record, result, words in decoded_with_objects(records, decoded, vocab):
        for t, word in enumerate(words):
            found = named_object(word, record.objects, synonyms)
            if found is None:
                continue
            word_type, obj = found
            hit, mass = point_and_mass(
                result.alphas[t], obj.bbox, grid_shape, record.width, record.height
            )
            for key in ("all", word_type):
                hits[key].append(float(hit))
                masses[key].append(mass)
            centres = result.trace.centre  # (T, 2) or None
            if centres is not None:
                inside = centre_in_box(
                    centres[t], obj.bbox, grid_shape, record.width, record.height
                )
                for key in ("all", word_type):
                    centre_hits[key].append(float(inside))

    def mean(values: list[float]) -> float | None:
        return sum(values) / len(values) if values else None

    by_type = {}
    for key in sorted(k for k in hits if k != "all"):
        by_type[f"pointing_game/{key}"] = mean(hits[key])
        by_type[f"attention_in_box/{key}"] = mean(masses[key])
        by_type[f"words/{key}"] = len(hits[key])
        if with_centres:
            by_type[f"centre_pointing_game/{key}"] = mean(centre_hits[key])
    scores = {
        "pointing_game": mean(hits["all"]),
        "attention_in_box": mean(masses["all"]),
        "grounded_words": len(hits["all"]),
        "grounding_by_word_type": by_type,
    }
    if with_centres:
        scores["centre_pointing_game"] = mean(centre_hits["all"])
    return scores
