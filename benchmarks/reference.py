"""The naive reference that the benchmark times ours against, and the check that it computes
what ours computes.

The reference is Show, Attend and Tell written the way popular tutorial code writes it: a
Python loop over words in which every step re-projects the whole grid into attention keys and
applies the output layer on its own (:class:`ReferenceDecoder`), and greedy decoding and beam
search that go one image at a time (:func:`reference_greedy`, :func:`reference_beam_search`).

:class:`ReferenceDecoder` has layers of its own, built from a
:class:`~captioning.config.ModelConfig` and named as :class:`captioning.models.Decoder` names
its layers, so ``reference.load_state_dict(model.decoder.state_dict())`` gives it a decoder's
weights: the state-dict keys are the public checkpoint format, and the reference reads nothing
else of the decoder. It supports soft attention with the ``additive`` (tanh) and
``additive_relu`` scores.

:func:`check_reference` compares the two on the same weights: teacher-forced logits in fp32,
and captions in fp64 so that the different batch shapes cannot flip near-ties between
candidates. The caption check runs with the random weights and again with the ``<end>`` logit
raised until about half of our captions end (random weights end all or none of them), so that
finished and live beams compete.
"""

from __future__ import annotations

import copy
import dataclasses
import math
from collections.abc import Callable, Mapping
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from captioning.config import DecodeConfig, ModelConfig
from captioning.decoding import Decoded, decode
from captioning.models import AttentionTrace, Decoder, DecoderOutput
from captioning.models.attention import EXPECTATION, HardContext
from captioning.vocab import Vocabulary

LOGITS_TOLERANCE = 1e-5
SCORE_TOLERANCE = 1e-4
# The attention scores the reference implements, by ``model.score``: their activation.
REFERENCE_SCORES: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "additive": torch.tanh,
    "additive_relu": F.relu,
}
GATE_SIZES = ("scalar", "vector", "none")

# --------------------------------------------------------------------------- the decoder


