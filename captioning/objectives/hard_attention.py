"""Training hard attention: one objective, five gradient estimators.

The model (:class:`captioning.models.attention.HardAttention`) only samples a cell per word
and reports log alpha of it. Everything else that training a hard model needs lives in one
:class:`HardAttentionObjective`: the estimator (``train.hard_estimator``), its state (the
moving-average baseline, the Gumbel temperature), the paper's mixing of sampled and expected
contexts, and the random stream of the samples. Its state changes only after a step is known
to be finite (:meth:`HardAttentionObjective.commit`), from statistics summed over all
processes, and goes into checkpoints.

With r(s) = log p(y | s, a) the caption's log-likelihood given cells s = (s_1..s_T) and
q(s) = prod_t alpha_t(s_t), the estimators (per caption; docs/hard-attention.md lists them
with their costs):

- ``reinforce`` (the paper): -log p(y | s, a) - lambda_r (r(s) - b) log q(s) - lambda_e H,
  b a moving average of r (decay 0.9). Unbiased for d E_q[r(s)] when lambda_r = 1.
- ``reinforce_loo``: K samples per caption, each baseline the mean reward of the other K-1
  (Kool et al. 2019). Unbiased, no baseline state.
- ``vimco``: the K-sample bound L_K = log (1/K) sum_k p(y | s_k) (tighter than E_q[r] and
  approaching log p(y | a) as K grows), with per-sample control variates
  L_K - L_K^{-k}, where r(s_k) is replaced by the mean of the others (Mnih & Rezende 2016).
  Unbiased for d L_K.
- ``gumbel``: straight-through Gumbel-softmax (hard one-hot forward, relaxed backward) with a
  temperature annealed per step. Biased.
- ``exact``: log p(y | a) = sum_t log sum_l alpha_tl p(y_t | a_l, h_t), exact when the LSTM
  never sees the context (``model.context_to_lstm: false``): no samples, no variance. With
  ``train.exact_soft_p`` > 0 that share of the minibatches trains the expected context
  instead, as the paper mixes its sampled minibatches with soft ones.

A hard model with a word localiser (``model.word_maps``, and ``model.word_attention`` whose
expected words' maps join the sampling distribution's score) adds the localiser's terms to
every estimator's loss, as the cross-entropy objective does
(:func:`captioning.objectives.cross_entropy.word_terms`): they are trained by their own
losses, not by the reward.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import torch
from torch import nn

from captioning.config import Config
from captioning.data.vocab import Vocabulary
from captioning.distributed import SINGLE, World, sum_over_ranks
from captioning.models.attention import HardContext
from captioning.models.decoder import DecoderOutput
from captioning.objectives.base import Batch, LossTerms
from captioning.objectives.cross_entropy import (
    ImageWords,
    attention_entropy,
    caption_terms,
    doubly_stochastic_penalty,
    token_nll,
    word_terms,
)
from captioning.runtime import autocast

ESTIMATORS = ("reinforce", "reinforce_loo", "vimco", "gumbel", "exact")
MULTI_SAMPLE = ("reinforce_loo", "vimco")

# The per-step random streams: the mixing coin (as before these estimators existed) and,
# offset from it, the noise that decides the sampled cells.
_COIN_STRIDE = 1_000_003
_NOISE_OFFSET = 1 << 40


class MovingAverageBaseline:
    """b <- decay * b + (1 - decay) * mean reward, the paper's variance-reduction baseline.

    The first update sets b to the first mean reward, so early rewards are not compared with
    an arbitrary zero. Its state is three numbers, saved in checkpoints.
    """

    def __init__(self, decay: float = 0.9) -> None:
        self.decay = decay
        self.value = 0.0
        self.initialized = False

    def update(self, mean: float) -> None:
        """Move towards ``mean``, the mean reward of one step's sampled captions."""
        if not self.initialized:
            self.value, self.initialized = mean, True
        else:
            self.value = self.decay * self.value + (1.0 - self.decay) * mean

    def state_dict(self) -> dict[str, float | bool]:
        return {"value": self.value, "initialized": self.initialized, "decay": self.decay}

    def load_state_dict(self, state: dict[str, float | bool]) -> None:
        self.value = float(state["value"])
        self.initialized = bool(state["initialized"])
        self.decay = float(state["decay"])


