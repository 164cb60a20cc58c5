"""What every training objective is, and the registry that finds one by name.

An objective turns a batch into a loss (:class:`LossTerms`) and keeps whatever state it
needs between steps (a baseline, a temperature), which goes into checkpoints. Training knows
objectives only through the :class:`Objective` protocol and :func:`build_objective` in
:mod:`captioning.objectives`; each objective module registers its factory here under the
name ``train.objective`` gives it (``xe``, ``scst``; docs/extending.md adds one).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn

from captioning.config import Config
from captioning.data.records import ImageRecord
from captioning.data.vocab import Vocabulary
from captioning.distributed import SINGLE, World
from captioning.models.captioner import Captioner


@dataclass
class LossTerms:
    """The parts of a training loss; ``total`` is what is back-propagated. Terms an
    objective does not have are None."""

    total: torch.Tensor
    nll: torch.Tensor  # mean per caption
    nll_per_token: torch.Tensor
    penalty: torch.Tensor | None  # None: an objective without the doubly stochastic term
    tokens: int
    reinforce: torch.Tensor | None = None  # the score-function surrogate, mean per caption
    entropy: torch.Tensor | None = None  # attention entropy of the sampled (or summed) steps
    reward: torch.Tensor | None = None  # mean log p(y | a, s) of the captions that sampled
    context_nll: torch.Tensor | None = None  # per token, each word read from its context
    presence: torch.Tensor | None = None  # the word localiser's binary cross-entropy
    map_kl: torch.Tensor | None = None  # per word, KL(localiser's map || attention map)
    expected_nll: torch.Tensor | None = None  # per token, the next word read from the query

    def scalars(self) -> dict[str, float]:
        """The terms to log, by name."""
        values = {
            "loss": self.total,
            "nll_per_token": self.nll_per_token,
            "penalty": self.penalty,
            "reward": self.reward,
            "entropy": self.entropy,
            "context_nll_per_token": self.context_nll,
            "word_presence": self.presence,
            "map_kl_per_word": self.map_kl,
            "expected_nll_per_token": self.expected_nll,
        }
        return {k: float(v.detach()) for k, v in values.items() if v is not None}


@dataclass(frozen=True)
class Batch:
    """One training batch on its device.

    Attributes:
        tokens: (B, T) the reference captions, ``<start>`` first, padded.
        images: (B, 3, S, S) the images, or None when ``grid`` carries their cached grids.
        grid: (B, L, D) the encoder's cached grids, or None.
        step: the optimiser's steps so far (an objective's schedules and random streams).
        indices: (B,) the images' places in the training split (for an objective that looks
            up their references), or None.
    """

    tokens: torch.Tensor
    images: torch.Tensor | None = None
    grid: torch.Tensor | None = None
    step: int = 0
    indices: torch.Tensor | None = None


@runtime_checkable
class Objective(Protocol):
    """What training asks of an objective, whichever it is (cross-entropy, hard attention's
    estimators, self-critical training, or one registered by a user): the loss of a batch,
    then :meth:`commit` once the step is known to be finite or :meth:`discard` when it was
    skipped, the scalars it logs, and the state a checkpoint keeps (a baseline, a running
    mean)."""

    def loss(self, module: nn.Module, batch: Batch) -> LossTerms:
        """The loss of one batch (``module``: the captioner or its DDP wrapper, fed the
        batch's images or cached grids and its reference tokens)."""
        ...

    def commit(self) -> None: ...

    def discard(self) -> None: ...

    def scalars(self) -> dict[str, float]: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


@dataclass(frozen=True)
class ObjectiveContext:
    """What an objective's factory is given: the run's config, the model it trains,
    where it runs, this process among the training processes, and the training split's
    images and vocabulary (for an objective that scores captions against references)."""

    cfg: Config
    model: Captioner
    device: torch.device
    world: World = SINGLE
    vocab: Vocabulary | None = None
    train_records: Sequence[ImageRecord] = ()


ObjectiveFactory = Callable[[ObjectiveContext], Objective]

# train.objective's names and the factories they build.
OBJECTIVES: dict[str, ObjectiveFactory] = {}


def register_objective(name: str, factory: ObjectiveFactory) -> ObjectiveFactory:
    """Make ``factory`` the objective ``train.objective=name`` trains with; a name already
    taken is an error (remove it from :data:`OBJECTIVES` first). docs/extending.md has an
    example."""
    if name in OBJECTIVES:
        raise ValueError(f"an objective named {name!r} is already registered")
    OBJECTIVES[name] = factory
    return factory