class ReferenceScore(nn.Module):
    """The additive score ``w^T act(W_k a_i + W_q h)``, with the grid projected into keys at
    every call.

    Args:
        feature_dim: D, the grid feature size.
        hidden_dim: H, the LSTM size (the query).
        attention_dim: A, the hidden size of the scoring MLP.
        activation: tanh (``additive``) or ReLU (``additive_relu``).
    """

    def __init__(
        self,
        feature_dim: int,
        hidden_dim: int,
        attention_dim: int,
        activation: Callable[[torch.Tensor], torch.Tensor],
    ) -> None:
        super().__init__()
        self.key_proj = nn.Linear(feature_dim, attention_dim)
        self.query_proj = nn.Linear(hidden_dim, attention_dim, bias=False)
        self.out = nn.Linear(attention_dim, 1)
        self.activation = activation

    def forward(self, features: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        """``features`` (B, L, D), state ``h`` (B, H) → scores (B, L)."""
        keys = self.key_proj(features)  # (B, L, A): the whole grid again, every word
        query = self.query_proj(h).unsqueeze(1)  # (B, 1, A)
        return self.out(self.activation(keys + query)).squeeze(2)  # (B, L)


class ReferenceAttention(nn.Module):
    """Soft attention: the expected feature under the softmax of the scores.

    Args:
        score: the :class:`ReferenceScore`.
    """

    stochastic = False  # soft attention

    def __init__(self, score: ReferenceScore) -> None:
        super().__init__()
        self.score = score

    def forward(self, features: torch.Tensor, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``features`` (B, L, D), ``h`` (B, H) → context (B, D), alpha (B, L)."""
        alpha = torch.softmax(self.score(features, h).float(), dim=1)  # (B, L), fp32 as ours
        context = (features * alpha.unsqueeze(2).to(features.dtype)).sum(dim=1)  # (B, D)
        return context, alpha


def _check_supported(cfg: ModelConfig) -> None:
    if cfg.attention != "soft":
        raise ValueError(
            f"the reference decoder supports soft attention only, not "
            f"model.attention={cfg.attention!r}"
        )
    if cfg.score not in REFERENCE_SCORES:
        raise ValueError(
            f"the reference decoder supports the {' and '.join(REFERENCE_SCORES)} scores "
            f"only, not model.score={cfg.score!r}"
        )
    if cfg.gate not in GATE_SIZES:
        raise ValueError(f"model.gate must be scalar, vector or none, got {cfg.gate!r}")
    if not (cfg.context_to_lstm or cfg.deep_output):
        raise ValueError("model.context_to_lstm=false needs model.deep_output=true")


class ReferenceDecoder(nn.Module):
    """The decoder of :class:`captioning.models.Decoder`, computed the way tutorial code
    computes it: a Python loop over words in which every step re-projects the whole grid into
    attention keys and applies the output layer on its own.

    Its layers are its own and carry the decoder's names, so that a decoder's
    ``state_dict()`` loads strictly (see :func:`load_reference`).

    Args:
        cfg: the model section: attention and score, embedding, attention and LSTM sizes,
            gate, deep output, context_to_lstm, init_state and dropout.
        vocab_size: V.
        feature_dim: D, the grid feature size.

    Raises:
        ValueError: for what the reference does not implement (hard or no attention, scores
            other than ``additive`` and ``additive_relu``).
    """

    def __init__(self, cfg: ModelConfig, vocab_size: int, feature_dim: int) -> None:
        super().__init__()
        _check_supported(cfg)
        embed, hidden = cfg.embed_dim, cfg.hidden_dim
        score = ReferenceScore(feature_dim, hidden, cfg.attention_dim, REFERENCE_SCORES[cfg.score])
        self.attention = ReferenceAttention(score)
        self.embedding = nn.Embedding(vocab_size, embed)
        self.init_h = nn.Linear(feature_dim, hidden)
        self.init_c = nn.Linear(feature_dim, hidden)
        self.tanh_init = cfg.init_state == "tanh"
        gate_size = {"scalar": 1, "vector": feature_dim, "none": 0}[cfg.gate]
        self.gate = nn.Linear(hidden, gate_size) if gate_size else None
        self.context_to_lstm = cfg.context_to_lstm
        self.lstm = nn.LSTMCell(embed + (feature_dim if cfg.context_to_lstm else 0), hidden)
        self.dropout = nn.Dropout(cfg.dropout)
        self.deep_output = cfg.deep_output
        if cfg.deep_output:
            self.hidden_to_out = nn.Linear(hidden, embed)
            self.context_to_out = nn.Linear(feature_dim, embed)
            self.out = nn.Linear(embed, vocab_size)
        else:
            self.out = nn.Linear(hidden, vocab_size)

    def init_state(self, features: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """h_0, c_0 (B, H) each from ``features`` (B, L, D)."""
        mean = features.mean(dim=1)  # (B, D)
        h, c = self.init_h(mean), self.init_c(mean)  # (B, H) each
        return (torch.tanh(h), torch.tanh(c)) if self.tanh_init else (h, c)

    def step(
        self, words: torch.Tensor, h: torch.Tensor, c: torch.Tensor, features: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """One word for B rows: previous ``words`` (B,), state (B, H) each, ``features``
        (B, L, D) → logits (B, V), h, c, alpha (B, L), mean gate beta (B,)."""
        context, alpha = self.attention(features, h)  # (B, D), (B, L)
        if self.gate is not None:
            gate = torch.sigmoid(self.gate(h))  # (B, 1) or (B, D)
            context = gate * context  # (B, D)
            beta = gate.mean(dim=1)  # (B,)
        else:
            beta = context.new_ones(context.shape[0])  # (B,)
        embedded = self.embedding(words)  # (B, E)
        lstm_input = embedded  # (B, E), or (B, E + D) with the context
        if self.context_to_lstm:
            lstm_input = torch.cat([embedded, context], dim=1)
        h, c = self.lstm(lstm_input, (h, c))  # (B, H) each
        if self.deep_output:
            deep = torch.tanh(
                embedded + self.hidden_to_out(self.dropout(h)) + self.context_to_out(context)
            )  # (B, E)
            logits = self.out(self.dropout(deep))  # (B, V)
        else:
            logits = self.out(self.dropout(h))  # (B, V)
        return logits, h, c, alpha, beta

    def forward(
        self,
        features: torch.Tensor,
        tokens: torch.Tensor,
        hard: HardContext = EXPECTATION,
        targets: torch.Tensor | None = None,
    ) -> DecoderOutput:
        """Teacher forcing: ``features`` (B, L, D), input ``tokens`` (B, T) → T steps of
        logits (B, T, V), alphas (B, T, L) and betas (B, T), as :meth:`Decoder.forward`.
        The reference attention is soft: ``hard`` and ``targets`` do not apply to it."""
        h, c = self.init_state(features)
        logits, alphas, betas = [], [], []
        for t in range(tokens.shape[1]):
            step_logits, h, c, alpha, beta = self.step(tokens[:, t], h, c, features)
            logits.append(step_logits)
            alphas.append(alpha)
            betas.append(beta)
        return DecoderOutput(
            logits=torch.stack(logits, dim=1),  # (B, T, V)
            trace=AttentionTrace(torch.stack(alphas, dim=1)),  # (B, T, L)
            betas=torch.stack(betas, dim=1),  # (B, T)
        )


def load_reference(cfg: ModelConfig, state: Mapping[str, torch.Tensor]) -> ReferenceDecoder:
    """A :class:`ReferenceDecoder` holding a copy of the weights in a decoder's ``state``
    (its ``state_dict()``), loaded strictly, on their device and in their dtype.

    Args:
        cfg: the model section the decoder was built from.
        state: the decoder's state dict; V and D are read off ``embedding.weight`` (V, E)
            and ``init_h.weight`` (H, D).
    """
    embedding = state["embedding.weight"]  # (V, E)
    reference = ReferenceDecoder(cfg, embedding.shape[0], state["init_h.weight"].shape[1])
    reference.to(device=embedding.device, dtype=embedding.dtype)
    reference.load_state_dict(state)
    return reference


# --------------------------------------------------------------------------- decoding


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
    :func:`captioning.decoding.greedy_decode`.

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
    :func:`captioning.decoding.beam_search` (same candidates, same rule for which endings
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


# --------------------------------------------------------------------------- checks


def end_biased(
    decoder: Decoder,
    features: torch.Tensor,
    tokens: torch.Tensor,
    decode: Callable[[Decoder, torch.Tensor], Decoded],
    max_length: int,
    target: float = 0.5,
    iterations: int = 7,
) -> tuple[Decoder, float]:
    """A copy of ``decoder`` whose ``<end>`` logit is raised until ``decode`` (ours) ends
    about ``target`` of the captions of ``features`` before ``max_length``.

    Random weights end all captions at once or none, and a bias that ends every caption at
    its first allowed word would test little more; the mixed regime in between is where
    finished and live beams compete. The bias is searched by bisection over quantiles of the
    teacher-forced gap between the best word and ``<end>`` on ``tokens``, which puts it on
    the scale of these weights.

    Args:
        decoder: our decoder (with a deep output or not: ``out.bias`` is raised).
        features: (B, L, D) grids.
        tokens: (B, T) captions, ``<start>`` first.
        decode: decodes ``features`` with a decoder.
        max_length: the longest caption ``decode`` makes.
        target: the share of captions that should end.
        iterations: bisection steps.

    Returns:
        The copy and the quantile used.
    """
    biased = copy.deepcopy(decoder).eval()
    end = Vocabulary.end_id
    with torch.no_grad():
        logits = biased(features, tokens[:, :-1]).logits.double()  # (B, T-1, V)
        words = logits.clone()  # (B, T-1, V)
        words[..., [Vocabulary.pad_id, Vocabulary.start_id, end]] = float("-inf")
        gap = (words.max(dim=2).values - logits[..., end]).flatten()  # (B * (T-1),)
        base = float(biased.out.bias[end])

        def ended_share(quantile: float) -> float:
            biased.out.bias[end] = base + float(torch.quantile(gap, quantile))
            lengths = decode(biased, features).lengths  # (B,)
            return float((lengths < max_length).double().mean())

        low, high = 0.0, 0.5
        for _ in range(iterations):
            middle = (low + high) / 2
            if ended_share(middle) < target:
                low = middle
            else:
                high = middle
        ended_share(high)
    return biased, high


def _compare_captions(
    cfg: ModelConfig,
    decoder: Decoder,
    features: torch.Tensor,
    tokens: torch.Tensor,
    task: str,
    max_length: int,
) -> dict[str, dict[str, float]]:
    """One decoding task, ours against the reference, with ``decoder``'s weights and with
    ``<end>`` raised: per setting the share of identical captions and more."""
    settings, reference_fn = DECODERS[task]
    settings = dataclasses.replace(settings, max_length=max_length)

    def ours(weights: Decoder, grid: torch.Tensor) -> Decoded:
        return decode(weights, grid, settings)

    biased, quantile = end_biased(decoder, features, tokens, ours, max_length)
    results = {}
    for setting, weights in (("random", decoder), ("end_biased", biased)):
        a = ours(weights, features)
        reference = load_reference(cfg, weights.state_dict()).eval()
        b = reference_fn(reference, features, max_length=max_length)
        equal = captions_equal(a, b)
        results[setting] = {
            "equal_share": sum(equal) / len(equal),
            "score_max_abs_diff": float((a.scores.double() - b.scores.double()).abs().max()),
            "ended_share": float((a.lengths < max_length).float().mean()),
            "mean_length": float(a.lengths.float().mean()),
        }
    results["end_biased"]["end_bias_quantile"] = quantile
    return results


def check_reference(
    decoder: Decoder,
    cfg: ModelConfig,
    features: torch.Tensor,
    tokens: torch.Tensor,
    max_length: int,
    device: torch.device,
) -> dict[str, Any]:
    """Ours against the reference on the same weights: the largest teacher-forced logit
    difference (fp32), and per decoding task of ``DECODERS`` the share of identical captions
    (fp64), with the weights as they are and with ``<end>`` raised until about half of our
    captions end (:func:`end_biased`, per task). Ours decodes with
    :func:`captioning.decoding.decode`, the function every caption of the package comes from.

    Args:
        decoder: our decoder; it is copied, not changed.
        cfg: the model section it was built from.
        features: (B, L, D) grids.
        tokens: (B, T) captions, ``<start>`` first.
        max_length: the longest decoded caption.
        device: where both run.
    """
    decoder = copy.deepcopy(decoder).to(device).eval()
    features, tokens = features.to(device), tokens.to(device)
    with torch.no_grad():
        ours = decoder(features, tokens[:, :-1]).logits  # (B, T-1, V)
        reference = load_reference(cfg, decoder.state_dict()).eval()
        theirs = reference(features, tokens[:, :-1]).logits  # (B, T-1, V)
    logits_diff = float((ours - theirs).abs().max())

    # fp64: batched and per-image arithmetic then agree to ~1e-15, far below any real gap
    # between two candidates, so a difference in captions is a difference in the search.
    decoder, features = decoder.double(), features.double()
    captions: dict[str, dict[str, dict[str, float]]] = {"random": {}, "end_biased": {}}
    for task in DECODERS:
        compared = _compare_captions(cfg, decoder, features, tokens, task, max_length)
        for setting, result in compared.items():
            captions[setting][task] = result
    passed = logits_diff <= LOGITS_TOLERANCE and all(
        result["equal_share"] == 1.0 and result["score_max_abs_diff"] <= SCORE_TOLERANCE
        for tasks in captions.values()
        for result in tasks.values()
    )
    return {
        "images": int(features.shape[0]),
        "logits_max_abs_diff": logits_diff,
        "logits_tolerance": LOGITS_TOLERANCE,
        "captions": captions,
        "passed": passed,
    }
