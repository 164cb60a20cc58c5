"""Training losses: masked cross-entropy, the doubly stochastic attention penalty, and the
REINFORCE surrogate for hard attention.

Normalisation follows the authors' code: the negative log-likelihood is summed over the words
of a caption and averaged over captions, and the penalty lambda * sum_i (1 - sum_t alpha_ti)^2
is per caption too, so lambda means what it means in the paper. Padding never counts.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from captioning.models.decoder import DecoderOutput


def token_nll(logits: torch.Tensor, targets: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """-log p(y_t) per position, 0 on padding: (B, T, V), (B, T), (B, T) → (B, T)."""
    nll = F.cross_entropy(
        logits.float().flatten(0, 1), targets.flatten(), reduction="none"
    ).view_as(targets)  # (B, T)
    return nll * mask


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


class MovingAverageBaseline:
    """b <- decay * b + (1 - decay) * mean reward, the paper's variance-reduction baseline.

    The first update sets b to the first mean reward, so early rewards are not compared with
    an arbitrary zero. Its state is two numbers, saved in checkpoints.
    """

    def __init__(self, decay: float = 0.9) -> None:
        self.decay = decay
        self.value = 0.0
        self.initialized = False

    def update(self, rewards: torch.Tensor) -> None:
        mean = float(rewards.mean())
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


def reinforce_surrogate(
    log_probs: torch.Tensor,
    rewards: torch.Tensor,
    baseline: float,
    step_mask: torch.Tensor,
) -> torch.Tensor:
    """A per-caption surrogate whose gradient is the REINFORCE estimate.

    d/dθ [-(r - b) * sum_t log p(s_t)] = -(r - b) * sum_t d log p(s_t): minimising it
    ascends the expected reward. ``r`` is detached: the reward's own gradient reaches the
    model through the likelihood term of the loss.

    Args:
        log_probs: (B, T) log p(s_t) of the sampled cells.
        rewards: (B,) the reward of each caption (its log-likelihood given the samples).
        baseline: the moving-average baseline b.
        step_mask: (B, T) 1 where a cell was sampled at a real step.
    Returns:
        (B,) surrogate per caption.
    """
    advantage = (rewards.detach() - baseline).unsqueeze(1)  # (B, 1)
    return -(advantage * log_probs * step_mask).sum(dim=1)


@dataclass
class LossTerms:
    """The parts of a training loss; ``total`` is what is back-propagated."""

    total: torch.Tensor
    nll: torch.Tensor  # mean per caption
    nll_per_token: torch.Tensor
    penalty: torch.Tensor
    reinforce: torch.Tensor
    entropy: torch.Tensor
    reward: torch.Tensor
    tokens: int


def caption_loss(
    output: DecoderOutput,
    targets: torch.Tensor,
    pad_id: int,
    penalty_weight: float = 1.0,
    baseline: MovingAverageBaseline | None = None,
    reinforce_weight: float = 0.1,
    entropy_weight: float = 0.002,
) -> LossTerms:
    """The Show, Attend and Tell objective for soft or hard attention.

    Soft: NLL + lambda * penalty. Hard (``output.log_probs`` present): the NLL given the
    sampled cells, plus the REINFORCE surrogate (reward = the caption's log-likelihood,
    minus the moving-average baseline, scaled by ``reinforce_weight``), minus
    ``entropy_weight`` times the attention entropy, plus the penalty. The baseline is updated
    with the rewards of the captions that sampled.

    Args:
        output: the decoder's teacher-forced output for ``targets``.
        targets: (B, T) the next words (``tokens[:, 1:]``).
        pad_id: the padding id; those positions count nowhere.
    """
    mask = (targets != pad_id).float()  # (B, T)
    nll = token_nll(output.logits, targets, mask)  # (B, T)
    nll_caption = nll.sum(dim=1)  # (B,)
    penalty = doubly_stochastic_penalty(output.alphas, mask)  # (B,)
    total = nll_caption + penalty_weight * penalty
    zero = total.new_zeros(())
    reinforce, entropy, reward = zero, zero, zero
    if output.log_probs is not None:
        step_mask = mask * output.sampled.float()  # (B, T)
        rows = step_mask.sum(dim=1) > 0  # captions that sampled at all
        rewards = -nll_caption.detach()  # (B,) log p(y | a, s)
        if baseline is None:
            raise ValueError("hard attention needs a MovingAverageBaseline")
        if rows.any():
            surrogate = reinforce_surrogate(output.log_probs, rewards, baseline.value, step_mask)
            entropies = attention_entropy(output.alphas, step_mask)  # (B,)
            total = total + reinforce_weight * surrogate - entropy_weight * entropies
            reinforce, entropy = surrogate.mean(), entropies.mean()
            reward = rewards[rows].mean()
            baseline.update(rewards[rows])
    num_tokens = int(mask.sum())
    return LossTerms(
        total=total.mean(),
        nll=nll_caption.mean().detach(),
        nll_per_token=(nll.sum() / max(num_tokens, 1)).detach(),
        penalty=penalty.mean().detach(),
        reinforce=reinforce.detach(),
        entropy=entropy.detach(),
        reward=reward.detach(),
        tokens=num_tokens,
    )
