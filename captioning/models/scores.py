"""Score functions: how well each cell of the grid answers the decoder's state, resolved by
``model.score`` in one registry (:data:`SCORES`, :func:`register_score`).

A score has two halves: :meth:`project_keys` runs once per batch on the grid features
(B, L, D) → keys (B, L, K), and :meth:`forward` scores the keys against the decoder state at
each step → logits (B, L). Re-projecting the grid at every word is the main waste of the
tutorial implementations. Every score also takes G > 1 queries per image: queries (B*G, ...)
in image-major order against one copy of the grid (B, L, ...), giving (B*G, L); beam search
uses this for its K beams, so the grid and its keys are never copied K times.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from captioning.config import unknown_choice
from captioning.errors import ConfigError
from captioning.models import fused_score
from captioning.models.packing import Linear
from captioning.models.tanh_score import KeysGradient, tanh_score


def groups(keys: torch.Tensor, rows: int) -> int:
    """G, the queries per image: ``rows`` queries against ``keys`` (B, ...) of B images."""
    batch = keys.shape[0]
    if rows % batch:
        raise ValueError(f"{rows} query rows do not divide among {batch} images")
    return rows // batch


# Without gradients on the CPU the additive score runs as one C kernel where it is built
# (captioning.models.fused_score), else in blocks.
# Images per block when the additive score runs in blocks (on CPU, without gradients): a
# block's hidden layer (images * G * L * A values) is kept to about this many elements, 2 MB
# in fp32, so that it stays in a core's cache between the add, the activation and the
# projection instead of streaming three times through memory.
SCORE_BLOCK_ELEMENTS = 1 << 19
# In the blocks, tanh(x) = 2 sigmoid(2x) - 1, the doubling and the affine map folded into
# the add and the projection: where torch's CPU tanh is slow, the sigmoid is not (0.33
# against 2.1 ns a value on the 2-core AMD EPYC host; on the Xeon both take 0.28 ns in
# fp32, and tanh in bf16 0.87). The blocks of bf16 keys are summed into fp32 blocks for it
# (bf16's absolute rounding of a sigmoid near 0 would be coarser than tanh's). Training
# runs the same form through :mod:`captioning.models.tanh_score`. False: autograd's tanh
# everywhere, in the keys' dtype (the benchmarks time both).
SIGMOID_TANH = True


class AdditiveScore(nn.Module):
    """Bahdanau / the paper: ``w^T act(W_k a_i + W_q h)``; ``act`` is tanh (paper) or ReLU.

    Args:
        feature_dim: D, the grid feature size.
        query_dim: the decoder state size.
        attention_dim: the hidden size of the scoring MLP.
        activation: ``tanh`` or ``relu``.
    """

    def __init__(
        self, feature_dim: int, query_dim: int, attention_dim: int, activation: str = "tanh"
    ) -> None:
        super().__init__()
        self.key_proj = Linear(feature_dim, attention_dim)
        self.query_proj = Linear(query_dim, attention_dim, bias=False)
        self.out = Linear(attention_dim, 1)
        self.activation = torch.tanh if activation == "tanh" else F.relu
        self.activation_ = torch.Tensor.tanh_ if activation == "tanh" else torch.Tensor.relu_
        self.sigmoid_ = torch.Tensor.sigmoid_ if activation == "tanh" else None  # see SIGMOID_TANH

    def project_keys(self, features: torch.Tensor) -> torch.Tensor:
        return self.key_proj(features)  # (B, L, A)

    def forward(self, keys: torch.Tensor, query: torch.Tensor) -> torch.Tensor:
        """``keys`` (B, L, A), ``query`` (B*G, Q) → scores (B*G, L)."""
        batch, cells, dim = keys.shape
        g = groups(keys, query.shape[0])
        projected = self.query_proj(query).view(batch, g, 1, dim)  # (B, G, 1, A)
        sink = getattr(keys, "gradient_sink", None)  # the keys of tanh_score.shared_keys
        keys = keys.unsqueeze(1)  # (B, 1, L, A)
        if torch.compiler.is_compiling():
            # As one reduction the compiler fuses add, activation and projection, and the
            # (B, G, L, A) hidden layer is never written out.
            hidden = self.activation(keys + projected)  # (B, G, L, A)
            scores = (hidden * self.out.weight[0]).sum(dim=3) + self.out.bias  # (B, G, L)
            return scores.view(batch * g, cells)
        sigmoid = SIGMOID_TANH and self.sigmoid_ is not None
        if sigmoid and not torch.is_grad_enabled() and fused_score.available(keys):
            # one pass over the keys in C (captioning.models.fused_score)
            weight, bias = self.out.weight[0], self.out.bias
            return fused_score.forward(keys, projected, weight, bias).view(batch * g, cells)
        per_block = max(1, SCORE_BLOCK_ELEMENTS // (g * cells * dim))  # images
        if per_block >= batch or keys.device.type != "cpu" or torch.is_grad_enabled():
            return self._scores(keys, projected, sink).view(batch * g, cells)
        # Cache blocking: one buffer for the hidden layer of a block, the add written into
        # it, the activation in place, then the projection; no block allocates.
        dtype, activation_, scale = keys.dtype, self.activation_, 1.0
        sigmoid = sigmoid and keys.dtype.is_floating_point
        if sigmoid:  # w tanh(x) + b = 2 w sigmoid(2x) + b - sum(w), in fp32
            dtype, activation_, scale = torch.float32, self.sigmoid_, 2.0
        hidden = keys.new_empty(per_block, g, cells, dim, dtype=dtype)
        scores = keys.new_empty(batch, g, cells, dtype=dtype)
        weight, bias = self.out.weight[0].to(dtype), self.out.bias.to(dtype)
        projected = projected.to(dtype)
        if sigmoid:
            projected, weight, bias = 2.0 * projected, 2.0 * weight, bias - weight.sum()
        for start in range(0, batch, per_block):
            stop = min(start + per_block, batch)
            block = hidden[: stop - start]
            torch.add(projected[start:stop], keys[start:stop], alpha=scale, out=block)
            activation_(block)
            torch.matmul(block, weight, out=scores[start:stop])  # (b, G, L)
        return (scores + bias).view(batch * g, cells)

    def _scores(
        self, keys: torch.Tensor, projected: torch.Tensor, sink: KeysGradient | None = None
    ) -> torch.Tensor:
        """(b, 1, L, A) keys, (b, G, 1, A) projected queries → (b, G, L); training on the
        CPU, tanh's in blocks with its backward written out
        (:mod:`captioning.models.tanh_score`), which adds the keys' gradient into ``sink``."""
        cpu = keys.device.type == "cpu"
        if SIGMOID_TANH and self.sigmoid_ is not None and cpu and torch.is_grad_enabled():
            return tanh_score(keys, projected, self.out.weight[0], self.out.bias, sink)
        return self.out(self.activation(keys + projected)).squeeze(3)


