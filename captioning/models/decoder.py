"""The LSTM decoder of Show, Attend and Tell.

At step t, with the previous word y_{t-1} and state (h_{t-1}, c_{t-1}):

    alpha_t, z_t = attention(a, h_{t-1})            # soft, hard or none
    z_t         <- beta_t * z_t,  beta_t = sigmoid(f_beta(h_{t-1}))   (gate: scalar | vector)
    h_t, c_t     = LSTM([E y_{t-1}; z_t], (h_{t-1}, c_{t-1}))
    p(y_t)       = softmax(L_o tanh(E y_{t-1} + L_h h_t + L_z z_t))   (deep_output)
               or softmax(W h_t)                                       (no deep output)

h_0, c_0 = tanh(W_h mean_i a_i), tanh(W_c mean_i a_i) (``init_state: tanh``, the authors'
code), without the tanh (``linear``), or one learned pair for every image (``learned``).

With ``context_words``, a linear layer also reads each word from its attended context alone,
softmax(W_w z_t) with z_t before the gate; training's context-word term adds its
cross-entropy to the caption's, so a word's map is paid for falling where its word can be
read. Decoding never uses it.

A two-level encoder adds a summary s of the image (the backbone's whole depth pooled; see
:class:`captioning.models.encoder.Encoder`) after the grid's cells: the attention sees only
the cells, s replaces the mean cell in the initial state (``summary: init``) and/or enters
the deep output as ``L_s s`` beside ``L_z z_t`` (``summary: output``).

:meth:`Decoder.step` is the one-word function that decoding reuses; :meth:`Decoder.forward`
(teacher forcing) runs the same pieces over a whole caption and computes the output layer
once for all steps.

Without the context in the LSTM (``context_to_lstm=False``), h_1..h_T under teacher forcing
do not depend on the attention, so :meth:`Decoder.forward` needs no loop over words
(``Decoder(parallel=True)``, the default; always for the exact marginal): one
fused LSTM call over the caption (the same weights as the cell :meth:`step` uses), then all
T queries scored against the grid at once. The same independence makes the exact marginal
over cells tractable: p(y_t | y_<t, a) = sum_l alpha_tl p(y_t | a_l, h_t) (``HardContext``
mode ``marginal``), computed in chunks of cells so that memory stays bounded.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from captioning.models.attention import EXPECTATION, AttentionOutput, HardContext
from captioning.models.deferred import Cell, deferred_cell
from captioning.models.encoder import split_summary
from captioning.models.packing import Linear, LSTMCell, cell_update
from captioning.models.scores import groups
from captioning.models.tanh_score import shared_keys
from captioning.models.trace import AttentionTrace
from captioning.models.word_maps import WordMaps

# Cells per chunk of the exact marginal are chosen so that a chunk's (rows, steps, cells,
# vocabulary) log-probabilities hold about this many elements (64 MB in fp32).
MARGINAL_CHUNK_ELEMENTS = 1 << 24


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
        logits: (B, T, V) scores of the next word; None for the exact marginal, which
            gives ``target_log_probs`` instead.
        trace: (B, T, ...) what the attention reported about each word: ``alpha``
            (B, T, L) and the fields of its kind.
        log_probs: (B, T) log p(s_t) of the chosen cells (hard attention), else None.
        sampled: (B, T) bool, steps whose context came from a sampled cell, else None.
        betas: (B, T) mean gate value per step (1 when there is no gate).
        target_log_probs: (B, T) log p(y_t | y_<t, a), marginalised over the cells
            (HardContext mode ``marginal``), else None.
        context_logits: (B, T, V) each word read from its attended context alone (before
            the gate) by the decoder's ``context_words`` layer, else None.
        word_maps: the captioner's word localiser's presence logits and each target's map
            (:mod:`captioning.models.word_maps`), else None.
        queries: (B, T, H) the state each word's attention was queried with (h_{t-1}, or
            h_t with the decoder's ``query=current``).
        expected_logits: (B, T, V) each next word as the expected-word score
            (``model.word_attention``) reads it from its query, else None.
    """

    logits: torch.Tensor | None
    trace: AttentionTrace
    log_probs: torch.Tensor | None = None
    sampled: torch.Tensor | None = None
    betas: torch.Tensor | None = None
    target_log_probs: torch.Tensor | None = None
    context_logits: torch.Tensor | None = None
    word_maps: WordMaps | None = None
    queries: torch.Tensor | None = None
    expected_logits: torch.Tensor | None = None

    @property
    def alphas(self) -> torch.Tensor:
        """(B, T, L) the attention weights of each word."""
        return self.trace.alpha


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
        value_dim: None: the context is a weighted average of the features themselves.
            Else key-value attention: the context averages values W_v a_i of this size, a
            projection of its own beside the score's keys.
        parallel: teacher forcing without the context in the LSTM runs all words at once
            (the same numbers as the step loop to 1e-5, and the same trained weights, as
            tests check). False forces the step loop, which the paper's wiring always uses;
            the exact marginal always runs all words at once.
        summary_dim: S, the size of the image's summary packed after the grid's cells
            (0: none), in ``summary_rows`` rows of D channels.
        summary: where the summary goes: ``init`` (the initial state), ``output`` (the
            deep output), ``both``, or ``none``.
        summary_gate: at the deep output, the summary's term is scaled at each word by a
            gate of its own, sigmoid(w^T h_t + b), as the paper's beta scales the context:
            the image's summary can be turned down for the words it does not help.
        query: what the attention asks with: ``previous``, h_{t-1} (the paper), or
            ``current``, h_t, the state after the LSTM has read the previous word (only
            without the context in the LSTM): the query then knows the word it follows.
        context_words: a linear layer from each word's attended context (before the gate)
            to the vocabulary, whose cross-entropy pays a map for falling where its word
            can be read (:func:`captioning.objectives.cross_entropy.caption_loss`).
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
        value_dim: int | None = None,
        parallel: bool = True,
        summary_dim: int = 0,
        summary_rows: int = 0,
        summary: str = "none",
        context_words: bool = False,
        query: str = "previous",
        summary_gate: bool = False,
    ) -> None:
        super().__init__()
        if query not in ("previous", "current"):
            raise ValueError(f"query must be previous or current, got {query!r}")
        if query == "current" and context_to_lstm:
            raise ValueError("query=current needs context_to_lstm=False")
        self.query_current = query == "current"
        self.parallel = parallel
        self.vocab_size = vocab_size
        self.hidden_dim = hidden_dim
        self.attention = attention
        self.embedding = nn.Embedding(vocab_size, embed_dim)
        if summary not in ("none", "init", "output", "both"):
            raise ValueError(f"summary must be none, init, output or both, got {summary!r}")
        if summary != "none" and not (summary_dim and summary_rows):
            raise ValueError(f"summary={summary} needs an encoder with a summary")
        self.summary_dim, self.summary_rows = summary_dim, summary_rows
        self.learned_init = init_state == "learned"
        if self.learned_init:
            if summary in ("init", "both"):
                raise ValueError("a learned initial state does not read the summary")
            self.initial_h = nn.Parameter(torch.zeros(hidden_dim))
            self.initial_c = nn.Parameter(torch.zeros(hidden_dim))
        else:
            init_dim = summary_dim if summary in ("init", "both") else feature_dim
            self.init_h = Linear(init_dim, hidden_dim)
            self.init_c = Linear(init_dim, hidden_dim)
        self.init_from_summary = summary in ("init", "both")
        self.init_activation = torch.tanh if init_state == "tanh" else nn.Identity()
        self.value_proj = Linear(feature_dim, value_dim) if value_dim else None
        context_dim = value_dim or feature_dim
        gate_sizes = {"scalar": 1, "vector": context_dim, "none": 0}
        if gate not in gate_sizes:
            raise ValueError(f"gate must be scalar, vector or none, got {gate!r}")
        self.gate = Linear(hidden_dim, gate_sizes[gate]) if gate != "none" else None
        if not (context_to_lstm or deep_output):
            raise ValueError("context_to_lstm=False needs deep_output=True to use the context")
        self.context_to_lstm = context_to_lstm
        self.lstm = LSTMCell(embed_dim + (context_dim if context_to_lstm else 0), hidden_dim)
        self.dropout = nn.Dropout(dropout)
        self.deep_output = deep_output
        if deep_output:
            self.hidden_to_out = Linear(hidden_dim, embed_dim)
            self.context_to_out = Linear(context_dim, embed_dim)
            self.out = Linear(embed_dim, vocab_size)
        else:
            self.out = Linear(hidden_dim, vocab_size)
        self.summary_to_out = None
        if summary in ("output", "both"):
            if not deep_output:
                raise ValueError("summary=output needs deep_output=True")
            self.summary_to_out = Linear(summary_dim, embed_dim, bias=False)
        if summary_gate and self.summary_to_out is None:
            raise ValueError("summary_gate gates the summary at the output: needs summary=output")
        self.summary_gate = Linear(hidden_dim, 1) if summary_gate else None
        self.context_words = Linear(context_dim, vocab_size) if context_words else None

    # ------------------------------------------------------------------ pieces

    def split(self, features: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The grid cells (B, L, D) the attention sees and the summary (B, S) or None."""
        return split_summary(features, self.summary_rows, self.summary_dim)

    def init_state(self, features: torch.Tensor, per_image: int = 1) -> DecoderState:
        """h_0, c_0 from the mean grid feature (or the summary, or learned). ``features``
        (B, L, D); with ``per_image`` G > 1, G rows per image (B*G, image-major), one for
        each caption decoded from it."""
        cells, summary = self.split(features)
        if self.learned_init:
            shape = (features.shape[0] * per_image, self.hidden_dim)
            dtype = torch.get_autocast_dtype(features.device.type)
            if not torch.is_autocast_enabled(features.device.type):
                dtype = features.dtype
            return DecoderState(
                self.initial_h.to(dtype).expand(shape), self.initial_c.to(dtype).expand(shape)
            )
        source = summary if self.init_from_summary else cells.mean(dim=1)  # (B, S or D)
        state = DecoderState(
            self.init_activation(self.init_h(source)), self.init_activation(self.init_c(source))
        )
        if per_image == 1:
            return state
        image = torch.arange(features.shape[0], device=features.device)
        return state.select(image.repeat_interleave(per_image))  # (B*G, H) each

    def prepare(self, features: torch.Tensor) -> torch.Tensor:
        """The attention keys, computed once per batch: (B, L, D) → (B, L, K). With
        key-value attention the values come first: (B, L, V + K), one tensor, so that beam
        search selects both at once."""
        cells, _ = self.split(features)
        keys = self.attention.project_keys(cells)
        if self.value_proj is None:
            return keys
        return torch.cat([self.value_proj(cells), keys], dim=-1)

    def word_grid(self, features: torch.Tensor) -> torch.Tensor:
        """The grid as every word's products read it (and the key projection, whose autocast
        would cast it too): under autocast, cast to its dtype once for the caption instead of
        by autocast at every word; :meth:`init_state` reads the grid as it came. The
        products cast it anyway, so the numbers are the same; a word loop over the 14 x 14
        grid in bf16 otherwise spends a third of its time copying the grid. A grid that takes
        gradients (a fine-tuned encoder's: its gradient would add up in bf16) and hard
        attention's (a cell's feature meets other terms before any product) stay as they
        are."""
        device = features.device.type
        autocast = features.is_floating_point() and torch.is_autocast_enabled(device)
        if not autocast or features.requires_grad or self.attention.stochastic:
            return features
        return features.to(torch.get_autocast_dtype(device))

    def values_and_keys(
        self, features: torch.Tensor, prepared: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """What the context averages (the features, or their values) and the score's keys,
        from :meth:`prepare`'s tensor: what a tool that reads the attention's inputs (e.g.
        tools/colour_trace.py) needs besides the maps."""
        features, _ = self.split(features)
        if self.value_proj is None:
            return features, prepared
        size = self.value_proj.out_features
        return prepared[..., :size], prepared[..., size:]

    def _gate(self, h: torch.Tensor, context: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """beta * z and the mean beta per row: (R, H), (R, D) → (R, D), (R,)."""
        if self.gate is None:
            return context, context.new_ones(context.shape[0])
        beta = torch.sigmoid(self.gate(h))  # (R, 1) or (R, D)
        return beta * context, beta.mean(dim=1)

    def _advance(
        self,
        embedded: torch.Tensor,
        state: DecoderState,
        features: torch.Tensor,
        keys: torch.Tensor,
        hard: HardContext,
        cell: Cell | None = None,
    ) -> tuple[DecoderState, AttentionOutput, torch.Tensor, torch.Tensor]:
        """Attend, gate and run the LSTM cell (``cell``, or the model's own): returns state,
        attention, gated context, beta."""
        values, keys = self.values_and_keys(features, keys)
        if self.query_current:  # read the previous word first, then ask with h_t
            h, c = (cell or self.lstm)(embedded, (state.h, state.c))
            attended = self.attention(values, keys, h, hard)
            context, beta_mean = self._gate(h, attended.context)  # (B, D), (B,)
            return DecoderState(h, c), attended, context, beta_mean
        attended = self.attention(values, keys, state.h, hard)
        context, beta_mean = self._gate(state.h, attended.context)  # (B, D), (B,)
        inputs = torch.cat([embedded, context], dim=1) if self.context_to_lstm else embedded
        h, c = (cell or self.lstm)(inputs, (state.h, state.c))
        return DecoderState(h, c), attended, context, beta_mean

    def lead(
        self, embedded: torch.Tensor, features: torch.Tensor, hidden: torch.Tensor
    ) -> torch.Tensor:
        """The deep output's terms that depend on neither z nor the dropped-out h: ``E y``
        (R, [T,] E), plus ``L_s s`` when the summary goes to the output (R rows: G per image
        of ``features``), scaled by sigmoid(w^T h) of the ``hidden`` (R, [T,] H) that
        predicts when the summary has a gate."""
        _, summary = self.split(features)
        if self.summary_to_out is None or summary is None:
            return embedded
        term = self.summary_to_out(summary)  # (B, E)
        term = term.repeat_interleave(groups(term, embedded.shape[0]), dim=0)  # (R, E)
        term = term.unsqueeze(1) if embedded.dim() == 3 else term
        if self.summary_gate is not None:
            term = term * torch.sigmoid(self.summary_gate(hidden))  # (R, [T,] E)
        return embedded + term

    def output(
        self, embedded: torch.Tensor, hidden: torch.Tensor, context: torch.Tensor
    ) -> torch.Tensor:
        """Next-word logits from (..., E), (..., H), (..., D) → (..., V)."""
        hidden = self.dropout(hidden)
        if not self.deep_output:
            return self.out(hidden)
        deep = torch.tanh(embedded + self.hidden_to_out(hidden) + self.context_to_out(context))
        return self.out(self.dropout(deep))

    def read_words(self, contexts: torch.Tensor) -> torch.Tensor | None:
        """Each word's logits from its attended context alone: (..., D) → (..., V), or None
        without the ``context_words`` layer."""
        if self.context_words is None:
            return None
        return self.context_words(self.dropout(contexts))

    # ------------------------------------------------------------------ exact marginal

    def _cell_log_probs(
        self,
        base: torch.Tensor,
        beta: torch.Tensor | None,
        keep: torch.Tensor | None,
        cells: torch.Tensor,
        log_alpha: torch.Tensor,
    ) -> torch.Tensor:
        """log alpha_tl + log p(. | a_l, h_t) for a chunk of C cells.

        ``base`` (R, T, E) = E y + L_h h (the cell-independent part of the deep output),
        ``beta`` (R, T, 1 or D) the gate or None, ``keep`` (R, T, 1, E) the deep output's
        dropout mask (scaled; one per word, shared by the cells) or None, ``cells`` (R, C, D)
        the chunk's features, ``log_alpha`` (R, T, C) → (R, T, C, V)."""
        weight, bias = self.context_to_out.weight, self.context_to_out.bias
        if beta is None or beta.shape[-1] == 1:  # linear in the gate: project each cell once
            projected = F.linear(cells, weight).unsqueeze(1)  # (R, 1, C, E)
            if beta is not None:
                projected = beta.unsqueeze(3) * projected  # (R, T, C, E)
            projected = projected + bias
        else:  # one gate per feature: project each (step, cell) pair
            projected = F.linear(beta.unsqueeze(2) * cells.unsqueeze(1), weight, bias)
        deep = torch.tanh(base.unsqueeze(2) + projected)  # (R, T, C, E)
        if keep is not None:
            deep = deep * keep
        log_probs = torch.log_softmax(self.out(deep).float(), dim=-1)
        return log_alpha.unsqueeze(3) + log_probs  # (R, T, C, V)

    def _marginal(
        self,
        embedded: torch.Tensor,
        hidden: torch.Tensor,
        beta: torch.Tensor | None,
        features: torch.Tensor,
        alpha: torch.Tensor,
        targets: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """log sum_l alpha_tl p(y | a_l, h_t), in chunks of cells.

        ``embedded`` (R, T, E), ``hidden`` (R, T, H) the h_t that predict, ``beta`` (R, T,
        1 or D) or None, ``features`` (R, L, D), ``alpha`` (R, T, L). With ``targets``
        (R, T): the log-probability of each target (R, T); when there is more than one
        chunk, chunks are recomputed in the backward pass, so memory holds one at a time.
        Without: the whole distribution (R, T, V), for decoding."""
        rows, steps, cells = alpha.shape
        base = embedded + self.hidden_to_out(self.dropout(hidden))  # (R, T, E): one mask
        # The deep output's dropout: one mask per word, shared by the cells (a mask per
        # (word, cell) pair would cost as much as the marginal itself).
        keep = None
        if self.training and self.dropout.p > 0:
            keep = self.dropout(base.new_ones(rows, steps, 1, base.shape[-1]))
        log_alpha = torch.log(alpha.float().clamp_min(1e-30))  # (R, T, L)
        width = max(self.vocab_size, base.shape[-1], features.shape[-1])
        chunk = max(1, MARGINAL_CHUNK_ELEMENTS // (rows * steps * width))
        parts = []
        for start in range(0, cells, chunk):
            piece = (
                base,
                beta,
                keep,
                features[:, start : start + chunk],
                log_alpha[:, :, start : start + chunk],
            )
            if targets is None:
                parts.append(torch.logsumexp(self._cell_log_probs(*piece), dim=2))  # (R, T, V)
                if len(parts) == 2:  # a running sum keeps two distributions in memory
                    parts = [torch.logaddexp(*parts)]
            elif torch.is_grad_enabled() and chunk < cells:  # recompute, to hold one chunk
                parts.append(
                    checkpoint(self._target_log_probs, *piece, targets, use_reentrant=False)
                )
            else:
                parts.append(self._target_log_probs(*piece, targets))
        if targets is None:
            return parts[0]
        return torch.logsumexp(torch.stack(parts), dim=0)  # (R, T)

    def _target_log_probs(
        self,
        base: torch.Tensor,
        beta: torch.Tensor | None,
        keep: torch.Tensor | None,
        cells: torch.Tensor,
        log_alpha: torch.Tensor,
        targets: torch.Tensor,
    ) -> torch.Tensor:
        """log sum over a chunk's cells of alpha_tl p(y_t | a_l, h_t): (R, T)."""
        joint = self._cell_log_probs(base, beta, keep, cells, log_alpha)  # (R, T, C, V)
        index = targets[:, :, None, None].expand(-1, -1, joint.shape[2], 1)
        return torch.logsumexp(joint.gather(3, index).squeeze(3), dim=2)

    # ------------------------------------------------------------------ entry points

    def step(
        self,
        tokens: torch.Tensor,
        state: DecoderState,
        features: torch.Tensor,
        keys: torch.Tensor,
        hard: HardContext = EXPECTATION,
    ) -> StepOutput:
        """One word: previous ``tokens`` (B,) → next-word logits (B, V) and the new state.

        ``features`` and ``keys`` may hold B / G images for G rows each, image-major (the
        beams of beam search); see :mod:`captioning.models.attention`. In ``marginal``
        mode the logits are the marginal log-probabilities over the cells."""
        self._check_marginal(hard)
        embedded = self.embedding(tokens)  # (B, E)
        previous = state.h
        state, attended, context, _ = self._advance(embedded, state, features, keys, hard)
        query = state.h if self.query_current else previous
        lead = self.lead(embedded, features, state.h)
        if hard.mode != "marginal":
            return StepOutput(self.output(lead, state.h, context), state, attended)
        values, _ = self.values_and_keys(features, keys)
        rows = values.repeat_interleave(tokens.shape[0] // values.shape[0], dim=0)
        beta = torch.sigmoid(self.gate(query)).unsqueeze(1) if self.gate is not None else None
        logits = self._marginal(
            lead.unsqueeze(1), state.h.unsqueeze(1), beta, rows, attended.alpha.unsqueeze(1)
        ).squeeze(1)  # (B, V)
        return StepOutput(logits, state, attended)

    def forward(
        self,
        features: torch.Tensor,
        tokens: torch.Tensor,
        hard: HardContext = EXPECTATION,
        targets: torch.Tensor | None = None,
    ) -> DecoderOutput:
        """Teacher forcing: ``features`` (B, L, D) and input ``tokens`` (B, T) (``<start>``
        first, last word dropped) → outputs for the T next words. ``hard`` may carry (B, T)
        cells or (B, T, L) noise. The ``marginal`` mode needs the ``targets`` (B, T).

        ``tokens`` may also hold G captions per image (B*G rows, image-major, as sampled
        captions come): the grid is then projected once per image and each caption's
        queries are scored against its image's keys, never against a copy of them; every
        other tensor above counts B*G rows."""
        self._check_marginal(hard)
        if hard.mode == "marginal" and targets is None:
            raise ValueError("the exact marginal needs the target words")
        by_step = self.context_to_lstm or not (self.parallel or hard.mode == "marginal")
        grid = self.word_grid(features) if by_step else features
        keys = self.prepare(grid)  # (B, L, K), once per batch, from the grid cast once
        state = self.init_state(features, groups(features, tokens.shape[0]))  # (B*G, H) each
        embedded = self.embedding(tokens)  # (B*G, T, E)
        if by_step:
            return self._forward_by_step(grid, keys, state, embedded, hard)
        return self._forward_parallel(features, keys, state, embedded, hard, targets)

    def _check_marginal(self, hard: HardContext) -> None:
        if hard.mode == "marginal" and self.context_to_lstm:
            raise ValueError(
                "the exact marginal over cells needs context_to_lstm=False: with the context "
                "in the LSTM, h_t depends on every earlier cell"
            )

    def _forward_by_step(
        self,
        features: torch.Tensor,
        keys: torch.Tensor,
        state: DecoderState,
        embedded: torch.Tensor,
        hard: HardContext,
    ) -> DecoderOutput:
        """One step at a time, as decoding runs: the paper's wiring needs it (each h_t depends
        on the context before it); without the context in the LSTM it runs only when
        :attr:`parallel` is off."""
        hiddens, contexts, traces, betas, attended_contexts = [], [], [], [], []
        log_probs, sampled = [], []
        initial = state.h
        cell = deferred_cell(self.lstm)  # one product per weight gradient, not one per word
        keys = shared_keys(keys)  # one keys gradient, summed in place
        for t in range(embedded.shape[1]):
            state, attended, context, beta = self._advance(
                embedded[:, t], state, features, keys, hard.at(t), cell
            )
            hiddens.append(state.h)
            contexts.append(context)
            attended_contexts.append(attended.context)
            traces.append(attended.trace)
            betas.append(beta)
            if attended.log_prob is not None:
                log_probs.append(attended.log_prob)
                sampled.append(attended.sampled)
        hidden = torch.stack(hiddens, dim=1)  # (B, T, H)
        logits = self.output(
            self.lead(embedded, features, hidden), hidden, torch.stack(contexts, dim=1)
        )  # (B, T, V)
        hard_rows = bool(log_probs)
        return DecoderOutput(
            logits=logits,
            trace=AttentionTrace.stack(traces, dim=1),  # (B, T, ...)
            log_probs=torch.stack(log_probs, dim=1) if hard_rows else None,  # (B, T)
            sampled=torch.stack(sampled, dim=1) if hard_rows else None,  # (B, T)
            betas=torch.stack(betas, dim=1),  # (B, T)
            context_logits=self.read_words(torch.stack(attended_contexts, dim=1)),
            queries=torch.stack(hiddens if self.query_current else [initial, *hiddens[:-1]], 1),
        )

    def _run_lstm(self, embedded: torch.Tensor, state: DecoderState) -> torch.Tensor:
        """h_1..h_T (B, T, H) from one LSTM pass with the cell's own weights."""
        cell = self.lstm
        weights = [cell.weight_ih, cell.weight_hh, cell.bias_ih, cell.bias_hh]
        return lstm_sequence(embedded, state.h, state.c, weights)

    def _forward_parallel(
        self,
        features: torch.Tensor,
        keys: torch.Tensor,
        state: DecoderState,
        embedded: torch.Tensor,
        hard: HardContext,
        targets: torch.Tensor | None,
    ) -> DecoderOutput:
        """All T words at once: the LSTM never sees the context, so the queries (h_0..h_{T-1},
        or h_1..h_T with ``query=current``) are known before any attention runs; they are
        scored as T query groups per image."""
        batch, steps, _ = embedded.shape
        values, keys = self.values_and_keys(features, keys)
        hiddens = self._run_lstm(embedded, state)  # (B, T, H): h_1..h_T
        queries = hiddens  # h_1..h_T (query=current)
        if not self.query_current:
            queries = torch.cat([state.h.unsqueeze(1), hiddens[:, :-1]], dim=1)  # h_0..h_{T-1}
        queries = queries.reshape(batch * steps, -1)  # (B*T, H), image-major
        attended = self.attention(values, keys, queries, hard.flat(steps))
        context, beta = self._gate(queries, attended.context)  # (B*T, D), (B*T,)
        trace = attended.trace.unflatten(0, (batch, steps))  # (B, T, ...)

        def per_step(values: torch.Tensor | None) -> torch.Tensor | None:
            return None if values is None else values.view(batch, steps)

        output = DecoderOutput(
            logits=None,
            trace=trace,
            log_probs=per_step(attended.log_prob),
            sampled=per_step(attended.sampled),
            betas=beta.view(batch, steps),
            context_logits=self.read_words(attended.context.view(batch, steps, -1)),
            queries=queries.view(batch, steps, -1),
        )
        lead = self.lead(embedded, features, hiddens)  # (B, T, E)
        if hard.mode != "marginal":
            output.logits = self.output(lead, hiddens, context.view(batch, steps, -1))
            return output
        gate = None
        if self.gate is not None:
            gate = torch.sigmoid(self.gate(queries)).view(batch, steps, -1)  # (B, T, 1|D)
        rows = values.repeat_interleave(groups(values, batch), dim=0)  # (B*G, L, D): per row
        output.target_log_probs = self._marginal(
            lead, hiddens, gate, rows, trace.alpha, targets
        )  # (B, T)
        return output


# --------------------------------------------------------------------------- the LSTM pass


def lstm_sequence(
    inputs: torch.Tensor, h0: torch.Tensor, c0: torch.Tensor, weights: Sequence[torch.Tensor]
) -> torch.Tensor:
    """h_1..h_T of one LSTM layer over ``inputs`` (B, T, E) from ``h0``, ``c0`` (B, H), with
    an :class:`torch.nn.LSTMCell`'s ``weights`` (``weight_ih``, ``weight_hh``, ``bias_ih``,
    ``bias_hh``) → (B, T, H).

    Torch's fused kernel, when its private entry point (what ``nn.LSTM`` calls) is there and
    gives :func:`lstm_by_step`'s numbers on a probe; else :func:`lstm_by_step` itself."""
    fused = _fused_lstm()
    if fused is None:
        return lstm_by_step(inputs, h0, c0, weights)
    return fused(inputs, h0, c0, weights)


def lstm_by_step(
    inputs: torch.Tensor, h0: torch.Tensor, c0: torch.Tensor, weights: Sequence[torch.Tensor]
) -> torch.Tensor:
    """:func:`lstm_sequence` with public operations only: the input projection for all
    steps at once, then the recurrence one step at a time (torch's gate order i, f, g, o)."""
    weight_ih, weight_hh, bias_ih, bias_hh = weights
    projected = F.linear(inputs, weight_ih, bias_ih)  # (B, T, 4H)
    h, c, hiddens = h0, c0, []
    for t in range(inputs.shape[1]):
        h, c = cell_update(projected[:, t] + F.linear(h, weight_hh, bias_hh), c)  # (B, H)
        hiddens.append(h)
    return torch.stack(hiddens, dim=1)  # (B, T, H)


def _private_lstm(
    inputs: torch.Tensor, h0: torch.Tensor, c0: torch.Tensor, weights: Sequence[torch.Tensor]
) -> torch.Tensor:
    """:func:`lstm_sequence` through ``torch._VF.lstm``, which ``nn.LSTM(batch_first=True)``
    calls: one layer, no dropout, one direction (in training mode when a backward pass may
    follow, which cuDNN needs)."""
    hx = (h0.unsqueeze(0).contiguous(), c0.unsqueeze(0).contiguous())  # (1, B, H) each
    hiddens, _, _ = torch._VF.lstm(
        inputs, hx, list(weights), True, 1, 0.0, torch.is_grad_enabled(), False, True
    )
    return hiddens  # (B, T, H)


@functools.cache
def _fused_lstm() -> Callable[..., torch.Tensor] | None:
    """:func:`_private_lstm` when ``torch._VF.lstm`` exists, takes its arguments and agrees
    with :func:`lstm_by_step` on a small random probe (a private API may change in any
    release), else None. Checked once per process, on the CPU, without touching the global
    random generators."""
    if not callable(getattr(getattr(torch, "_VF", None), "lstm", None)):
        return None
    generator = torch.Generator().manual_seed(0)
    inputs, h0, c0 = (torch.randn(2, *shape, generator=generator) for shape in ((3, 4), (5,), (5,)))
    weights = [
        torch.randn(*shape, generator=generator) * 0.5 for shape in ((20, 4), (20, 5), (20,), (20,))
    ]
    try:
        with torch.no_grad(), torch.autocast("cpu", enabled=False):
            fused = _private_lstm(inputs, h0, c0, weights)
            public = lstm_by_step(inputs, h0, c0, weights)
    except (TypeError, RuntimeError):  # another signature
        return None
    if fused.shape != public.shape or not torch.allclose(fused, public, atol=1e-5):
        return None
    return _private_lstm
