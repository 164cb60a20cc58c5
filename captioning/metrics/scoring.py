"""Generated captions of a split scored against its records: the one place that turns
predictions into a metrics dict, for validation during training and for ``evaluate``."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from captioning.data.records import ImageRecord
from captioning.data.vocab import Vocabulary
from captioning.metrics.captions import caption_metrics, exact_match, exact_match_by_group
from captioning.metrics.grounding import grounding_scores


@dataclass
class AttentionMaps:
    """What grounding needs besides the captions.

    Attributes:
        decoded: per image id, its single-image :class:`captioning.inference.decoding.Decoded`.
        vocab: the vocabulary of the decoded tokens.
        grid_shape: the model's attention grid (rows, columns).
    """

    decoded: Mapping[int, Any]
    vocab: Vocabulary
    grid_shape: tuple[int, int]


def score_predictions(
    predictions: Mapping[int, str],
    records: Sequence[ImageRecord],
    meteor: bool = True,
    spice: bool = False,
    attention: AttentionMaps | None = None,
) -> dict[str, Any]:
    """BLEU-1..4, METEOR, ROUGE-L, CIDEr-D (SPICE on request) and exact match of
    ``predictions`` against the reference captions of ``records``.

    With ``attention``, images that carry object annotations add exact match by number of
    objects (``exact_match_by_objects``) and the grounding scores of
    :func:`captioning.metrics.grounding.grounding_scores`.

    Args:
        predictions: one generated caption per image id; exactly these images are scored.
        records: the split's images (extra records are ignored).
        meteor: compute METEOR (a Java process; validation turns it off).
        spice: also SPICE (downloads Stanford models on first use).
        attention: the attention maps behind ``predictions``, for grounding.
    """
    references = {r.image_id: list(r.captions) for r in records if r.image_id in predictions}
    scores: dict[str, Any] = dict(caption_metrics(predictions, references, spice, meteor))
    scores["exact_match"] = exact_match(predictions, references)
    if attention is None:
        return scores
    with_objects = [r for r in records if r.objects and r.image_id in predictions]
    if with_objects:
        groups = {r.image_id: len(r.objects) for r in with_objects}
        scores["exact_match_by_objects"] = exact_match_by_group(
            {i: predictions[i] for i in groups}, references, groups
        )
        scores.update(
            grounding_scores(with_objects, attention.decoded, attention.vocab, attention.grid_shape)
        )
    return scores