class DotScore(nn.Module):
    """``<W_k a_i, W_q h>``, optionally divided by sqrt(K) (``scaled_dot``) or, with
    ``cosine``, the cosine of the two projections times a learned temperature.

    Args:
        feature_dim, query_dim, attention_dim: as for :class:`AdditiveScore`.
        scaled: divide by sqrt(attention_dim).
        cosine: normalise both sides; the learned scale starts at 5.
    """

    def __init__(
        self,
        feature_dim: int,
        query_dim: int,
        attention_dim: int,
        scaled: bool = False,
        cosine: bool = False,
    ) -> None:
        super().__init__()
        self.key_proj = Linear(feature_dim, attention_dim)
        self.query_proj = Linear(query_dim, attention_dim)
        self.scale = 1.0 / math.sqrt(attention_dim) if scaled else 1.0
        self.cosine = cosine
        # Cosines lie in [-1, 1]: without a temperature the softmax stays nearly uniform.
        self.log_temperature = nn.Parameter(torch.tensor(math.log(5.0))) if cosine else None

    def project_keys(self, features: torch.Tensor) -> torch.Tensor:
        keys = self.key_proj(features)  # (B, L, A)
        return F.normalize(keys, dim=-1) if self.cosine else keys

    def forward(self, keys: torch.Tensor, query: torch.Tensor) -> torch.Tensor:
        """``keys`` (B, L, A), ``query`` (B*G, Q) → scores (B*G, L)."""
        query = self.query_proj(query)  # (B*G, A)
        if self.cosine:
            query = F.normalize(query, dim=-1)
        logits = grouped_dot(keys, query)  # (B*G, L)
        if self.log_temperature is not None:
            return logits * self.log_temperature.exp()
        return logits * self.scale


class GeneralScore(nn.Module):
    """Luong's general score ``a_i^T W h``: the keys are the features themselves."""

    def __init__(self, feature_dim: int, query_dim: int, attention_dim: int) -> None:
        super().__init__()
        self.query_proj = Linear(query_dim, feature_dim, bias=False)

    def project_keys(self, features: torch.Tensor) -> torch.Tensor:
        return features  # (B, L, D)

    def forward(self, keys: torch.Tensor, query: torch.Tensor) -> torch.Tensor:
        """``keys`` (B, L, D), ``query`` (B*G, Q) → scores (B*G, L)."""
        return grouped_dot(keys, self.query_proj(query))


