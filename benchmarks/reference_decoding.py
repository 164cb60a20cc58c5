"""Greedy decoding and beam search one image at a time, tutorial style, with the result
semantics of :mod:`captioning.inference.decoding`: the reference decodings of the benchmark.

:data:`DECODERS` pairs each decoding task the benchmark times (``greedy``, ``beam3``,
``beam5``) with how ours decodes it and the reference's decoding of it.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from functools import partial

import torch

from benchmarks.reference import ReferenceDecoder
from captioning.config import DecodeConfig
from captioning.data.vocab import Vocabulary
from captioning.inference.decoding import Decoded
from captioning.models import AttentionTrace


def _reference_log_probs(
    logits: torch.Tensor, step: int, min_length: int, suppress_unk: bool
) -> torch.Tensor:
    """log p over the vocabulary (fp32, as ours) with the words that may not come next at
    -inf: ``<pad>`` and ``<start>`` always, ``<unk>`` on request, ``<end>`` before
    ``min_length``."""
    log_probs = torch.log_softmax(logits.float(), dim=1)  # (n, V)
    banned = [Vocabulary.pad_id, Vocabulary.start_id]
    if suppress_unk:
        banned.append(Vocabulary.unk_id)
    if step < min_length:
        banned.append(Vocabulary.end_id)
    log_probs[:, banned] = float("-inf")
    return log_probs


# One decoded caption: its words (no <end>), one attention map per step, its log-probability.
_Caption = tuple[list[int], list[torch.Tensor], float]


def _pack(captions: list[_Caption], width: int, cells: int, device: torch.device) -> Decoded:
    """Per-image captions → a :class:`Decoded` of ``width`` steps, padded as ours pads."""
    batch = len(captions)
    tokens = torch.full((batch, width), Vocabulary.pad_id, dtype=torch.long, device=device)
    alphas = torch.zeros(batch, width, cells, device=device)  # (B, width, L)
    for row, (words, maps, _) in enumerate(captions):
        tokens[row, : len(words)] = torch.tensor(words, dtype=torch.long)
        if maps:
            alphas[row, : len(maps)] = torch.stack(maps[:width]).float()  # (t, L)
    return Decoded(
        tokens=tokens,  # (B, width)
        lengths=torch.tensor([len(w) for w, _, _ in captions], device=device),
        scores=torch.tensor([s for _, _, s in captions], device=device),
        trace=AttentionTrace(alphas),  # (B, width, L)
    )


@torch.no_grad()
def reference_greedy(
    reference: ReferenceDecoder,
    features: torch.Tensor,
    max_length: int = 20,
    min_length: int = 1,
    suppress_unk: bool = True,
) -> Decoded:
    """Greedy decoding one image at a time, with the result semantics of
    :func:`captioning.inference.decoding.greedy_decode`.

    Args:
        reference: the decoder.
        features: (B, L, D) the grids of B images.
        max_length, min_length, suppress_unk: as for ``greedy_decode``.
    """
    captions: list[_Caption] = []
    for grid in features.split(1):  # (1, L, D): one image at a time, as the tutorials do
        h, c = reference.init_state(grid)
        word = torch.full((1,), Vocabulary.start_id, device=grid.device)  # (1,)
        words: list[int] = []
        maps: list[torch.Tensor] = []
        # fp32 and summed word by word, in the same order as ours: the same float result
        score = torch.zeros((), device=grid.device)
        for step in range(max_length):
            logits, h, c, alpha, _ = reference.step(word, h, c, grid)
            log_probs = _reference_log_probs(logits, step, min_length, suppress_unk)  # (1, V)
            word = log_probs.argmax(dim=1)  # (1,)
            score = score + log_probs[0, word[0]]
            maps.append(alpha[0])
            if int(word) == Vocabulary.end_id:
                break
            words.append(int(word))
        captions.append((words, maps, float(score)))
    width = max(len(maps) for _, maps, _ in captions)
    return _pack(captions, width, features.shape[1], features.device)


def _reference_beam_one(
    reference: ReferenceDecoder,
    grid: torch.Tensor,
    beam_size: int,
    max_length: int,
    min_length: int,
    suppress_unk: bool,
) -> _Caption:
    """Beam search for one image ``grid`` (1, L, D), tutorial style: the live beams shrink
    and grow as Python lists, and a beam that ends leaves the beam there and then."""
    k = beam_size
    h, c = reference.init_state(grid)  # (1, H) each
    words = torch.full((1,), Vocabulary.start_id, device=grid.device)  # (n,) last words
    seqs = torch.zeros(1, 0, dtype=torch.long, device=grid.device)  # (n, t)
    seq_alphas = torch.zeros(1, 0, grid.shape[1], device=grid.device)  # (n, t, L)
    beam_scores = torch.zeros(1, device=grid.device)  # (n,) fp32, as ours
    best: _Caption | None = None
    for step in range(max_length):
        n = words.shape[0]
        logits, h, c, alpha, _ = reference.step(words, h, c, grid.expand(n, -1, -1))
        log_probs = _reference_log_probs(logits, step, min_length, suppress_unk)  # (n, V)
        vocab = log_probs.shape[1]
        candidates = (beam_scores.unsqueeze(1) + log_probs).view(-1)  # (n * V,)
        top_scores, top_index = candidates.topk(min(2 * k, candidates.numel()))  # (2K,)
        parents, next_words, next_scores = [], [], []
        for rank, (score, index) in enumerate(zip(top_scores.tolist(), top_index.tolist())):
            parent, word = divmod(index, vocab)
            if word == Vocabulary.end_id:
                # Only an ending among the top K finishes a caption (K = 1 is greedy); any
                # ending leaves the beam.
                if rank < k and math.isfinite(score) and (best is None or score > best[2]):
                    maps = list(seq_alphas[parent]) + [alpha[parent]]
                    best = (seqs[parent].tolist(), maps, score)
                continue
            if len(parents) < k and math.isfinite(score):
                parents.append(parent)
                next_words.append(word)
                next_scores.append(score)
        if not parents:
            break
        index = torch.tensor(parents, device=grid.device)  # (n',)
        words = torch.tensor(next_words, device=grid.device)  # (n',)
        seqs = torch.cat([seqs[index], words.unsqueeze(1)], dim=1)  # (n', t + 1)
        seq_alphas = torch.cat([seq_alphas[index], alpha[index].unsqueeze(1)], dim=1)
        h, c = h[index], c[index]  # (n', H) each
        # python floats hold the fp32 scores exactly, so this is no rounding
        beam_scores = torch.tensor(next_scores, device=grid.device)  # (n',)
        # Scores only fall as a caption grows: no live beam can beat a finished caption
        # that already scores at least as well as the best of them.
        if best is not None and best[2] >= max(next_scores):
            break
    if best is None:  # no beam ended: the best live one, unfinished
        i = int(beam_scores.argmax())
        best = (seqs[i].tolist(), list(seq_alphas[i]), float(beam_scores[i]))
    return best


@torch.no_grad()
def reference_beam_search(
    reference: ReferenceDecoder,
    features: torch.Tensor,
    beam_size: int = 3,
    max_length: int = 20,
    min_length: int = 1,
    length_penalty: float = 0.0,
    suppress_unk: bool = True,
) -> Decoded:
    """Beam search one image at a time, with the result semantics of
    :func:`captioning.inference.decoding.beam_search` (same candidates, same rule for which endings
    count, same stopping, same answer when no beam ends). Without a length penalty only.

    Args:
        reference: the decoder.
        features: (B, L, D) the grids of B images.
        beam_size, max_length, min_length, suppress_unk: as for ``beam_search``.
        length_penalty: must be 0.

    Raises:
        ValueError: for a length penalty.
    """
    if length_penalty != 0.0:
        raise ValueError("the reference beam search supports length_penalty=0 only")
    captions = [
        _reference_beam_one(reference, grid, beam_size, max_length, min_length, suppress_unk)
        for grid in features.split(1)  # (1, L, D)
    ]
    width = min(max(len(words) for words, _, _ in captions) + 1, max_length)
    return _pack(captions, width, features.shape[1], features.device)


# The decoding tasks: how ours decodes (max_length and min_length are set where it runs)
# and the reference's decoding of the same task.
DECODERS: dict[str, tuple[DecodeConfig, Callable[..., Decoded]]] = {
    "greedy": (DecodeConfig(strategy="greedy"), reference_greedy),
    "beam3": (
        DecodeConfig(strategy="beam", beam_size=3),
        partial(reference_beam_search, beam_size=3),
    ),
    "beam5": (
        DecodeConfig(strategy="beam", beam_size=5),
        partial(reference_beam_search, beam_size=5),
    ),
}


def captions_equal(ours: Decoded, reference: Decoded) -> list[bool]:
    """Per image: the same number of words and the same words.

    Args:
        ours: one decoding of a batch.
        reference: another decoding of the same batch.
    """
    return [
        int(n) == int(m) and torch.equal(a[: int(n)].cpu(), b[: int(m)].cpu())
        for a, n, b, m in zip(ours.tokens, ours.lengths, reference.tokens, reference.lengths)
    ]
