"""The consensus nearest-neighbour baseline (captioning/inference/nearest.py)."""

from __future__ import annotations

import math
import random
from collections import Counter

import pytest
import torch

from captioning.inference.nearest import NearestNeighbourCaptioner, pool_grids
from captioning.metrics.cider import ngram_counts

WORDS = "một người đàn ông đang đánh bóng tennis trên sân chày vợt cầm phụ nữ".split()


def _random_captions(rng: random.Random, images: int) -> list[list[list[str]]]:
    return [
        [[rng.choice(WORDS) for _ in range(rng.randint(3, 9))] for _ in range(rng.randint(1, 5))]
        for _ in range(images)
    ]


def _pairwise_consensus(captions: list[list[list[str]]], images: list[int]) -> list[str]:
    """The caption with the largest sum of per-order tf-idf cosines with every candidate,
    computed pair by pair (the definition, without the centroid shortcut)."""
    df: Counter = Counter()
    for caps in captions:
        df.update({g for c in caps for g in ngram_counts(c)})
    log_n = math.log(len(captions))

    def vector(caption: list[str], order: int) -> dict:
        return {
            g: tf * (log_n - math.log(df[g]))
            for g, tf in ngram_counts(caption).items()
            if len(g) == order
        }

    def cosine(a: dict, b: dict) -> float:
        na = math.sqrt(sum(v * v for v in a.values()))
        nb = math.sqrt(sum(v * v for v in b.values()))
        if not na or not nb:
            return 0.0
        return sum(v * b.get(g, 0.0) for g, v in a.items()) / (na * nb)

    candidates = [c for i in images for c in captions[i]]
    scores = [
        sum(cosine(vector(c, n), vector(o, n)) for o in candidates for n in range(1, 5))
        for c in candidates
    ]
    return candidates[max(range(len(candidates)), key=lambda i: (scores[i], -i))]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_consensus_equals_the_pairwise_definition(seed: int) -> None:
    rng = random.Random(seed)
    captions = _random_captions(rng, 30)
    model = NearestNeighbourCaptioner(torch.randn(30, 8), captions)
    for _ in range(10):
        images = rng.sample(range(30), rng.randint(1, 8))
        assert model.consensus(images) == _pairwise_consensus(captions, images)


def test_neighbours_are_the_most_similar_by_cosine() -> None:
    torch.manual_seed(0)
    features = torch.randn(50, 16)
    queries = torch.randn(7, 16)
    model = NearestNeighbourCaptioner(features, [[["a"]]] * 50)
    got = model.neighbours(queries, 5)  # (7, 5)
    cosine = torch.nn.functional.cosine_similarity(queries[:, None], features[None], dim=2)
    assert torch.equal(got, cosine.topk(5, dim=1).indices)


def test_a_query_gets_a_caption_of_its_own_cluster() -> None:
    torch.manual_seed(0)
    centres = torch.randn(2, 32) * 5
    features = torch.cat([centres[0] + torch.randn(10, 32), centres[1] + torch.randn(10, 32)])
    captions = [[["một", "con", "chó", "trên", "cỏ"]]] * 10 + [[["sân", "tennis", "xanh"]]] * 10
    model = NearestNeighbourCaptioner(features, captions)
    queries = torch.stack([centres[1] + torch.randn(32), centres[0] + torch.randn(32)])
    assert model.caption(queries, 5) == [
        ["sân", "tennis", "xanh"],
        ["một", "con", "chó", "trên", "cỏ"],
    ]


def test_pool_grids_is_the_unit_mean_over_cells() -> None:
    grids = torch.rand(3, 49, 10, dtype=torch.float16)
    pooled = pool_grids(grids)  # (3, 10)
    expected = grids.float().mean(1)
    assert torch.allclose(pooled * expected.norm(dim=1, keepdim=True), expected, atol=1e-5)


def test_bad_inputs_are_refused() -> None:
    with pytest.raises(ValueError, match="one row per image"):
        NearestNeighbourCaptioner(torch.randn(3, 4), [[["a"]]] * 2)
    with pytest.raises(ValueError, match="at least one caption"):
        NearestNeighbourCaptioner(torch.randn(2, 4), [[["a"]], []])
    model = NearestNeighbourCaptioner(torch.randn(2, 4), [[["a"]], [["b"]]])
    with pytest.raises(ValueError, match="k must be 1 to 2"):
        model.neighbours(torch.randn(1, 4), 3)
