"""Caption metrics: the COCO caption evaluation (BLEU, METEOR, ROUGE-L, CIDEr-D, SPICE) and
exact match, attention grounding, and :func:`score_predictions`, which combines them."""

from captioning.metrics.captions import (
    METRIC_NAMES,
    caption_metrics,
    exact_match,
    exact_match_by_group,
    java_available,
    tokenize_for_eval,
)
from captioning.metrics.scoring import AttentionMaps, score_predictions

__all__ = [
    "AttentionMaps",
    "METRIC_NAMES",
    "caption_metrics",
    "exact_match",
    "exact_match_by_group",
    "java_available",
    "score_predictions",
    "tokenize_for_eval",
]
