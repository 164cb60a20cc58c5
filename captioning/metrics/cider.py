"""A fast CIDEr-D for rewards: the numbers of pycocoevalcap's ``CiderScorer``, computed
against references prepared once.

pycocoevalcap's scorer takes its document frequencies from the references it is handed and
rebuilds every reference's tf-idf vector for every candidate, with numpy scalar arithmetic.
That is right for one evaluation, and too slow to reward every sampled caption of every
training step. :class:`CiderD` reads a reference set once (the training split's, for
self-critical training), keeps each image's reference vectors, and then scores candidates
against them in plain Python floats.

The formula, exactly as pycocoevalcap computes it (Vedantam et al. 2015, the ``-D``
variant): for n = 1..4, g_n(s) is the vector of tf(w, s) * (log N - log max(1, df(w))) over
the n-grams w of s, with N the number of images in the reference set and df(w) the number of
images whose references contain w; then

    CIDEr-D(c, R) = 10 / (4 |R|) * sum_n sum_{r in R} exp(-(l_c - l_r)^2 / (2 sigma^2))
                    * sum_w min(g_n(c)_w, g_n(r)_w) g_n(r)_w / (|g_n(c)| |g_n(r)|)

with sigma = 6 and l the caption's number of bigrams (pycocoevalcap measures length there).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass

Ngram = tuple[str, ...]


def ngram_counts(tokens: Sequence[str], n: int = 4) -> Counter[Ngram]:
    """Counts of every 1..n-gram of ``tokens``."""
    counts: Counter[Ngram] = Counter()
    for k in range(1, n + 1):
        for i in range(len(tokens) - k + 1):
            counts[tuple(tokens[i : i + k])] += 1
    return counts


@dataclass
class _Vector:
    """One caption's tf-idf weights: ``weights[k]`` maps each (k+1)-gram to its weight,
    ``norms[k]`` is that vector's length, ``length`` the caption's bigram count."""

    weights: list[dict[Ngram, float]]
    norms: list[float]
    length: int


class CiderD:
    """CIDEr-D with document frequencies from a fixed reference set.

    Built once from tokenised references (lower-case tokens joined by spaces, as
    :func:`captioning.metrics.tokenize_for_eval` returns them); :meth:`score` then rates
    candidates against the references of the keys they are given. On the same tokens it
    gives what pycocoevalcap's ``Cider`` gives when handed exactly this reference set: the
    document frequencies count images of the set, and N is its number of images.

    Args:
        references: per key (an image), its tokenised reference captions (at least one).
        n: the longest n-gram.
        sigma: the width of the Gaussian length penalty.
    """

    def __init__(
        self,
        references: Mapping[Hashable, Sequence[str]],
        n: int = 4,
        sigma: float = 6.0,
    ) -> None:
        self.n = n
        self.sigma = sigma
        counted = {
            key: [ngram_counts(ref.split(), n) for ref in refs] for key, refs in references.items()
        }
        empty = [key for key, refs in counted.items() if not refs]
        if empty:
            raise ValueError(f"key {empty[0]!r} has no reference captions")
        document_frequency: Counter[Ngram] = Counter()
        for refs in counted.values():
            document_frequency.update({gram for ref in refs for gram in ref})
        self.log_images = math.log(float(len(counted))) if counted else 0.0
        # idf of every n-gram the corpus has; any other n-gram gets log N (df counts as 1)
        self._idf = {
            gram: self.log_images - math.log(max(1.0, df))
            for gram, df in document_frequency.items()
        }
        self._references = {
            key: [self._vector(ref) for ref in refs] for key, refs in counted.items()
        }

    def __len__(self) -> int:
        return len(self._references)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._references

    def _vector(self, counts: Mapping[Ngram, int]) -> _Vector:
        weights: list[dict[Ngram, float]] = [{} for _ in range(self.n)]
        squares = [0.0] * self.n
        length = 0
        for gram, tf in counts.items():
            k = len(gram) - 1
            weight = float(tf) * self._idf.get(gram, self.log_images)
            weights[k][gram] = weight
            squares[k] += weight * weight
            if k == 1:
                length += tf
        return _Vector(weights, [math.sqrt(s) for s in squares], length)

    def _similarity(self, candidate: _Vector, reference: _Vector) -> float:
        """Sum over n of the clipped cosine of one candidate with one reference, times
        the length penalty (pycocoevalcap's ``sim``, summed)."""
        delta = float(candidate.length - reference.length)
        penalty = math.e ** (-(delta**2) / (2 * self.sigma**2))
        total = 0.0
        for k in range(self.n):
            ref_weights = reference.weights[k]
            value = 0.0
            for gram, weight in candidate.weights[k].items():
                ref_weight = ref_weights.get(gram, 0.0)
                value += min(weight, ref_weight) * ref_weight
            if candidate.norms[k] != 0 and reference.norms[k] != 0:
                value /= candidate.norms[k] * reference.norms[k]
            total += value * penalty
        return total

    def score_one(self, candidate: str, key: Hashable) -> float:
        """CIDEr-D of one tokenised ``candidate`` against the references of ``key``."""
        references = self._references.get(key)
        if references is None:
            raise KeyError(f"no references for key {key!r}")
        vector = self._vector(ngram_counts(candidate.split(), self.n))
        total = sum(self._similarity(vector, ref) for ref in references)
        return total / self.n / len(references) * 10.0

    def score(self, candidates: Sequence[str], keys: Sequence[Hashable]) -> list[float]:
        """CIDEr-D of each tokenised candidate against the references of its key (keys may
        repeat: K samples of one image are K candidates with one key)."""
        if len(candidates) != len(keys):
            raise ValueError(f"{len(candidates)} candidates but {len(keys)} keys")
        return [self.score_one(c, k) for c, k in zip(candidates, keys)]
