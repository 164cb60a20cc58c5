"""The naive reference decoder that the benchmark times ours against.

:class:`ReferenceDecoder` is the decoder of Show, Attend and Tell written the way popular
tutorial code writes it: a Python loop over words in which every step re-projects the whole
grid into attention keys and applies the output layer on its own. Its layers are its own,
built from a :class:`~captioning.config.ModelConfig` and named as
:class:`captioning.models.Decoder` names its layers, so
``reference.load_state_dict(model.decoder.state_dict())`` gives it a decoder's weights: the
state-dict keys are the public checkpoint format, and the reference reads nothing else of the
decoder. It supports soft attention with the ``additive`` (tanh) and ``additive_relu``
scores.

Its decoding (one image at a time) is :mod:`benchmarks.reference_decoding`; the check that it
computes what ours computes is :mod:`benchmarks.reference_check`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch
import torch.nn.functional as F
from torch import nn

from captioning.config import ModelConfig
from captioning.models import AttentionTrace, DecoderOutput
from captioning.models.attention import EXPECTATION, HardContext

# The attention scores the reference implements, by ``model.score``: their activation.
REFERENCE_SCORES: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "additive": torch.tanh,
    "additive_relu": F.relu,
}
GATE_SIZES = ("scalar", "vector", "none")


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
