"""The LSTM cell of a training word loop, with its weights' gradients taken once per caption.

In the paper's wiring each word's LSTM input holds the context attended with the state
before it, so teacher forcing steps through the words one at a time. Autograd then computes
the gradient of the cell's weights at every word, a product of 32 rows (one per caption)
added into a 2,048 x 2,560 gradient, and adds the nineteen of them together. The gradient is
the same sum as one product over all the words' rows, which runs at a far higher share of
the CPU's peak and writes the gradient once: :func:`deferred_cell` wraps the cell so that
each word's backward pass keeps its inputs and its gradient, and the weights' gradients are
computed from all of them after the last word's. The gradients are those of the word-by-word
cell to fp32 rounding (a test compares them).

Under autocast the weights are cast once per forward pass and each word's product runs in
the autocast dtype, as torch's cell runs it; the weights' gradients are then one product
over every word's rows, rounded once, where torch's cell adds the nineteen words' bf16
gradients in bf16. It applies to a cell whose weights need gradients.

On a CPU whose few-row products run faster with the weight on the left (the ``transposed``
form of :mod:`captioning.models.packing`, chosen on AMD's CPUs), each word's fp32 products
and their inputs' gradients run in that form, the weight transposed once per forward pass for
the gradients.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from captioning.models import packing
from captioning.models.packing import cell_update, transposed_linear

# False: every word loop uses torch's own cell (the benchmarks time both).
ENABLED = True

Cell = Callable[
    [torch.Tensor, tuple[torch.Tensor, torch.Tensor]], tuple[torch.Tensor, torch.Tensor]
]


class _Pieces:
    """Each word's rows of one weight's gradient: its inputs (R, K) and output grads (R, N);
    and whether each word's products run in the transposed form of
    :mod:`captioning.models.packing`, with the weight's transpose made once for the inputs'
    gradients."""

    def __init__(self, transposed: bool) -> None:
        self.inputs: list[torch.Tensor] = []
        self.grads: list[torch.Tensor] = []
        self.transposed = transposed
        self.weight_t: torch.Tensor | None = None


class _Share(torch.autograd.Function):
    """``weight``, ``bias`` → the same tensors, for every word to use; backward: their
    gradients in one product over every word's pieces (after every word's backward, which
    consumes these outputs)."""

    @staticmethod
    def forward(
        ctx: torch.autograd.function.FunctionCtx,
        weight: torch.Tensor,
        bias: torch.Tensor,
        pieces: _Pieces,
        dtype: torch.dtype,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        ctx.pieces, ctx.dtype = pieces, weight.dtype
        ctx.set_materialize_grads(False)
        if dtype != weight.dtype:  # cast once for every word (autocast)
            return weight.to(dtype), bias.to(dtype)
        return weight.view_as(weight), bias.view_as(bias)

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, *_: torch.Tensor | None) -> tuple:
        pieces = ctx.pieces
        if not pieces.grads:
            return None, None, None, None
        grads, inputs = torch.cat(pieces.grads), torch.cat(pieces.inputs)  # (W*R, N), (W*R, K)
        pieces.grads.clear()
        pieces.inputs.clear()
        pieces.weight_t = None
        if grads.dtype == torch.float16:  # a scaled loss's sum over every row may overflow
            grads, inputs = grads.float(), inputs.float()
        weight = (grads.t() @ inputs).to(ctx.dtype)
        return weight, grads.sum(dim=0, dtype=ctx.dtype), None, None


class _Use(torch.autograd.Function):
    """One word's ``F.linear(inputs, weight, bias)`` whose backward passes the inputs'
    gradient on and leaves the weight's to :class:`_Share`."""

    @staticmethod
    def forward(
        ctx: torch.autograd.function.FunctionCtx,
        inputs: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor,
        pieces: _Pieces,
    ) -> torch.Tensor:
        inputs = inputs.to(weight.dtype)  # the product's dtype: autocast's, or the weights'
        ctx.save_for_backward(inputs, weight)
        ctx.pieces = pieces
        if pieces.transposed and inputs.shape[0] <= packing.TRANSPOSED_MAX_ROWS:
            return transposed_linear(inputs, weight, bias)
        return F.linear(inputs, weight, bias)

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, grad: torch.Tensor) -> tuple:
        inputs, weight = ctx.saved_tensors
        pieces = ctx.pieces
        pieces.inputs.append(inputs)
        pieces.grads.append(grad)
        if not ctx.needs_input_grad[0]:
            return None, None, None, None
        if pieces.transposed and grad.shape[0] <= packing.TRANSPOSED_MAX_ROWS:
            if pieces.weight_t is None:
                pieces.weight_t = weight.t().contiguous()
            return transposed_linear(grad, pieces.weight_t, None), None, None, None
        return grad @ weight, None, None, None


def deferred_cell(cell: nn.LSTMCell) -> Cell:
    """``cell`` for one caption batch's word loop: called as the cell is, with its weights'
    gradients deferred (see the module docstring) when that applies, else the cell itself.
    Make one per forward pass."""
    weights = (cell.weight_ih, cell.bias_ih, cell.weight_hh, cell.bias_hh)
    applies = (
        ENABLED
        and torch.is_grad_enabled()
        and all(w is not None and w.requires_grad for w in weights)
    )
    if not applies:
        return cell
    device, dtype = cell.weight_ih.device.type, cell.weight_ih.dtype
    if torch.is_autocast_enabled(device):
        dtype = torch.get_autocast_dtype(device)
    transposed = dtype == torch.float32 and packing.host_form() == "transposed"
    pieces_ih, pieces_hh = _Pieces(transposed), _Pieces(transposed)
    weight_ih, bias_ih = _Share.apply(cell.weight_ih, cell.bias_ih, pieces_ih, dtype)
    weight_hh, bias_hh = _Share.apply(cell.weight_hh, cell.bias_hh, pieces_hh, dtype)

    def step(
        inputs: torch.Tensor, hx: tuple[torch.Tensor, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        h, c = hx
        gates = _Use.apply(h, weight_hh, bias_hh, pieces_hh) + _Use.apply(
            inputs, weight_ih, bias_ih, pieces_ih
        )
        return cell_update(gates, c)

    return step
