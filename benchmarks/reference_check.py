"""The check that the reference computes what ours computes, on the same weights.

:func:`check_reference` compares teacher-forced logits in fp32, and captions in fp64 so that
the different batch shapes cannot flip near-ties between candidates. The caption check runs
with the random weights and again with the ``<end>`` logit raised until about half of our
captions end (:func:`end_biased`; random weights end all or none of them), so that finished
and live beams compete.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable
from typing import Any

import torch

from benchmarks.reference import load_reference
from benchmarks.reference_decoding import DECODERS, captions_equal
from captioning.config import ModelConfig
from captioning.data.vocab import Vocabulary
from captioning.inference.decoding import Decoded, decode
from captioning.models import Decoder

LOGITS_TOLERANCE = 1e-5
SCORE_TOLERANCE = 1e-4


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
    difference (fp32), and per decoding task of ``DECODERS`` the share of identical captions (fp64),
    with the weights as they are and with ``<end>`` raised until about half of our captions end
    (:func:`end_biased`, per task). Ours decodes with :func:`captioning.inference.decoding.decode`,
    the function every caption of the package comes from.

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
