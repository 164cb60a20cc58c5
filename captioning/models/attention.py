"""Attention over the image grid: the soft / hard / local / multi-head / no-attention
modules, resolved by ``model.attention`` in one registry (:data:`ATTENTIONS`,
:func:`register_attention`), each over a score function of :mod:`captioning.models.scores`.

Every step function takes G > 1 queries per image: queries (B*G, ...) in image-major
order against one copy of the grid (B, L, ...), giving (B*G, L). Beam search uses this for
its K beams, so the grid and its keys are never copied K times.

Soft, hard and no attention share one interface: they take the grid, its keys, the queries
and a :class:`HardContext` (how a hard-attention model forms its context; the others ignore
it), and return an :class:`AttentionOutput` with the context vector and the per-word
record (:class:`~captioning.models.trace.AttentionTrace`: the weights ``alpha`` and what each
kind adds: the chosen cell, the heads' weights, the predicted centre), and for hard
attention the chosen cell's log-probability. How a hard model is trained (estimator,
baseline, mixing) lives in :mod:`captioning.objectives.hard_attention`.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from captioning.config import ModelConfig, unknown_choice
from captioning.errors import ConfigError
from captioning.models.packing import Linear
from captioning.models.scores import groups, make_score
from captioning.models.trace import AttentionTrace

HARD_CONTEXTS = ("expectation", "argmax", "sample", "gumbel", "marginal")


@dataclass(frozen=True)
class HardContext:
    """How a hard-attention model forms its context: the one typed option of every
    attention call (soft and no attention have one context and ignore it).

    B counts query rows, as everywhere in this module. Tensors may also carry a time axis
    (B, T, ...) for a whole teacher-forced caption; :meth:`at` takes one step's slice.

    Attributes:
        mode: ``expectation`` (the soft context, as the authors decode), ``argmax`` (the
            most likely cell), ``sample`` (a cell s ~ alpha), ``gumbel`` (straight-through
            Gumbel-softmax: the sampled cell's feature forward, the relaxed weights
            softmax((log alpha + g) / temperature) backward), or ``marginal`` (the decoder
            sums its output distribution over the cells, weighted by alpha; only without
            the context in the LSTM).
        use_expectation: (B,) bool, rows that take the expected context instead (the
            paper's mixing of soft and hard captions), else None.
        cells: (B,) cells to impose instead of sampling (exact enumeration in tests,
            replaying a sample), else None.
        noise: (B, L) Exp(1) noise that decides the sample, s = argmax(alpha / noise)
            (the Gumbel-max trick, which is how ``torch.multinomial`` draws one sample), so
            that training can draw it for the global batch and every process, however
            many, samples the same cells; None draws from the global generator.
        temperature: the Gumbel-softmax temperature.
    """

    mode: Literal["expectation", "argmax", "sample", "gumbel", "marginal"] = "expectation"
    use_expectation: torch.Tensor | None = None
    cells: torch.Tensor | None = None
    noise: torch.Tensor | None = None
    temperature: float = 1.0

    def __post_init__(self) -> None:
        if self.mode not in HARD_CONTEXTS:
            raise ValueError(
                f"hard context must be one of {', '.join(HARD_CONTEXTS)}, got {self.mode!r}"
            )
        if self.temperature <= 0:
            raise ValueError(
                f"the Gumbel-softmax temperature must be positive, got {self.temperature}"
            )

    def at(self, t: int) -> HardContext:
        """Step ``t`` of a caption-long context: (B, T, ...) tensors → (B, ...)."""
        return replace(
            self,
            cells=None if self.cells is None else self.cells[:, t],
            noise=None if self.noise is None else self.noise[:, t],
        )

    def flat(self, steps: int) -> HardContext:
        """The caption-long context as B*T rows (image-major), for all steps at once."""
        return replace(
            self,
            use_expectation=None
            if self.use_expectation is None
            else self.use_expectation.repeat_interleave(steps),
            cells=None if self.cells is None else self.cells.flatten(),
            noise=None if self.noise is None else self.noise.flatten(0, 1),
        )


EXPECTATION = HardContext()


@dataclass
class AttentionOutput:
    """What every attention returns at one step.

    B counts query rows: B*G with G queries per image (see the module docstring).

    Attributes:
        context: (B, D) the context vector z_t (before the decoder's gate).
        trace: what the attention reports about each row's word: ``alpha`` (B, L), and the
            fields of its kind (see :class:`~captioning.models.trace.AttentionTrace`).
        log_prob: (B,) log alpha of the chosen cell for hard attention, else None.
        sampled: (B,) bool, which rows used a sampled cell (hard attention), else None.
    """

    context: torch.Tensor
    trace: AttentionTrace
    log_prob: torch.Tensor | None = None
    sampled: torch.Tensor | None = None

    @property
    def alpha(self) -> torch.Tensor:
        """(B, L) the attention weights (a distribution over cells)."""
        return self.trace.alpha


class SoftAttention(nn.Module):
    """Deterministic attention: the expected feature under alpha."""

    stochastic = False  # whether the context is a sampled cell (hard attention)

    def __init__(self, score: nn.Module, temperature: float = 1.0) -> None:
        super().__init__()
        self.score = score
        self.temperature = temperature  # alpha = softmax(score / temperature)

    def project_keys(self, features: torch.Tensor) -> torch.Tensor:
        return self.score.project_keys(features)

    def logits(self, keys: torch.Tensor, query: torch.Tensor) -> torch.Tensor:
        """The scores over the temperature, in fp32: (B*G, L)."""
        scores = self.score(keys, query).float()
        return scores if self.temperature == 1 else scores / self.temperature

    def weights(self, keys: torch.Tensor, query: torch.Tensor) -> torch.Tensor:
        # softmax in fp32: with bf16 autocast the weights must still sum to one
        return torch.softmax(self.logits(keys, query), dim=1)  # (B, L)

    def forward(
        self,
        features: torch.Tensor,
        keys: torch.Tensor,
        query: torch.Tensor,
        hard: HardContext = EXPECTATION,
    ) -> AttentionOutput:
        alpha = self.weights(keys, query)  # (B, L)
        return AttentionOutput(expected_context(alpha, features), AttentionTrace(alpha))


def expected_context(alpha: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
    """sum_i alpha_i a_i: (B*G, L) weights, (B, L, D) features → (B*G, D)."""
    batch, cells, dim = features.shape
    g = groups(features, alpha.shape[0])
    weights = alpha.view(batch, g, cells).to(features.dtype)  # (B, G, L)
    return torch.bmm(weights, features).view(batch * g, dim)


class HardAttention(SoftAttention):
    """Stochastic attention: one cell s_t ~ Categorical(alpha) per word; the context is its
    feature (see :class:`HardContext` for the other ways to form it). The gradient through
    the choice comes from the estimator in :mod:`captioning.objectives.hard_attention`,
    built on the ``log_prob`` returned here.
    """

    stochastic = True

    def forward(
        self,
        features: torch.Tensor,
        keys: torch.Tensor,
        query: torch.Tensor,
        hard: HardContext = EXPECTATION,
    ) -> AttentionOutput:
        alpha = self.weights(keys, query)  # (B, L)
        if hard.mode in ("expectation", "marginal"):
            return AttentionOutput(expected_context(alpha, features), AttentionTrace(alpha))
        cell, noise = hard.cells, hard.noise
        if hard.mode == "gumbel":
            if cell is not None:
                raise ValueError(
                    "gumbel attention draws its cells from its noise; "
                    "impose the noise, not the cells"
                )
            noise = noise if noise is not None else torch.empty_like(alpha).exponential_()
        if cell is None and hard.mode == "argmax":
            cell = alpha.argmax(dim=1)  # (B,)
        elif cell is None and noise is not None:
            cell = (alpha.detach() / noise).argmax(dim=1)  # (B,) Gumbel-max
        elif cell is None:
            cell = torch.multinomial(alpha.detach(), 1).squeeze(1)  # (B,)
        rows = torch.arange(alpha.shape[0], device=features.device)  # (B*G,)
        images = rows // groups(features, alpha.shape[0])  # (B*G,) the image of each row
        if hard.mode == "gumbel":
            context = _straight_through(alpha, cell, noise, hard.temperature, features)
        else:
            context = features[images, cell]  # (B*G, D)
        log_prob = torch.log(alpha[rows, cell].clamp_min(1e-12))  # (B,)
        sampled = torch.ones_like(cell, dtype=torch.bool)
        if hard.use_expectation is not None:
            expected = expected_context(alpha, features)  # (B, D)
            context = torch.where(hard.use_expectation[:, None], expected, context)  # (B, D)
            sampled = ~hard.use_expectation
            log_prob = log_prob * sampled
        trace = AttentionTrace(alpha, cell=cell)
        return AttentionOutput(context, trace, log_prob=log_prob, sampled=sampled)


def _straight_through(
    alpha: torch.Tensor,
    cell: torch.Tensor,
    noise: torch.Tensor,
    temperature: float,
    features: torch.Tensor,
) -> torch.Tensor:
    """The chosen cell's feature forward, the Gumbel-softmax relaxation's gradient backward
    (Jang et al. 2017): one_hot(s) - y.detach() + y with y = softmax((log alpha + g) / tau),
    g = -log(noise) the Gumbel noise that chose s = argmax(log alpha + g)."""
    gumbel = -torch.log(noise)  # (B, L)
    relaxed = torch.softmax((torch.log(alpha.clamp_min(1e-12)) + gumbel) / temperature, dim=1)
    one_hot = F.one_hot(cell, alpha.shape[1]).to(relaxed.dtype)  # (B, L)
    weights = one_hot - relaxed.detach() + relaxed  # (B, L): forward exactly one-hot
    return expected_context(weights, features)


class NoAttention(nn.Module):
    """The ablation baseline: a uniform average of the grid at every step."""

    def project_keys(self, features: torch.Tensor) -> torch.Tensor:
        return features.mean(dim=1, keepdim=True)  # (B, 1, D): the context, computed once

    stochastic = False

    def forward(
        self,
        features: torch.Tensor,
        keys: torch.Tensor,
        query: torch.Tensor,
        hard: HardContext = EXPECTATION,
    ) -> AttentionOutput:
        rows, cells = query.shape[0], features.shape[1]
        alpha = features.new_full((rows, cells), 1.0 / cells, dtype=torch.float32)
        context = keys.squeeze(1).repeat_interleave(groups(features, rows), dim=0)  # (B*G, D)
        return AttentionOutput(context, AttentionTrace(alpha))


class LocalAttention(SoftAttention):
    """Luong's local-p attention carried to a 2-D grid. The decoder state predicts a centre
    p_t = (rows, cols) * sigmoid(v_p^T tanh(W_p h)) (in cells, differentiable), and the
    score's softmax is multiplied by a Gaussian exp(-||cell - p_t||^2 / (2 sigma^2)) around it
    and renormalised: alpha = softmax(score - ||cell - p_t||^2 / (2 sigma^2)), computed in
    that stable form. Renormalised, the weights stay a distribution, so the context is an
    average, and grounding, the doubly stochastic penalty and the heatmaps read them as they
    read soft attention's.

    Args:
        score: the score module.
        query_dim: the decoder state size.
        attention_dim: the hidden size of the centre's MLP.
        grid_shape: (rows, columns) of the grid.
        sigma: the Gaussian's width, in cells.
        temperature: the score's, as for :class:`SoftAttention` (the Gaussian keeps its
            width).
    """

    def __init__(
        self,
        score: nn.Module,
        query_dim: int,
        attention_dim: int,
        grid_shape: tuple[int, int],
        sigma: float,
        temperature: float = 1.0,
    ) -> None:
        super().__init__(score, temperature)
        self.centre = nn.Sequential(
            Linear(query_dim, attention_dim), nn.Tanh(), Linear(attention_dim, 2)
        )
        rows, cols = grid_shape
        grid = torch.stack(
            torch.meshgrid(torch.arange(rows), torch.arange(cols), indexing="ij"), dim=-1
        )
        self.register_buffer("cells", grid.reshape(-1, 2).float() + 0.5, persistent=False)
        self.register_buffer("size", torch.tensor([float(rows), float(cols)]), persistent=False)
        self.sigma = sigma

    def forward(
        self,
        features: torch.Tensor,
        keys: torch.Tensor,
        query: torch.Tensor,
        hard: HardContext = EXPECTATION,
    ) -> AttentionOutput:
        centre = torch.sigmoid(self.centre(query).float()) * self.size  # (B, 2)
        distance = (self.cells[None] - centre[:, None]).pow(2).sum(dim=2)  # (B, L)
        logits = self.logits(keys, query) - distance / (2 * self.sigma**2)
        alpha = torch.softmax(logits, dim=1)  # (B, L)
        return AttentionOutput(
            expected_context(alpha, features), AttentionTrace(alpha, centre=centre)
        )


class MultiHeadAttention(nn.Module):
    """H soft attentions over the same grid, each with its own score (its own key and query
    projections, each the width of a single head's). Head h averages its own group of D / H
    channels of what the context averages (the features, or with ``model.values=projected``
    the values W_v a_i, whose h-th block of rows is then head h's value projection), and the
    context is the H groups side by side, (B, D). There is no output projection: the
    decoder's output layer (and the LSTM, with the context fed to it) already applies a
    learnt linear map to the context (docs/attention.md#multi-head-attention has the runs).
    So with H heads that agree the context is the single head's, at any scale;
    :func:`build_attention` starts them as copies of one. The reported ``alpha`` is the mean
    of the heads' weights (a distribution over the cells: what heatmaps, grounding and the
    doubly stochastic penalty read); ``heads`` holds each head's.

    Args:
        scores: one score module per head, all of one kind.
        context_dim: D, the size of what the context averages; H must divide it.
        temperature: every head's, as for :class:`SoftAttention`.
    """

    stochastic = False

    def __init__(self, scores: list[nn.Module], context_dim: int, temperature: float = 1.0) -> None:
        super().__init__()
        self.temperature = temperature
        if context_dim % len(scores):
            raise ConfigError(
                f"model.heads={len(scores)} must divide the context's size {context_dim} (the "
                f"encoder's channels, or model.value_dim with model.values=projected)"
            )
        self.heads = nn.ModuleList(scores)

    def project_keys(self, features: torch.Tensor) -> torch.Tensor:
        """Every head's keys side by side: (B, L, H * K)."""
        return torch.cat([head.project_keys(features) for head in self.heads], dim=-1)

    def forward(
        self,
        features: torch.Tensor,
        keys: torch.Tensor,
        query: torch.Tensor,
        hard: HardContext = EXPECTATION,
    ) -> AttentionOutput:
        per_head = keys.shape[-1] // len(self.heads)
        alphas = [
            # softmax in fp32, as for one head
            torch.softmax(
                head(keys[..., index * per_head : (index + 1) * per_head], query).float()
                / self.temperature,
                dim=1,
            )  # (B, L)
            for index, head in enumerate(self.heads)
        ]
        heads = torch.stack(alphas, dim=1)  # (B, H, L)
        context = head_contexts(heads, features)  # (B, D)
        return AttentionOutput(context, AttentionTrace(heads.mean(dim=1), heads=heads))


def head_contexts(heads: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
    """Each head's average of its own channel group, side by side: (B*G, H, L) weights,
    (B, L, D) features → (B*G, D), channels h * D / H to (h + 1) * D / H from head h."""
    batch, cells, dim = features.shape
    g = groups(features, heads.shape[0])
    count = heads.shape[1]
    weights = heads.view(batch, g, count, cells).to(features.dtype)  # (B, G, H, L)
    grouped = features.view(batch, cells, count, dim // count)  # (B, L, H, D/H)
    context = torch.einsum("bghl,blhd->bghd", weights, grouped)  # (B, G, H, D/H)
    return context.reshape(batch * g, dim)


@dataclass(frozen=True)
class AttentionSizes:
    """What an attention module is built for besides its config section: D, the features'
    width; Q, the decoder state's; L cells in a (rows, cols) grid; and the width of what
    the context averages (D, or ``model.value_dim`` for projected values)."""

    feature_dim: int
    query_dim: int
    cells: int
    grid_shape: tuple[int, int]
    context_dim: int


AttentionFactory = Callable[[ModelConfig, AttentionSizes], nn.Module]

# model.attention's names and the factories that build them from the model's config section.
ATTENTIONS: dict[str, AttentionFactory] = {}


def register_attention(name: str, factory: AttentionFactory) -> AttentionFactory:
    """Make ``factory`` the attention ``model.attention=name`` builds; a name already taken
    is an error (remove it from :data:`ATTENTIONS` first). docs/extending.md has an
    example."""
    if name in ATTENTIONS:
        raise ValueError(f"an attention named {name!r} is already registered")
    ATTENTIONS[name] = factory
    return factory


def score_for(cfg: ModelConfig, sizes: AttentionSizes) -> nn.Module:
    """The score function ``model.score`` names, at ``model.attention_dim`` units."""
    return make_score(cfg.score, sizes.feature_dim, sizes.query_dim, cfg.attention_dim, sizes.cells)


def check_heads(cfg: ModelConfig) -> None:
    """Refuse ``model.heads`` > 1 for any attention but soft."""
    if cfg.heads > 1 and cfg.attention != "soft":
        raise ConfigError(
            f"model.heads={cfg.heads} needs model.attention=soft: {cfg.attention} attention "
            f"has one distribution per word (use model.heads=1)"
        )


def _soft(cfg: ModelConfig, sizes: AttentionSizes) -> nn.Module:
    """Soft attention; ``model.heads`` > 1 gives soft multi-head attention: H scores of
    ``model.attention_dim`` each, every head averaging its share of the context's
    channels."""
    first = score_for(cfg, sizes)
    if cfg.heads == 1:
        return SoftAttention(first, cfg.attention_temperature)
    # Each head scores with the single head's width: under Adam a score's logits grow
    # about in proportion to its hidden units, and heads of attention_dim / H units stay
    # near uniform (at H = 8 on shapes, a head's largest weight 0.06-0.16 after 7 epochs).
    # The heads start as copies of one: the model starts as the single-head model of the
    # same seed (the same function, the same random draws for everything else), and the
    # heads part as each learns from its own channel group. Independently drawn heads
    # start elsewhere (on shapes, H = 4 at seed 0: test exact match 0.044 against 0.976).
    scores = [first, *(copy.deepcopy(first) for _ in range(cfg.heads - 1))]
    return MultiHeadAttention(scores, sizes.context_dim, cfg.attention_temperature)


def _local(cfg: ModelConfig, sizes: AttentionSizes) -> nn.Module:
    """Local attention: a Gaussian ``model.local_sigma`` cells wide around a predicted
    centre."""
    return LocalAttention(
        score_for(cfg, sizes),
        sizes.query_dim,
        cfg.attention_dim,
        sizes.grid_shape,
        cfg.local_sigma,
        cfg.attention_temperature,
    )


for _name, _attention in {
    "soft": _soft,
    "hard": lambda cfg, sizes: HardAttention(score_for(cfg, sizes), cfg.attention_temperature),
    "local": _local,
    "none": lambda cfg, sizes: NoAttention(),
}.items():
    register_attention(_name, _attention)


def build_attention(cfg: ModelConfig, sizes: AttentionSizes) -> nn.Module:
    """The attention ``cfg.attention`` names (see :data:`ATTENTIONS`) over a grid of
    ``sizes``, with ``cfg``'s score function and widths."""
    if cfg.attention not in ATTENTIONS:
        raise unknown_choice(
            "model.attention", cfg.attention, ATTENTIONS, "models.attention.register_attention"
        )
    check_heads(cfg)
    return ATTENTIONS[cfg.attention](cfg, sizes)
