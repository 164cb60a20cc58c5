"""Sentence-level BLEU as pycocoevalcap computes it for each caption (its second return
value), for rewards; the corpus BLEU of evaluation stays pycocoevalcap's own."""

from __future__ import annotations

import math
from collections.abc import Sequence

from captioning.metrics.cider import ngram_counts

_SMALL = 1e-9  # pycocoevalcap's guards against empty captions
_TINY = 1e-15


def sentence_bleu(candidate: str, references: Sequence[str], n: int = 4) -> float:
    """BLEU-n of one tokenised ``candidate`` against tokenised ``references``: clipped
    n-gram precisions (with pycocoevalcap's tiny smoothing), their geometric mean, and the
    brevity penalty against the reference length closest to the candidate's."""
    words = candidate.split()
    counts = ngram_counts(words, n)
    longest: dict[tuple[str, ...], int] = {}
    lengths = []
    for ref in references:
        ref_words = ref.split()
        lengths.append(len(ref_words))
        for gram, count in ngram_counts(ref_words, n).items():
            longest[gram] = max(longest.get(gram, 0), count)
    correct = [0] * n
    for gram, count in counts.items():
        correct[len(gram) - 1] += min(count, longest.get(gram, 0))
    testlen = len(words)
    reflen = min((abs(length - testlen), length) for length in lengths)[1]
    bleu = 1.0
    for k in range(n):
        guess = max(0, testlen - k)
        bleu *= (correct[k] + _TINY) / (guess + _SMALL)
    score = bleu ** (1.0 / n)
    ratio = (testlen + _TINY) / (reflen + _SMALL)
    if ratio < 1:
        score *= math.exp(1 - 1 / ratio)
    return score
