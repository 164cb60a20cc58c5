"""The consensus nearest-neighbour caption (Devlin et al. 2015), the baseline that retrieves
instead of generating.

For a query image: take the ``k`` training images whose pooled CNN features are closest
(cosine similarity); of all their captions, return the one that agrees most with the others.
Agreement is CIDEr's (Vedantam et al. 2015, the form Devlin et al. used): for n = 1..4 the
cosine between tf-idf vectors of n-grams, with document frequencies over the training
images, summed over the orders and over the other candidates. Since the sum of cosines with
every candidate is the dot product with the sum of the candidates' unit vectors, a query
costs one pass over its candidates' n-grams, whatever ``k``.

The pooled feature is the mean of an encoder's grid over its cells, the same grid the
attention models see (e.g. the cached grids of ``captioning extract-features``).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence

import torch

from captioning.metrics.cider import ngram_counts

__all__ = ["NearestNeighbourCaptioner", "pool_grids"]


def pool_grids(grids: torch.Tensor) -> torch.Tensor:
    """Grids (N, L, D) → unit-length mean features (N, D), in float32."""
    pooled = grids.float().mean(dim=1)  # (N, D)
    return torch.nn.functional.normalize(pooled, dim=1)


class NearestNeighbourCaptioner:
    """Consensus captions from the training images nearest to a query.

    Args:
        features: (N, D) pooled features of the training images (see :func:`pool_grids`;
            any features work, they are normalised to unit length here).
        captions: for each training image, its tokenised captions (lists of words).
        n: the longest n-gram of the agreement score.
    """

    def __init__(
        self, features: torch.Tensor, captions: Sequence[Sequence[Sequence[str]]], n: int = 4
    ) -> None:
        if features.ndim != 2 or len(features) != len(captions):
            raise ValueError(
                f"features must be (N, D) with one row per image of captions; got "
                f"{tuple(features.shape)} for {len(captions)} images"
            )
        if any(not caps for caps in captions):
            raise ValueError("every training image needs at least one caption")
        self.features = torch.nn.functional.normalize(features.float(), dim=1)  # (N, D)
        self.n = n
        self.captions = [[list(c) for c in caps] for caps in captions]
        counts = [[ngram_counts(c, n) for c in caps] for caps in self.captions]
        document_frequency: Counter = Counter()
        for caps in counts:
            document_frequency.update({gram for c in caps for gram in c})
        log_images = math.log(len(captions))
        self._idf = {g: log_images - math.log(df) for g, df in document_frequency.items()}
        # per image, per caption: the unit tf-idf vector of each order, as {n-gram: weight}
        self._vectors = [[self._unit_vectors(c) for c in caps] for caps in counts]

    def _unit_vectors(self, counts: Counter) -> list[dict[tuple[str, ...], float]]:
        orders: list[dict[tuple[str, ...], float]] = [{} for _ in range(self.n)]
        for gram, tf in counts.items():
            orders[len(gram) - 1][gram] = tf * self._idf[gram]
        for vector in orders:
            norm = math.sqrt(sum(w * w for w in vector.values()))
            for gram in vector:
                vector[gram] = vector[gram] / norm if norm else 0.0
        return orders

    def neighbours(self, queries: torch.Tensor, k: int) -> torch.Tensor:
        """Indices (M, k) of the ``k`` training images nearest each query (M, D), nearest
        first."""
        if not 1 <= k <= len(self.features):
            raise ValueError(f"k must be 1 to {len(self.features)}, got {k}")
        queries = torch.nn.functional.normalize(queries.float(), dim=1)  # (M, D)
        similarity = queries @ self.features.T  # (M, N)
        return similarity.topk(k, dim=1).indices  # (M, k)

    def consensus(self, images: Sequence[int]) -> list[str]:
        """Of the captions of ``images`` (training indices), the one with the highest summed
        CIDEr agreement with all of them; ties go to the earlier image and caption."""
        candidates = [(i, j) for i in images for j in range(len(self.captions[i]))]
        centroid: list[dict[tuple[str, ...], float]] = [{} for _ in range(self.n)]
        for i, j in candidates:
            for total, vector in zip(centroid, self._vectors[i][j]):
                for gram, weight in vector.items():
                    total[gram] = total.get(gram, 0.0) + weight
        best, best_score = candidates[0], -math.inf
        for i, j in candidates:
            score = sum(
                weight * total.get(gram, 0.0)
                for total, vector in zip(centroid, self._vectors[i][j])
                for gram, weight in vector.items()
            )
            if score > best_score + 1e-12:
                best, best_score = (i, j), score
        return self.captions[best[0]][best[1]]

    def caption(self, queries: torch.Tensor, k: int) -> list[list[str]]:
        """The consensus caption (a list of words) for each query feature (M, D)."""
        return [self.consensus(row.tolist()) for row in self.neighbours(queries, k)]
