"""The LSTM decoder of Show, Attend and Tell.

At step t, with the previous word y_{t-1} and state (h_{t-1}, c_{t-1}):

    alpha_t, z_t = attention(a, h_{t-1})            # soft, hard or none
    z_t         <- beta_t * z_t,  beta_t = sigmoid(f_beta(h_{t-1}))   (gate: scalar | vector)
    h_t, c_t     = LSTM([E y_{t-1}; z_t], (h_{t-1}, c_{t-1}))
    p(y_t)       = softmax(L_o tanh(E y_{t-1} + L_h h_t + L_z z_t))   (deep_output)
               or softmax(W h_t)                                       (no deep output)

h_0, c_0 = tanh(W_h mean_i a_i), tanh(W_c mean_i a_i) (``init_state: tanh``, the authors'
code) or without the tanh (``linear``). :meth:`Decoder.step` is the one-word function that
decoding reuses; :meth:`Decoder.forward` (teacher forcing) runs the same pieces over a whole
caption and computes the output layer once for all steps.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from captioning.models.attention import AttentionOutput


@dataclass
class DecoderState:
    """LSTM state ``h``, ``c``: (B, H) each."""

    h: torch.Tensor
    c: torch.Tensor

    def select(self, index: torch.Tensor) -> DecoderState:
        """Rows ``index`` of the state (beam search reorders and repeats rows)."""
        return DecoderState(self.h.index_select(0, index), self.c.index_select(0, index))


@dataclass
class DecoderOutput:
    """Teacher-forced outputs for T steps.

    Attributes:
        logits: (B, T, V) scores of the next word.
        alphas: (B, T, L) attention weights.
        log_probs: (B, T) log p(s_t) of the chosen cells (hard attention), else None.
        sampled: (B, T) bool, steps whose context came from a sampled cell, else None.
        cells: (B, T) chosen cells (hard attention), else None.
        betas: (B, T) mean gate value per step (1 when there is no gate).
    """

    logits: torch.Tensor
    alphas: torch.Tensor
    log_probs: torch.Tensor | None = None
    sampled: torch.Tensor | None = None
    cells: torch.Tensor | None = None
    betas: torch.Tensor | None = None


@dataclass
class StepOutput:
    """One decoding step: ``logits`` (B, V), the new ``state`` and the ``attention`` output."""

    logits: torch.Tensor
    state: DecoderState
    attention: AttentionOutput


class Decoder(nn.Module):
    """LSTM decoder with attention, gate and deep output.

    Args:
        vocab_size: V.
        feature_dim: D, the grid feature size.
        attention: a module from :func:`captioning.models.attention.build_attention`.
        embed_dim: word embedding size m.
        hidden_dim: LSTM size n.
        gate: ``scalar`` (the paper's beta), ``vector`` (one gate per feature), or ``none``.
        deep_output: the paper's ``L_o(E y + L_h h + L_z z)``; else a linear layer on h.
        context_to_lstm: feed z_t to the LSTM (the paper). False leaves z_t to the deep
            output alone, so no glimpse is carried to later words.
        init_state: ``tanh`` or ``linear`` MLP from the mean feature to h_0, c_0.
        dropout: dropout on h and on the deep-output layer.
    """

    def __init__(
        self,
        vocab_size: int,
        feature_dim: int,
        attention: nn.Module,
        embed_dim: int = 512,
        hidden_dim: int = 1024,
        gate: str = "scalar",
        deep_output: bool = True,
        context_to_lstm: bool = True,
        init_state: str = "tanh",
        dropout: float = 0.5,
    ) -> None:
        super().__init__()
        self.vocab_size = vocab_size
        self.hidden_dim = hidden_dim
        self.attention = attention
        self.embedding = nn.Embedding(vocab_size, embed_dim)
        self.init_h = nn.Linear(feature_dim, hidden_dim)
        self.init_c = nn.Linear(feature_dim, hidden_dim)
        self.init_activation = torch.tanh if init_state == "tanh" else nn.Identity()
        gate_sizes = {"scalar": 1, "vector": feature_dim, "none": 0}
        if gate not in gate_sizes:
            raise ValueError(f"gate must be scalar, vector or none, got {gate!r}")
        self.gate = nn.Linear(hidden_dim, gate_sizes[gate]) if gate != "none" else None
        if not (context_to_lstm or deep_output):
            raise ValueError("context_to_lstm=False needs deep_output=True to use the context")
        self.context_to_lstm = context_to_lstm
        self.lstm = nn.LSTMCell(embed_dim + (feature_dim if context_to_lstm else 0), hidden_dim)
        self.dropout = nn.Dropout(dropout)
        self.deep_output = deep_output
        if deep_output:
            self.hidden_to_out = nn.Linear(hidden_dim, embed_dim)
            self.context_to_out = nn.Linear(feature_dim, embed_dim)
            self.out = nn.Linear(embed_dim, vocab_size)
        else:
            self.out = nn.Linear(hidden_dim, vocab_size)

    # ------------------------------------------------------------------ pieces

    def init_state(self, features: torch.Tensor) -> DecoderState:
        """h_0, c_0 from the mean grid feature. ``features`` (B, L, D)."""
        mean = features.mean(dim=1)  # (B, D)
        return DecoderState(
            self.init_activation(self.init_h(mean)), self.init_activation(self.init_c(mean))
        )

    def prepare(self, features: torch.Tensor) -> torch.Tensor:
        """The attention keys, computed once per batch: (B, L, D) → (B, L, K)."""
        return self.attention.project_keys(features)

    def _advance(
        self,
        embedded: torch.Tensor,
        state: DecoderState,
        features: torch.Tensor,
        keys: torch.Tensor,
        **attention_kwargs: object,
    ) -> tuple[DecoderState, AttentionOutput, torch.Tensor, torch.Tensor]:
        """Attend, gate and run the LSTM cell: returns state, attention, gated context, beta."""
        attended = self.attention(features, keys, state.h, **attention_kwargs)
        context = attended.context  # (B, D)
        if self.gate is not None:
            beta = torch.sigmoid(self.gate(state.h))  # (B, 1) or (B, D)
            context = beta * context
            beta_mean = beta.mean(dim=1)  # (B,)
        else:
            beta_mean = context.new_ones(context.shape[0])
        inputs = torch.cat([embedded, context], dim=1) if self.context_to_lstm else embedded
        h, c = self.lstm(inputs, (state.h, state.c))
        return DecoderState(h, c), attended, context, beta_mean

    def output(
        self, embedded: torch.Tensor, hidden: torch.Tensor, context: torch.Tensor
    ) -> torch.Tensor:
        """Next-word logits from (..., E), (..., H), (..., D) → (..., V)."""
        hidden = self.dropout(hidden)
        if not self.deep_output:
            return self.out(hidden)
        deep = torch.tanh(embedded + self.hidden_to_out(hidden) + self.context_to_out(context))
        return self.out(self.dropout(deep))

    # ------------------------------------------------------------------ entry points

    def step(
        self,
        tokens: torch.Tensor,
        state: DecoderState,
        features: torch.Tensor,
        keys: torch.Tensor,
        **attention_kwargs: object,
    ) -> StepOutput:
        """One word: previous ``tokens`` (B,) → next-word logits (B, V) and the new state.

        ``features`` and ``keys`` may hold B / G images for G rows each, image-major (the
        beams of beam search); see :mod:`captioning.models.attention`."""
        embedded = self.embedding(tokens)  # (B, E)
        state, attended, context, _ = self._advance(
            embedded, state, features, keys, **attention_kwargs
        )
        return StepOutput(self.output(embedded, state.h, context), state, attended)

    def forward(
        self,
        features: torch.Tensor,
        tokens: torch.Tensor,
        **attention_kwargs: object,
    ) -> DecoderOutput:
        """Teacher forcing: ``features`` (B, L, D) and input ``tokens`` (B, T) (``<start>``
        first, last word dropped) → outputs for the T next words."""
        keys = self.prepare(features)  # (B, L, K), once per batch
        state = self.init_state(features)
        embedded = self.embedding(tokens)  # (B, T, E)
        hiddens, contexts, alphas, betas = [], [], [], []
        log_probs, sampled, cells = [], [], []
        for t in range(tokens.shape[1]):
            state, attended, context, beta = self._advance(
                embedded[:, t], state, features, keys, **attention_kwargs
            )
            hiddens.append(state.h)
            contexts.append(context)
            alphas.append(attended.alpha)
            betas.append(beta)
            if attended.log_prob is not None:
                log_probs.append(attended.log_prob)
                sampled.append(attended.sampled)
                cells.append(attended.cell)
        logits = self.output(
            embedded, torch.stack(hiddens, dim=1), torch.stack(contexts, dim=1)
        )  # (B, T, V)
        hard = bool(log_probs)
        return DecoderOutput(
            logits=logits,
            alphas=torch.stack(alphas, dim=1),  # (B, T, L)
            log_probs=torch.stack(log_probs, dim=1) if hard else None,  # (B, T)
            sampled=torch.stack(sampled, dim=1) if hard else None,  # (B, T)
            cells=torch.stack(cells, dim=1) if hard else None,  # (B, T)
            betas=torch.stack(betas, dim=1),  # (B, T)
        )
