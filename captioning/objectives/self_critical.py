"""Self-critical sequence training (Rennie et al. 2017): captions sampled from the model,
rewarded with CIDEr-D against their image's references, minus a baseline.

For each image the model samples K captions w^k (``train.scst_samples``); each gets the
reward r(w^k) = CIDEr-D(w^k) + lambda BLEU-4(w^k) (``train.scst_bleu_weight``) against the
image's training references, and the loss is

    -1/(B K) sum_b sum_k (r(w^k) - b_k) log p(w^k | I)

where log p sums the log-probabilities of the sampled words and of the ``<end>`` that
closed the caption (a caption cut at the length limit has none), and for hard attention
also the log-probabilities of the sampled cells: the cells are part of the sample. The
baseline b_k (``train.scst_baseline``) is the reward of the greedy caption, decoded without
gradients (``greedy``, Rennie et al.), or the mean reward of the image's other K-1 samples
(``loo``, the "new self-critical" variant of Luo 2020).

Captions are scored with the tokens evaluation gives them: the references pass through
:func:`captioning.metrics.tokenize_for_eval` once, and every vocabulary word is mapped once
to its evaluation tokens, so a sampled caption's tokens are the concatenation of its words'.
The document frequencies of CIDEr-D come from the training references
(:class:`captioning.metrics.cider.CiderD`); they are rebuilt from the training split when a
run starts rather than stored, since they are a function of data the run reads anyway and
would add the whole n-gram table to every checkpoint.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from captioning.config import Config
from captioning.data.records import ImageRecord
from captioning.data.vocab import Vocabulary
from captioning.errors import CaptioningError
from captioning.inference.decoding import Decoded, greedy_decode, sample_decode
from captioning.metrics.bleu import sentence_bleu
from captioning.metrics.captions import tokenize_for_eval
from captioning.metrics.cider import CiderD
from captioning.models.attention import EXPECTATION, HardContext
from captioning.models.captioner import Captioner
from captioning.objectives.base import Batch, LossTerms, ObjectiveContext, register_objective
from captioning.runtime import autocast


class CaptionReward:
    """The reward of generated captions: CIDEr-D (plus ``bleu_weight`` times BLEU-4)
    against the references of the image each was generated for.

    Args:
        records: the images whose references reward captions (the training split); an
            image is named by its position in this list (a dataset index).
        vocab: the vocabulary of the generated token ids.
        bleu_weight: the weight of BLEU-4 in the reward.
    """

    def __init__(
        self, records: Sequence[ImageRecord], vocab: Vocabulary, bleu_weight: float = 0.0
    ) -> None:
        raw: dict[tuple[str, int], list[str]] = {
            ("image", index): list(record.captions) for index, record in enumerate(records)
        }
        raw.update({("word", i): [word] for i, word in enumerate(vocab.itos)})
        tokenized = tokenize_for_eval(raw)  # one Java run
        self.references = {index: tokenized[("image", index)] for index in range(len(records))}
        self.cider = CiderD(self.references)
        self.bleu_weight = bleu_weight
        self.word_tokens = [tokenized[("word", i)][0] for i in range(len(vocab))]
        for special in (Vocabulary.pad_id, Vocabulary.start_id, Vocabulary.end_id):
            self.word_tokens[special] = ""  # never part of a decoded caption

    def captions(self, tokens: torch.Tensor, lengths: torch.Tensor) -> list[str]:
        """Evaluation tokens of generated captions, joined by spaces: ``tokens`` (N, T)
        word ids, ``lengths`` (N,) words per caption."""
        out = []
        for row, length in zip(tokens.tolist(), lengths.tolist()):
            out.append(" ".join(t for t in (self.word_tokens[i] for i in row[:length]) if t))
        return out

    def __call__(
        self, tokens: torch.Tensor, lengths: torch.Tensor, keys: Sequence[int]
    ) -> torch.Tensor:
        """Rewards (N,) in float64 of generated captions ``tokens`` (N, T) of ``lengths``
        (N,) words, each against the references of image ``keys[n]``."""
        captions = self.captions(tokens, lengths)
        rewards = self.cider.score(captions, keys)
        if self.bleu_weight:
            rewards = [
                r + self.bleu_weight * sentence_bleu(c, self.references[k])
                for r, c, k in zip(rewards, captions, keys)
            ]
        return torch.tensor(rewards, dtype=torch.float64)


def leave_one_out(rewards: torch.Tensor) -> torch.Tensor:
    """Each sample's baseline: the mean reward of the other samples of its image,
    (B, K) → (B, K)."""
    samples = rewards.shape[1]
    return (rewards.sum(dim=1, keepdim=True) - rewards) / (samples - 1)


def teacher_inputs(sampled: Decoded, max_length: int) -> torch.Tensor:
    """Sampled captions as whole token sequences (N, T+2) for teacher forcing:
    ``<start>``, the words, ``<end>`` if the caption ended (a caption of ``max_length``
    words was cut and has none), then ``<pad>``."""
    rows, steps = sampled.tokens.shape
    inputs = sampled.tokens.new_full((rows, steps + 2), Vocabulary.pad_id)  # (N, T+2)
    inputs[:, 0] = Vocabulary.start_id
    inputs[:, 1 : steps + 1] = sampled.tokens
    ended = sampled.lengths < max_length  # (N,)
    row = torch.arange(rows, device=inputs.device)[ended]
    inputs[row, sampled.lengths[ended] + 1] = Vocabulary.end_id
    return inputs


class SelfCriticalObjective:
    """Self-critical sequence training's objective (see the module docstring). It keeps
    no state between steps: the baselines are computed afresh on every batch.

    Args:
        cfg: the run's config (``train.scst_*`` and, for decoding, ``decode``).
        reward: scores sampled captions against the training references.
        device, precision: where and in which precision the forward passes run.
        hard: the model has hard attention, whose sampled cells are part of the sample.
    """

    def __init__(
        self,
        cfg: Config,
        reward: CaptionReward,
        device: torch.device,
        precision: str,
        hard: bool = False,
    ) -> None:
        self.cfg = cfg
        self.reward = reward
        self.device = device
        self.precision = precision
        self.hard = hard
        self.samples = cfg.train.scst_samples
        self.max_length = cfg.train.scst_max_length or cfg.decode.max_length
        self._last: dict[str, float] = {}

    def loss(self, module: nn.Module, batch: Batch) -> LossTerms:
        """The loss of one batch (``module``: the captioner or its DDP wrapper); the
        reference tokens are not used, the images' ``indices`` (B,) name their
        references."""
        images, grid, indices = batch.images, batch.grid, batch.indices
        if indices is None:
            raise ValueError("self-critical training needs the images' dataset indices")
        model: Captioner = getattr(module, "module", module)
        was_training = model.training
        # Dropout off: the log-probability below comes from a second forward pass, and
        # with a fresh dropout mask it would score the sample under another policy than
        # the one that drew it. (BatchNorm then uses its running statistics.)
        model.eval()
        try:
            sampled, greedy = self._decode(model, images, grid)
            keys = indices.repeat_interleave(self.samples).tolist()
            rewards = self.reward(sampled.tokens.cpu(), sampled.lengths.cpu(), keys)  # (R,)
            rewards = rewards.view(-1, self.samples)  # (B, K)
            if greedy is None:
                baseline = leave_one_out(rewards)  # (B, K)
            else:
                greedy_rewards = self.reward(
                    greedy.tokens.cpu(), greedy.lengths.cpu(), indices.tolist()
                )
                baseline = greedy_rewards.unsqueeze(1).expand_as(rewards)  # (B, K)
            advantage = (rewards - baseline).flatten().to(self.device, torch.float32)  # (R,)
            log_probs, mask = self.sample_log_probs(module, images, grid, sampled)  # (R, T)
        finally:
            model.train(was_training)
        sequence = log_probs.sum(dim=1)  # (R,)
        num_tokens = int(mask.sum())
        self._last = {
            "baseline": float(baseline.mean()),
            "advantage": float(advantage.abs().mean()),
        }
        return LossTerms(
            total=-(advantage * sequence).mean(),
            nll=-sequence.mean().detach(),
            nll_per_token=(-log_probs.sum() / max(num_tokens, 1)).detach(),
            penalty=None,  # the reward has no doubly stochastic term
            tokens=num_tokens,
            reward=rewards.mean().float(),
        )

    @torch.no_grad()
    def _decode(
        self, model: Captioner, images: torch.Tensor | None, grid: torch.Tensor | None
    ) -> tuple[Decoded, Decoded | None]:
        """K sampled captions per image (image-major rows), and the greedy ones when they
        are the baseline; no gradients."""
        decode = self.cfg.decode
        with autocast(self.device, self.precision):
            features = model.encode(images, grid)  # (B, L, D)
            sampled = sample_decode(
                model.decoder,
                features,
                samples=self.samples,  # B*K rows
                max_length=self.max_length,
                min_length=decode.min_length,
                suppress_unk=not decode.allow_unk,
                temperature=self.cfg.train.scst_temperature,
                hard_context="sample" if self.hard else "expectation",
            )
            greedy = None
            if self.cfg.train.scst_baseline == "greedy":
                greedy = greedy_decode(
                    model.decoder,
                    features,
                    max_length=self.max_length,
                    min_length=decode.min_length,
                    suppress_unk=not decode.allow_unk,
                    hard_context=decode.hard_context,
                )
        return sampled, greedy

    def sample_log_probs(
        self,
        module: nn.Module,
        images: torch.Tensor | None,
        grid: torch.Tensor | None,
        sampled: Decoded,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """log p of every sampled word and closing ``<end>`` (R, T), differentiable, and
        the mask (R, T) of those positions: one teacher-forced pass over the samples, with
        the distribution they were drawn from (the same masked words, the temperature)
        and, for hard attention, the sampled cells imposed and their log-probabilities
        added."""
        decode = self.cfg.decode
        inputs = teacher_inputs(sampled, self.max_length).to(self.device)  # (R, T+2)
        targets = inputs[:, 1:]  # (R, T+1)
        hard = EXPECTATION
        if self.hard:
            cells = torch.zeros_like(targets)  # (R, T+1); steps after the caption unused
            chosen = sampled.trace.cell  # (R, t): the cells the samples were drawn with
            cells[:, : chosen.shape[1]] = chosen
            hard = HardContext(mode="sample", cells=cells)
        with autocast(self.device, self.precision):
            output = module(images, inputs, grid=grid, hard=hard, repeat=self.samples)
        logits = output.logits.float()  # (R, T+1, V)
        banned = torch.zeros(logits.shape[1:], dtype=torch.bool, device=logits.device)
        banned[:, [Vocabulary.pad_id, Vocabulary.start_id]] = True  # (T+1, V)
        if not decode.allow_unk:
            banned[:, Vocabulary.unk_id] = True
        banned[: decode.min_length, Vocabulary.end_id] = True
        logits = logits.masked_fill(banned, float("-inf"))
        log_probs = torch.log_softmax(logits / self.cfg.train.scst_temperature, dim=2)
        mask = (targets != Vocabulary.pad_id).float()  # (R, T+1)
        word = log_probs.gather(2, targets.unsqueeze(2)).squeeze(2)  # (R, T+1)
        word = torch.where(mask.bool(), word, 0.0)  # padding's -inf must not reach the sum
        if self.hard:
            word = word + output.log_probs.float() * mask
        return word, mask

    def commit(self) -> None:
        """Called once the step is known to be finite; nothing to update."""

    def discard(self) -> None:
        """Called when the step was skipped; nothing to forget."""

    def scalars(self) -> dict[str, float]:
        """The last step's mean baseline and mean absolute advantage."""
        return dict(self._last)

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Nothing to restore."""


def self_critical(context: ObjectiveContext) -> SelfCriticalObjective:
    """``train.objective=scst``: sampled captions rewarded against the training split's
    references (``context.train_records``, in ``context.vocab``'s words)."""
    if context.vocab is None or not context.train_records:
        raise CaptioningError("self-critical training needs the training images and vocabulary")
    cfg = context.cfg
    reward = CaptionReward(context.train_records, context.vocab, cfg.train.scst_bleu_weight)
    return SelfCriticalObjective(
        cfg, reward, context.device, cfg.train.precision, hard=context.model.hard_attention
    )


register_objective("scst", self_critical)
