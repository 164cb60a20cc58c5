"""A fast CIDEr-D for rewards: the numbers of pycocoevalcap's ``CiderScorer``, computed
against references prepared once.

pycocoevalcap's scorer takes its document frequencies from the references it is handed and
rebuilds every reference's tf-idf vector for every candidate, with numpy scalar arithmetic.
That is right for one evaluation, and too slow to reward every sampled caption of every
training step. :class:`CiderD` reads a reference set once (the training split's, for
self-critical training) and keeps, per image, one table from each n-gram to its weight in
every reference, so that scoring a candidate costs one look-up per n-gram of the candidate;
n-grams are packed into integers, and a candidate repeated within a batch (samples of one
image often are) is scored once.

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
from collections.abc import Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass

Ngram = tuple[str, ...]

_BASE = 1 << 24  # word ids (plus one) below this pack an n-gram into one integer


def ngram_counts(tokens: Sequence[str], n: int = 4) -> Counter[Ngram]:
    """Counts of every 1..n-gram of ``tokens``."""
    counts: Counter[Ngram] = Counter()
    for k in range(1, n + 1):
        for i in range(len(tokens) - k + 1):
            counts[tuple(tokens[i : i + k])] += 1
    return counts


def _packed_counts(ids: Sequence[int], n: int) -> dict[int, int]:
    """Counts of the 1..n-grams of word ``ids``, each n-gram packed into one integer
    (its ids in base ``_BASE``, shifted by one so that no id is zero) times 4 plus n - 1."""
    counts: dict[int, int] = {}
    size = len(ids)
    for i in range(size):
        key = 0
        for k in range(min(n, size - i)):
            key = key * _BASE + ids[i + k] + 1
            gram = key * 4 + k
            counts[gram] = counts.get(gram, 0) + 1
    return counts


@dataclass
class _Image:
    """One image's references: per n-gram, its weight in each reference (0 where absent);
    per reference, the norm of each order's vector and its length in bigrams."""

    table: dict[int, list[float]]
    norms: list[list[float]]
    lengths: list[int]


@dataclass
class _Candidate:
    """A candidate's weighted n-grams (packed n-gram, order index, weight), norms and
    length in bigrams."""

    grams: list[tuple[int, int, float]]
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
        n: the longest n-gram (at most 4: orders are packed in two bits).
        sigma: the width of the Gaussian length penalty.
    """

    def __init__(
        self,
        references: Mapping[Hashable, Sequence[str]],
        n: int = 4,
        sigma: float = 6.0,
    ) -> None:
        if not 1 <= n <= 4:
            raise ValueError(f"n must be 1 to 4, got {n}")
        self.n = n
        self.sigma = sigma
        self._ids: dict[str, int] = {}
        counted = {
            key: [_packed_counts(self._encode(ref.split()), n) for ref in refs]
            for key, refs in references.items()
        }
        empty = [key for key, refs in counted.items() if not refs]
        if empty:
            raise ValueError(f"key {empty[0]!r} has no reference captions")
        document_frequency: Counter[int] = Counter()
        for refs in counted.values():
            document_frequency.update({gram for ref in refs for gram in ref})
        self.log_images = math.log(float(len(counted))) if counted else 0.0
        # idf of every n-gram the corpus has; any other n-gram gets log N (df counts as 1)
        self._idf = {
            gram: self.log_images - math.log(max(1.0, df))
            for gram, df in document_frequency.items()
        }
        self._images = {key: self._image(refs) for key, refs in counted.items()}

    def __len__(self) -> int:
        return len(self._images)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._images

    def _encode(self, tokens: Iterable[str], grow: bool = True) -> list[int]:
        """Word ids; a word the references never had gets an id of its own (``grow``) or,
        when scoring, one past the known ids per distinct new word."""
        ids = self._ids
        if grow:
            return [ids.setdefault(t, len(ids)) for t in tokens]
        unseen: dict[str, int] = {}
        return [
            ids[t] if t in ids else unseen.setdefault(t, len(ids) + len(unseen)) for t in tokens
        ]

    def _weights(
        self, counts: Mapping[int, int]
    ) -> tuple[list[tuple[int, int, float]], list[float], int]:
        grams = []
        squares = [0.0] * self.n
        length = 0
        idf, unseen = self._idf, self.log_images
        for gram, tf in counts.items():
            k = gram & 3
            weight = float(tf) * idf.get(gram, unseen)
            grams.append((gram, k, weight))
            squares[k] += weight * weight
            if k == 1:
                length += tf
        return grams, [math.sqrt(s) for s in squares], length

    def _image(self, refs: list[dict[int, int]]) -> _Image:
        table: dict[int, list[float]] = {}
        norms, lengths = [], []
        for j, counts in enumerate(refs):
            grams, ref_norms, length = self._weights(counts)
            for gram, _, weight in grams:
                table.setdefault(gram, [0.0] * len(refs))[j] = weight
            norms.append(ref_norms)
            lengths.append(length)
        return _Image(table, norms, lengths)

    def _score(self, candidate: _Candidate, image: _Image) -> float:
        """pycocoevalcap's ``sim`` summed over the orders and the references, averaged and
        times 10: the clipped cosine per order, times the Gaussian length penalty."""
        refs = len(image.lengths)
        products = [[0.0] * refs for _ in range(self.n)]  # (n, refs)
        table = image.table
        for gram, k, weight in candidate.grams:
            ref_weights = table.get(gram)
            if ref_weights is None:
                continue
            row = products[k]
            for j, ref_weight in enumerate(ref_weights):
                if ref_weight:
                    row[j] += (weight if weight < ref_weight else ref_weight) * ref_weight
        total = 0.0
        two_sigma_squared = 2 * self.sigma**2
        for j in range(refs):
            delta = float(candidate.length - image.lengths[j])
            penalty = math.e ** (-(delta**2) / two_sigma_squared)
            ref_norms = image.norms[j]
            for k in range(self.n):
                value = products[k][j]
                if candidate.norms[k] != 0 and ref_norms[k] != 0:
                    value /= candidate.norms[k] * ref_norms[k]
                total += value * penalty
        return total / self.n / refs * 10.0

    def score(self, candidates: Sequence[str], keys: Sequence[Hashable]) -> list[float]:
        """CIDEr-D of each tokenised candidate against the references of its key (keys may
        repeat: K samples of one image are K candidates with one key)."""
        if len(candidates) != len(keys):
            raise ValueError(f"{len(candidates)} candidates but {len(keys)} keys")
        done: dict[tuple[str, Hashable], float] = {}
        scores = []
        for candidate, key in zip(candidates, keys):
            if (candidate, key) not in done:
                image = self._images.get(key)
                if image is None:
                    raise KeyError(f"no references for key {key!r}")
                ids = self._encode(candidate.split(), grow=False)
                vector = _Candidate(*self._weights(_packed_counts(ids, self.n)))
                done[candidate, key] = self._score(vector, image)
            scores.append(done[candidate, key])
        return scores
