"""The fast CIDEr-D and sentence BLEU give pycocoevalcap's numbers on the same tokens."""

from __future__ import annotations

import random

import pytest
from pycocoevalcap.bleu.bleu import Bleu
from pycocoevalcap.cider.cider import Cider

from captioning.metrics.bleu import sentence_bleu
from captioning.metrics.cider import CiderD

CORPUS_WORDS = [f"w{i}" for i in range(30)]
UNSEEN_WORDS = ["zebra", "quartz", "violin"]  # in no reference: df 0, idf log N


def _caption(rng: random.Random, words: list[str], longest: int) -> str:
    # few distinct words, so that bigrams to 4-grams repeat across captions
    return " ".join(rng.choice(words) for _ in range(rng.randint(0, longest)))


def _references(rng: random.Random, images: int) -> dict[int, list[str]]:
    return {
        image: [_caption(rng, CORPUS_WORDS[:12], 12) for _ in range(rng.randint(1, 5))]
        for image in range(images)
    }


def test_cider_d_equals_pycocoevalcap_per_caption():
    rng = random.Random(0)
    references = _references(rng, 1000)
    ours = CiderD(references)
    theirs = Cider()
    empties = unseen = 0
    for _ in range(3):  # pycocoevalcap scores one candidate per image per call
        candidates = {}
        for image in references:
            kind = rng.random()
            if kind < 0.05:
                candidates[image] = ""
                empties += 1
            elif kind < 0.25:  # copies of a reference score high: the n-grams must match
                candidates[image] = rng.choice(references[image])
            else:
                words = CORPUS_WORDS[:12] + UNSEEN_WORDS if kind < 0.4 else CORPUS_WORDS[:12]
                candidates[image] = _caption(rng, words, 14)
                unseen += any(w in candidates[image] for w in UNSEEN_WORDS)
        keys = list(references)
        _, expected = theirs.compute_score(references, {k: [candidates[k]] for k in keys})
        got = ours.score([candidates[k] for k in keys], keys)
        assert max(abs(a - b) for a, b in zip(got, expected)) < 1e-9
        assert max(got) > 1.0  # the copies: not a test of zeros
    assert empties > 50 and unseen > 50


def test_cider_d_keeps_its_corpus():
    """Scoring a subset uses the document frequencies of the whole reference set, which is
    what pycocoevalcap gives only when handed the whole set."""
    rng = random.Random(1)
    references = _references(rng, 200)
    ours = CiderD(references)
    candidate = references[3][0]
    whole = Cider().compute_score(references, {k: [candidate] for k in references})[1][3]
    alone = Cider().compute_score({3: references[3]}, {3: [candidate]})[0]
    assert ours.score([candidate, candidate], [3, 3]) == pytest.approx([whole, whole], abs=1e-9)
    assert abs(alone - whole) > 0.1


def test_cider_d_refuses_unknown_keys_and_empty_reference_lists():
    with pytest.raises(KeyError, match="no references"):
        CiderD({1: ["a b"]}).score(["a b"], [2])
    with pytest.raises(ValueError, match="no reference captions"):
        CiderD({1: []})


def test_sentence_bleu_equals_pycocoevalcap_per_caption():
    rng = random.Random(2)
    references = _references(rng, 300)
    candidates = {k: [_caption(rng, CORPUS_WORDS[:14], 14)] for k in references}
    candidates[0] = [""]
    references[1] = ["w1 w2 w3 w4 w5 w6", "w1 w2"]
    candidates[1] = ["w1 w2 w3 w4 w5 w6"]  # a reference itself: BLEU-4 of 1
    _, per_caption = Bleu(4).compute_score(references, candidates, verbose=0)
    got = [sentence_bleu(candidates[k][0], references[k]) for k in references]
    assert max(abs(a - b) for a, b in zip(got, per_caption[3])) < 1e-9
    assert got[1] == pytest.approx(1.0)
