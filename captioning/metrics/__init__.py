"""Caption metrics: the COCO caption evaluation (BLEU, METEOR, ROUGE-L, CIDEr-D, SPICE) and
exact match."""

from captioning.metrics.captions import (
    METRIC_NAMES,
    caption_metrics,
    exact_match,
    exact_match_by_group,
    java_available,
    tokenize_for_eval,
)

__all__ = [
    "METRIC_NAMES",
    "caption_metrics",
    "exact_match",
    "exact_match_by_group",
    "java_available",
    "tokenize_for_eval",
]