class LocationScore(nn.Module):
    """Luong's location-based score ``W_a h``: one logit per cell from the decoder state
    alone, blind to what the cells hold. The ablation that shows how much of the grounding
    comes from *what* is in a cell rather than *where* it is.

    Args:
        feature_dim, query_dim, attention_dim: as for the other scores (only ``query_dim``
            is used).
        cells: L, the number of grid cells (fixed by the encoder).
    """

    def __init__(
        self, feature_dim: int, query_dim: int, attention_dim: int, cells: int | None = None
    ) -> None:
        super().__init__()
        if not cells:
            raise ConfigError("model.score=location needs the number of grid cells")
        self.proj = Linear(query_dim, cells)

    def project_keys(self, features: torch.Tensor) -> torch.Tensor:
        return features[:, :, :0]  # (B, L, 0): nothing about the content is used

    def forward(self, keys: torch.Tensor, query: torch.Tensor) -> torch.Tensor:
        """``keys`` (B, L, 0), ``query`` (B*G, Q) → scores (B*G, L)."""
        groups(keys, query.shape[0])  # the rows must divide among the images
        if keys.shape[1] != self.proj.out_features:
            raise ValueError(
                f"the location score was built for {self.proj.out_features} "
                f"cells; this grid has {keys.shape[1]}"
            )
        return self.proj(query)


def grouped_dot(keys: torch.Tensor, query: torch.Tensor) -> torch.Tensor:
    """Dot products of (B, L, A) keys with (B*G, A) queries → (B*G, L)."""
    batch, cells, dim = keys.shape
    g = groups(keys, query.shape[0])
    logits = torch.bmm(keys, query.view(batch, g, dim).transpose(1, 2))  # (B, L, G)
    return logits.transpose(1, 2).reshape(batch * g, cells)


@dataclass(frozen=True)
class ScoreSizes:
    """What every score function is built from: the width of a cell's features (D), of
    the decoder's state (Q), of the score's own hidden layer (A), and the number of cells
    (L, fixed by the encoder; None where unknown)."""

    feature_dim: int
    query_dim: int
    attention_dim: int
    cells: int | None = None


ScoreFactory = Callable[[ScoreSizes], nn.Module]
# The score functions by the name ``model.score`` gives, each built from :class:`ScoreSizes`.
# A score is a module with ``project_keys(features (B, L, D)) -> keys (B, L, A')``, computed
# once per image, and ``forward(keys, query (B*G, Q)) -> logits (B*G, L)`` (G rows an image).
SCORES: dict[str, ScoreFactory] = {}


def register_score(name: str, factory: ScoreFactory) -> ScoreFactory:
    """Make ``factory`` the score ``model.score=name`` builds; a name already taken is an
    error (unregister it from :data:`SCORES` first). docs/extending.md has an example."""
    if name in SCORES:
        raise ValueError(f"a score named {name!r} is already registered")
    SCORES[name] = factory
    return factory


for _name, _factory in {
    "additive": lambda s: AdditiveScore(s.feature_dim, s.query_dim, s.attention_dim, "tanh"),
    "additive_relu": lambda s: AdditiveScore(s.feature_dim, s.query_dim, s.attention_dim, "relu"),
    "dot": lambda s: DotScore(s.feature_dim, s.query_dim, s.attention_dim),
    "scaled_dot": lambda s: DotScore(s.feature_dim, s.query_dim, s.attention_dim, scaled=True),
    "cosine": lambda s: DotScore(s.feature_dim, s.query_dim, s.attention_dim, cosine=True),
    "general": lambda s: GeneralScore(s.feature_dim, s.query_dim, s.attention_dim),
    "location": lambda s: LocationScore(s.feature_dim, s.query_dim, s.attention_dim, s.cells),
}.items():
    register_score(_name, _factory)


def make_score(
    score: str | nn.Module,
    feature_dim: int,
    query_dim: int,
    attention_dim: int,
    cells: int | None = None,
) -> nn.Module:
    """A score module by name (see :data:`SCORES`) or a ready module, returned as is."""
    if isinstance(score, nn.Module):
        return score
    if score not in SCORES:
        raise unknown_choice("model.score", score, SCORES, "models.scores.register_score")
    return SCORES[score](ScoreSizes(feature_dim, query_dim, attention_dim, cells))
