"""Maximum likelihood for soft (or no) attention: masked cross-entropy and the doubly
stochastic attention penalty, and the objective that trains with them (hard attention's
lives in :mod:`captioning.objectives.hard_attention`, which shares the terms).

Normalisation follows the authors' code: the negative log-likelihood is summed over the words
of a caption and averaged over captions, and the penalty lambda * sum_i (1 - sum_t alpha_ti)^2
is per caption too, so lambda means what it means in the paper. Padding never counts.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from captioning.data.records import ImageRecord
from captioning.data.vocab import Vocabulary
from captioning.models.decoder import DecoderOutput
from captioning.models.word_maps import SPECIAL_IDS, map_divergence, presence_loss
from captioning.objectives.base import Batch, LossTerms
from captioning.runtime import autocast


def token_nll(logits: torch.Tensor, targets: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """-log p(y_t) per position, 0 on padding: (B, T, V), (B, T), (B, T) → (B, T)."""
    nll = F.cross_entropy(
        logits.float().flatten(0, 1), targets.flatten(), reduction="none"
    ).view_as(targets)  # (B, T)
    return nll * mask


def smoothed_nll(
    logits: torch.Tensor, targets: torch.Tensor, mask: torch.Tensor, smoothing: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """-log p(y_t) and the label-smoothed cross-entropy (Szegedy et al. 2016)
    ``(1 - smoothing) * -log p(y_t) + smoothing * mean_v -log p(v)`` per position, 0 on
    padding, from one log-softmax: (B, T, V), (B, T), (B, T) → (B, T), (B, T)."""
    log_p = torch.log_softmax(logits.float(), dim=-1)  # (B, T, V)
    nll = -log_p.gather(2, targets.unsqueeze(2)).squeeze(2)  # (B, T)
    smoothed = (1.0 - smoothing) * nll - smoothing * log_p.mean(dim=-1)  # (B, T)
    return nll * mask, smoothed * mask


def doubly_stochastic_penalty(alphas: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """sum_i (1 - sum_t alpha_ti)^2 per caption, summing only real (unpadded) steps.

    Args:
        alphas: (B, T, L) attention weights.
        mask: (B, T) 1 for real steps.
    Returns:
        (B,) the penalty of each caption.
    """
    coverage = (alphas * mask.unsqueeze(2)).sum(dim=1)  # (B, L)
    return ((1.0 - coverage) ** 2).sum(dim=1)  # (B,)


def attention_entropy(alphas: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """H(alpha_t) summed over real steps: (B, T, L), (B, T) → (B,)."""
    entropy = -(alphas * torch.log(alphas.clamp_min(1e-12))).sum(dim=2)  # (B, T)
    return (entropy * mask).sum(dim=1)


def caption_loss(
    output: DecoderOutput,
    targets: torch.Tensor,
    pad_id: int,
    penalty_weight: float = 1.0,
    label_smoothing: float = 0.0,
    entropy_weight: float = 0.0,
    context_weight: float = 0.0,
    map_weight: float = 0.0,
    expected_weight: float = 0.0,
) -> LossTerms:
    """Soft (or no) attention: NLL + lambda * the doubly stochastic penalty (+ w * the
    entropy of each word's map, summed over the words, + u * the NLL of each word read from
    its attended context alone, + k * KL from the word localiser's map of each word to its
    attention map, summed over the words, + v * the NLL of each word read from the
    attention's query by the expected-word score), per caption, averaged over captions;
    with a word localiser, its own presence loss too (which moves only the localiser). A
    hard model's sampled output gives its likelihood given the samples here; its estimator
    terms come from :mod:`captioning.objectives.hard_attention`.

    Args:
        output: the decoder's teacher-forced output for ``targets``.
        targets: (B, T) the next words (``tokens[:, 1:]``).
        pad_id: the padding id; those positions count nowhere.
        label_smoothing: trains on the smoothed cross-entropy; the logged NLL stays the
            plain one.
        entropy_weight: w of the maps' entropy (nats, summed over the words); 0 leaves it
            out of the loss (it is logged all the same).
        context_weight: u of the context-word NLL (``output.context_logits``, which the
            decoder's ``context_words`` layer gives); logged whenever they are there.
        map_weight: k of the map term (``output.word_maps``, which the captioner's word
            localiser gives); the localiser's loss and the term are logged whenever it is
            there.
        expected_weight: v of the expected-word NLL (``output.expected_logits``, which
            ``model.word_attention``'s layer gives); logged whenever they are there.
    """
    mask = (targets != pad_id).float()  # (B, T)
    trained = None
    if label_smoothing > 0:
        nll, trained = smoothed_nll(output.logits, targets, mask, label_smoothing)  # (B, T)
    else:
        nll = token_nll(output.logits, targets, mask)  # (B, T)
    penalty = doubly_stochastic_penalty(output.alphas, mask)  # (B,)
    terms = caption_terms(nll, penalty, penalty_weight, mask, trained=trained)
    entropy = attention_entropy(output.alphas.float(), mask)  # (B,)
    if entropy_weight > 0:
        terms.total = terms.total + entropy_weight * entropy.mean()
    terms.entropy = entropy.mean().detach()  # nats a caption, as hard attention logs it
    if output.context_logits is not None:
        context_nll = token_nll(output.context_logits, targets, mask)  # (B, T)
        if context_weight > 0:
            terms.total = terms.total + context_weight * context_nll.sum(dim=1).mean()
        terms.context_nll = (context_nll.sum() / max(terms.tokens, 1)).detach()
    elif context_weight > 0:
        raise ValueError("context_weight needs the decoder's context_words layer")
    return word_terms(terms, output, targets, mask, map_weight, expected_weight)


def word_terms(
    terms: LossTerms,
    output: DecoderOutput,
    targets: torch.Tensor,
    mask: torch.Tensor,
    map_weight: float = 0.0,
    expected_weight: float = 0.0,
) -> LossTerms:
    """``terms`` with the word localiser's terms added, whichever objective made them (soft
    attention's cross-entropy or hard attention's estimators): the localiser's own presence
    loss, k * the map term and v * the expected-word NLL, each summed over a caption's
    words and averaged over captions; each is logged whenever the model has its part.
    ``targets`` and ``mask`` (R, T) are the rows ``output`` decoded."""
    if output.word_maps is not None:
        presence = presence_loss(output.word_maps)
        divergence = map_divergence(output.word_maps, output.alphas) * mask  # (R, T)
        terms.total = terms.total + presence
        if map_weight > 0:
            terms.total = terms.total + map_weight * divergence.sum(dim=1).mean()
        words = output.word_maps.words.float() * mask
        terms.presence = presence.detach()
        terms.map_kl = (divergence.sum() / words.sum().clamp_min(1.0)).detach()
    elif map_weight > 0:
        raise ValueError("map_weight needs the captioner's word localiser")
    if output.expected_logits is not None:
        expected_nll = token_nll(output.expected_logits, targets, mask)  # (R, T)
        if expected_weight > 0:
            terms.total = terms.total + expected_weight * expected_nll.sum(dim=1).mean()
        terms.expected_nll = (expected_nll.sum() / mask.sum().clamp_min(1.0)).detach()
    elif expected_weight > 0:
        raise ValueError("expected_weight needs the attention's expected-word score")
    return terms


class ImageWords:
    """The words of each training image's reference captions, looked up by the images'
    places in the split (``train.word_map_labels=image``).

    Args:
        captions: per image, its reference captions as token ids.
    """

    def __init__(self, captions: Sequence[Sequence[Sequence[int]]]) -> None:
        sets = [sorted({i for ids in image for i in ids} - set(SPECIAL_IDS)) for image in captions]
        width = max((len(words) for words in sets), default=0)
        table = torch.full((len(sets), max(width, 1)), SPECIAL_IDS[0], dtype=torch.long)
        for row, words in enumerate(sets):
            table[row, : len(words)] = torch.tensor(words, dtype=torch.long)
        self.table = table  # (N, K), padded with <pad>

    @classmethod
    def from_records(cls, records: Sequence[ImageRecord], vocab: Vocabulary) -> ImageWords:
        """From the split's records, each caption encoded by ``vocab``."""
        return cls([[vocab.encode(c) for c in record.captions] for record in records])

    def __call__(self, indices: torch.Tensor | None, device: torch.device) -> torch.Tensor:
        """(B, K) the words of the images at ``indices`` (B,), on ``device``."""
        if indices is None:
            raise ValueError("train.word_map_labels=image needs the images' dataset indices")
        return self.table[indices.cpu()].to(device)


def caption_terms(
    nll: torch.Tensor,
    penalty: torch.Tensor,
    penalty_weight: float,
    mask: torch.Tensor,
    trained: torch.Tensor | None = None,
) -> LossTerms:
    """The cross-entropy objective's terms from per-token NLL (B, T) and penalty (B,);
    ``trained`` (B, T), when given, is the per-token loss back-propagated in place of the
    NLL (label smoothing)."""
    nll_caption = nll.sum(dim=1)  # (B,)
    trained_caption = nll_caption if trained is None else trained.sum(dim=1)  # (B,)
    num_tokens = int(mask.sum())
    return LossTerms(
        total=(trained_caption + penalty_weight * penalty).mean(),
        nll=nll_caption.mean().detach(),
        nll_per_token=(nll.sum() / max(num_tokens, 1)).detach(),
        penalty=penalty.mean().detach(),
        tokens=num_tokens,
    )


class CrossEntropyObjective:
    """Soft (or no) attention's training objective: teacher-forced cross-entropy plus the
    doubly stochastic penalty. It has no state; it meets the
    :class:`~captioning.objectives.base.Objective` protocol as hard attention's and
    self-critical training's do, so that training never asks which it trains.

    Args:
        penalty_weight: lambda of the doubly stochastic penalty.
        label_smoothing: the share of each target's probability spread over the vocabulary.
        entropy_weight: w of the attention maps' entropy (see :func:`caption_loss`).
        context_weight: u of the context-word NLL (see :func:`caption_loss`).
        map_weight: k of the word-map term (see :func:`caption_loss`).
        expected_weight: v of the expected-word NLL (see :func:`caption_loss`).
        image_words: the words of each training image's references, the localiser's
            positives (``train.word_map_labels=image``); None: each caption's own words.
        device, precision: where and in which precision the forward pass runs.
    """

    def __init__(
        self,
        penalty_weight: float,
        device: torch.device,
        precision: str,
        label_smoothing: float = 0.0,
        entropy_weight: float = 0.0,
        context_weight: float = 0.0,
        map_weight: float = 0.0,
        expected_weight: float = 0.0,
        image_words: ImageWords | None = None,
    ) -> None:
        self.penalty_weight = penalty_weight
        self.image_words = image_words
        self.context_weight = context_weight
        self.map_weight = map_weight
        self.expected_weight = expected_weight
        self.label_smoothing = label_smoothing
        self.entropy_weight = entropy_weight
        self.device = device
        self.precision = precision

    def loss(self, module: nn.Module, batch: Batch) -> LossTerms:
        """The loss of one batch (``module``: the captioner or its DDP wrapper)."""
        # the localiser's image-level positives, passed only when used
        labels: dict[str, torch.Tensor] = {}
        if self.image_words is not None:
            labels["present"] = self.image_words(batch.indices, batch.tokens.device)
        with autocast(self.device, self.precision):
            output = module(batch.images, batch.tokens, grid=batch.grid, **labels)
        return caption_loss(
            output,
            batch.tokens[:, 1:],
            Vocabulary.pad_id,
            self.penalty_weight,
            label_smoothing=self.label_smoothing,
            entropy_weight=self.entropy_weight,
            context_weight=self.context_weight,
            map_weight=self.map_weight,
            expected_weight=self.expected_weight,
        )

    def commit(self) -> None:
        """Called once the step is known to be finite; nothing to update."""

    def discard(self) -> None:
        """Called when the step was skipped; nothing to forget."""

    def scalars(self) -> dict[str, float]:
        return {}

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Nothing to restore."""