@dataclass
class _Plan:
    """How one batch is run: the context option and the samples per caption."""

    hard: HardContext
    repeat: int


@dataclass
class _Sampled:
    """A hard model's teacher-forced output with the quantities every estimator uses."""

    output: DecoderOutput
    mask: torch.Tensor  # (R, T) real words
    nll: torch.Tensor  # (R, T) -log p(y_t | ...), 0 on padding
    penalty: torch.Tensor  # (R,)
    step_mask: torch.Tensor  # (R, T) real words whose context was a sampled cell
    rows: torch.Tensor  # (R,) bool, captions that sampled at all

    @property
    def rewards(self) -> torch.Tensor:
        """r = log p(y | s, a) per row (R,), detached."""
        return -self.nll.sum(dim=1).detach()

    @cached_property
    def entropies(self) -> torch.Tensor:
        """The attention entropy of the sampled steps, per row (R,)."""
        return attention_entropy(self.output.alphas, self.step_mask)

    def score(self) -> torch.Tensor:
        """log q(s) of the sampled steps, per row (R,), differentiable."""
        return (self.output.log_probs * self.step_mask).sum(dim=1)


class HardAttentionObjective:
    """Hard attention's training objective (see the module docstring).

    Args:
        cfg: the run's config (``train`` holds the estimator and its settings).
        cells: L, the number of grid cells.
        device, precision: where and in which precision the forward pass runs.
        world: this process among the training processes; the samples of every row of the
            global batch come from one stream, so N processes x batch B sample what one
            process x batch N*B samples.
        image_words: the word localiser's image-level positives
            (``train.word_map_labels=image``); None: each caption's own words.
    """

    def __init__(
        self,
        cfg: Config,
        cells: int,
        device: torch.device,
        precision: str,
        world: World = SINGLE,
        image_words: ImageWords | None = None,
    ) -> None:
        self.cfg = cfg.train
        self.image_words = image_words
        self.estimator = cfg.train.hard_estimator
        self.cells = cells
        self.device = device
        self.precision = precision
        self.world = world
        self.baseline = MovingAverageBaseline(cfg.train.baseline_decay)
        self.temperature = cfg.train.gumbel_temperature
        self._pending: tuple[float, float] | None = None  # (sum of rewards, count)

    # ------------------------------------------------------------------ the batch

    def plan(self, step: int, batch: int, steps: int) -> _Plan:
        """The context option of optimisation step ``step`` for this process's ``batch``
        captions of ``steps`` words: the mixing coin, then the noise of the samples."""
        cfg = self.cfg
        coin = torch.Generator().manual_seed(cfg.seed * _COIN_STRIDE + step)
        if self.estimator == "exact":
            if cfg.exact_soft_p > 0 and float(torch.rand((), generator=coin)) < cfg.exact_soft_p:
                return _Plan(HardContext(mode="expectation"), repeat=1)
            return _Plan(HardContext(mode="marginal"), repeat=1)
        first = self.world.rank * batch  # this process's rows in the global batch
        use_expectation = None
        if cfg.semi_sampling == "batch":
            if float(torch.rand((), generator=coin)) >= cfg.semi_sampling_p:
                return _Plan(HardContext(mode="expectation"), repeat=1)
        else:
            draws = torch.rand(self.world.size * batch, generator=coin)
            use_expectation = draws[first : first + batch] >= cfg.semi_sampling_p  # (B,)
        repeat = cfg.hard_samples if self.estimator in MULTI_SAMPLE else 1
        stream = torch.Generator().manual_seed(cfg.seed * _COIN_STRIDE + step + _NOISE_OFFSET)
        # Exp(1) noise per (word, caption, sample, cell), word-major so that a caption's
        # first t words get the same noise whatever the batch's longest caption.
        noise = torch.empty(steps, self.world.size * batch, repeat, self.cells)
        noise.exponential_(generator=stream)
        noise = noise[:, first : first + batch].permute(1, 2, 0, 3).flatten(0, 1)  # (B*K, T, L)
        if use_expectation is not None:
            use_expectation = use_expectation.repeat_interleave(repeat).to(self.device)
        hard = HardContext(
            mode="gumbel" if self.estimator == "gumbel" else "sample",
            use_expectation=use_expectation,
            noise=noise.to(self.device),
            temperature=self.temperature,
        )
        return _Plan(hard, repeat)

    def loss(self, module: nn.Module, batch: Batch) -> LossTerms:
        """The loss of one batch (``module``: the captioner or its DDP wrapper). The
        statistics that update the objective's state wait for :meth:`commit`."""
        tokens = batch.tokens
        plan = self.plan(batch.step, tokens.shape[0], tokens.shape[1] - 1)
        # the localiser's image-level positives, passed only when used
        labels: dict[str, torch.Tensor] = {}
        if self.image_words is not None:
            labels["present"] = self.image_words(batch.indices, tokens.device)
        with autocast(self.device, self.precision):
            output = module(
                batch.images,
                tokens,
                grid=batch.grid,
                hard=plan.hard,
                repeat=plan.repeat,
                **labels,
            )
        targets = tokens[:, 1:].repeat_interleave(plan.repeat, dim=0)  # (R, T)
        mask = (targets != Vocabulary.pad_id).float()
        if plan.hard.mode == "marginal":
            nll = -output.target_log_probs.float() * mask  # (R, T)
        else:
            nll = token_nll(output.logits, targets, mask)
        penalty = doubly_stochastic_penalty(output.alphas, mask)
        if output.log_probs is None:  # the expected context or the exact marginal
            self._pending = None
            terms = caption_terms(nll, penalty, self.cfg.doubly_stochastic_weight, mask)
            if plan.hard.mode == "marginal":  # the maps the marginal sums over, as sampled
                terms.entropy = attention_entropy(output.alphas, mask).mean().detach()
        else:
            step_mask = mask * output.sampled.float()
            sampled = _Sampled(output, mask, nll, penalty, step_mask, step_mask.sum(dim=1) > 0)
            terms = _ESTIMATORS[self.estimator](self, sampled, plan.repeat)
        cfg = self.cfg
        return word_terms(
            terms, output, targets, mask, cfg.word_map_weight, cfg.expected_word_weight
        )

    # ------------------------------------------------------------------ the estimators

    def _terms(
        self,
        sampled: _Sampled,
        per_caption: torch.Tensor,
        surrogate: torch.Tensor | None,
    ) -> LossTerms:
        """Loss terms from the per-row objective ``per_caption`` (R,) (to minimise)."""
        rewards = sampled.rewards
        rows = sampled.rows
        num_tokens = int(sampled.mask.sum())
        entropies = sampled.entropies
        any_rows = bool(rows.any())
        reward = rewards[rows].mean() if any_rows else rewards.new_zeros(())
        if self.estimator == "reinforce" and any_rows:
            self._pending = (float(rewards[rows].sum()), float(rows.sum()))
        else:
            self._pending = (0.0, 0.0) if self.estimator == "reinforce" else None
        return LossTerms(
            total=per_caption.mean(),
            nll=sampled.nll.sum(dim=1).mean().detach(),
            nll_per_token=(sampled.nll.sum() / max(num_tokens, 1)).detach(),
            penalty=sampled.penalty.mean().detach(),
            tokens=num_tokens,
            reinforce=None if surrogate is None else surrogate.mean().detach(),
            entropy=entropies.mean().detach(),
            reward=reward.detach(),
        )

    def _base(self, sampled: _Sampled) -> torch.Tensor:
        """The terms every sampling estimator shares, per row: the NLL given the samples,
        the doubly stochastic penalty and the entropy bonus."""
        cfg = self.cfg
        return (
            sampled.nll.sum(dim=1)
            + cfg.doubly_stochastic_weight * sampled.penalty
            - cfg.entropy_weight * sampled.entropies
        )

    def _reinforce(self, sampled: _Sampled, repeat: int) -> LossTerms:
        """The paper: -(r - b) log q(s) with the moving-average baseline b."""
        advantage = sampled.rewards - self.baseline.value  # (R,)
        surrogate = -advantage * sampled.score()  # (R,)
        per_caption = self._base(sampled) + self.cfg.reinforce_weight * surrogate
        return self._terms(sampled, per_caption, surrogate)

    def _reinforce_loo(self, sampled: _Sampled, repeat: int) -> LossTerms:
        """K samples per caption; each one's baseline is the mean reward of the others."""
        rewards = sampled.rewards.view(-1, repeat)  # (B, K)
        others = (rewards.sum(dim=1, keepdim=True) - rewards) / (repeat - 1)  # (B, K)
        surrogate = -(rewards - others).flatten() * sampled.score()  # (R,)
        per_caption = self._base(sampled) + self.cfg.reinforce_weight * surrogate
        return self._terms(sampled, per_caption, surrogate)

    def _vimco(self, sampled: _Sampled, repeat: int) -> LossTerms:
        """-L_K with L_K = log mean_k p(y | s_k) (differentiated through the likelihoods),
        and -sum_k (L_K - L_K^{-k}) log q(s_k) for the sampling distribution."""
        cfg = self.cfg
        log_likelihood = -sampled.nll.sum(dim=1).view(-1, repeat)  # (B, K), differentiable
        bound = torch.logsumexp(log_likelihood, dim=1) - math.log(repeat)  # (B,)
        rewards = log_likelihood.detach()
        others = (rewards.sum(dim=1, keepdim=True) - rewards) / (repeat - 1)  # (B, K)
        # L_K^{-k}: sample k's likelihood replaced by the geometric mean of the others'
        eye = torch.eye(repeat, dtype=torch.bool, device=rewards.device)
        replaced = torch.where(eye, others.unsqueeze(2), rewards.unsqueeze(1))  # (B, K, K)
        held_out = torch.logsumexp(replaced, dim=2) - math.log(repeat)  # (B, K)
        signal = (bound.detach().unsqueeze(1) - held_out).flatten()  # (R,)
        surrogate = -signal * sampled.score()  # (R,)
        rest = cfg.doubly_stochastic_weight * sampled.penalty - cfg.entropy_weight * (
            sampled.entropies
        )  # (R,)
        per_caption = (
            -bound
            + cfg.reinforce_weight * surrogate.view(-1, repeat).sum(dim=1)
            + rest.view(-1, repeat).mean(dim=1)
        )  # (B,)
        return self._terms(sampled, per_caption, surrogate)

    def _gumbel(self, sampled: _Sampled, repeat: int) -> LossTerms:
        """The NLL through the straight-through relaxed context: no score-function term."""
        return self._terms(sampled, self._base(sampled), None)

    # ------------------------------------------------------------------ state

    def commit(self) -> None:
        """The step was finite and taken: update the state from this step's statistics,
        summed over all processes (every process must call this)."""
        if self.estimator == "reinforce":
            total, count = sum_over_ranks(
                self.world, list(self._pending or (0.0, 0.0)), self.device
            )
            if count > 0:
                self.baseline.update(total / count)
        elif self.estimator == "gumbel":
            self.temperature = max(
                self.cfg.gumbel_min_temperature,
                self.temperature * math.exp(-self.cfg.gumbel_anneal_rate),
            )
        self._pending = None

    def discard(self) -> None:
        """The step was skipped (not finite): forget its statistics."""
        self._pending = None

    def scalars(self) -> dict[str, float]:
        """The state to log."""
        if self.estimator == "reinforce":
            return {"baseline": self.baseline.value}
        if self.estimator == "gumbel":
            return {"temperature": self.temperature}
        return {}

    def state_dict(self) -> dict[str, Any]:
        return {
            "estimator": self.estimator,
            "baseline": self.baseline.state_dict(),
            "temperature": self.temperature,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if "baseline" in state:
            self.baseline.load_state_dict(state["baseline"])
        if "temperature" in state:
            self.temperature = float(state["temperature"])


_ESTIMATORS = {
    "reinforce": HardAttentionObjective._reinforce,
    "reinforce_loo": HardAttentionObjective._reinforce_loo,
    "vimco": HardAttentionObjective._vimco,
    "gumbel": HardAttentionObjective._gumbel,
}
