"""The additive score's training form on the CPU: ``w^T tanh(k_i + q) + b`` over blocks of
images, with its backward pass written out.

Autograd's form of the score keeps the hidden layer ``tanh(k_i + q)`` (B, G, L, A) for the
backward pass: with every word of a caption scored at once (the parallel decoder) that is
tens of MB a step, written, read back and run through tanh (0.87 ns a value in bf16 on the
Xeon). Here each block of images (a few MB, so that it stays in a core's cache) is computed
in fp32 as ``2 w^T sigmoid(2 (k_i + q)) + b - sum(w)`` (the same function: tanh(x) =
2 sigmoid(2x) - 1; the sigmoid takes 0.28 ns a value in fp32), nothing of size
(B, G, L, A) is kept, and the backward pass recomputes each block's sigmoid and forms every
gradient from it:

    d score / d x_a = 4 w_a s_a (1 - s_a),    d score / d w_a = 2 s_a - 1 = tanh(x_a),

with s = sigmoid(2x), x = k_i + q. The keys and queries may be bf16 (autocast): each block
is summed into fp32, so the score is no less exact than autocast's bf16 tanh, and the
gradients return in the inputs' dtypes. Tests compare every gradient with autograd's.

A word loop scores every word against the same keys, and autograd would hand each word's
keys gradient over as a tensor of its own and add them up (a pass over (B, L, A) values
more per word). Keys passed through :func:`shared_keys` carry one fp32 sum instead: each
word's backward pass adds its gradient into it in place, and the sum is handed on once,
after the last word's. Under autocast they also carry one fp32 copy of the bf16 keys, which
each word's score would otherwise make twice (forward and backward). Like
:mod:`captioning.models.deferred`, it expects each backward pass through a word's score to
go on to the keys.

Where the C kernel of :mod:`captioning.models.fused_score` is built, both passes run it
instead of the blocks: one pass over the keys each, the same gradients.
"""

from __future__ import annotations

import torch

from captioning.models import fused_score

# The hidden values (images * G * L * A) of one block, 2 MB in fp32: a core's cache.
BLOCK_ELEMENTS = 1 << 19


class KeysGradient:
    """What the words of one forward pass share about their keys: the keys' gradient summed
    over the words, and the keys in fp32 (cast once, where under autocast each word's score
    would cast them, forward and again backward)."""

    def __init__(self) -> None:
        self.total: torch.Tensor | None = None  # (B, 1, L, A) once a word's backward ran
        self._fp32: torch.Tensor | None = None

    def fp32(self, keys: torch.Tensor) -> torch.Tensor:
        """``keys`` (the words' common (B, 1, L, A) view) as fp32 values."""
        if keys.dtype == torch.float32:
            return keys
        if self._fp32 is None or self._fp32.shape != keys.shape:
            self._fp32 = keys.detach().float()
        return self._fp32


def shared_keys(keys: torch.Tensor) -> torch.Tensor:
    """``keys`` (B, L, A) as every word of a loop scores against them: the same values,
    whose gradient the words' :func:`tanh_score` sum in place (see the module docstring).
    Make one per forward pass; without gradients, ``keys`` itself."""
    if not (torch.is_grad_enabled() and keys.requires_grad):
        return keys
    sink = KeysGradient()
    shared = _ShareKeys.apply(keys, sink)
    shared.gradient_sink = sink  # read by the score, which passes it to tanh_score
    return shared


class _ShareKeys(torch.autograd.Function):
    """``keys`` → the same values; backward: the words' summed gradient, once."""

    @staticmethod
    def forward(
        ctx: torch.autograd.function.FunctionCtx, keys: torch.Tensor, sink: KeysGradient
    ) -> torch.Tensor:
        ctx.sink, ctx.shape, ctx.dtype = sink, keys.shape, keys.dtype
        ctx.set_materialize_grads(False)
        return keys.view_as(keys)

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, grad: torch.Tensor | None) -> tuple:
        total, ctx.sink.total = ctx.sink.total, None
        if total is None:
            return grad, None
        total = total.view(ctx.shape).to(ctx.dtype)
        return (total if grad is None else total + grad), None


def tanh_score(
    keys: torch.Tensor,
    queries: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor,
    sink: KeysGradient | None = None,
) -> torch.Tensor:
    """``w^T tanh(keys + queries) + b`` in fp32: ``keys`` (B, 1, L, A) and ``queries``
    (B, G, 1, A) → (B, G, L); ``weight`` (A,), ``bias`` (1,). With the ``sink`` of
    :func:`shared_keys`, the keys' gradient is added into it instead of returned."""
    return _TanhScore.apply(keys, queries, weight, bias, sink)


def _blocks(keys: torch.Tensor, queries: torch.Tensor) -> tuple[list[slice], torch.Tensor]:
    """The images of each block, and one fp32 buffer (b, G, L, A) that every block reuses."""
    batch, groups, cells, dim = keys.shape[0], queries.shape[1], keys.shape[2], keys.shape[3]
    step = max(1, BLOCK_ELEMENTS // (groups * cells * dim))
    buffer = keys.new_empty(min(step, batch), groups, cells, dim, dtype=torch.float32)
    return [slice(start, min(start + step, batch)) for start in range(0, batch, step)], buffer


def _sigmoid(
    keys: torch.Tensor, doubled: torch.Tensor, rows: slice, buffer: torch.Tensor
) -> torch.Tensor:
    """sigmoid(2 (k + q)) of the images ``rows``, written into ``buffer``: (b, G, L, A)."""
    block = buffer[: rows.stop - rows.start]
    torch.add(doubled[rows], keys[rows], alpha=2.0, out=block)
    return block.sigmoid_()


class _TanhScore(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: torch.autograd.function.FunctionCtx,
        keys: torch.Tensor,
        queries: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor,
        sink: KeysGradient | None,
    ) -> torch.Tensor:
        ctx.save_for_backward(keys, queries, weight)
        ctx.sink = sink
        values = keys if sink is None else sink.fp32(keys)
        if fused_score.available(values):
            return fused_score.forward(values, queries, weight, bias)
        blocks, buffer = _blocks(keys, queries)
        doubled = 2.0 * queries.float()
        w = weight.float()
        scores = keys.new_empty(keys.shape[0], *buffer.shape[1:3], dtype=torch.float32)
        with torch.autocast(keys.device.type, enabled=False):
            for rows in blocks:
                torch.matmul(_sigmoid(values, doubled, rows, buffer), 2.0 * w, out=scores[rows])
        return scores + (bias.float() - w.sum())

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, grad: torch.Tensor) -> tuple:
        keys, queries, weight = ctx.saved_tensors
        sink = ctx.sink
        values = keys if sink is None else sink.fp32(keys)
        summing = sink is not None and sink.total is not None  # add into an earlier word's
        if fused_score.available(values):
            grad_keys, grad_queries, grad_weight = fused_score.backward(
                values, queries, weight, grad, sink.total if summing else None
            )
            return _gradients(
                keys, queries, weight, grad, grad_keys, grad_queries, grad_weight, sink
            )
        dim = keys.shape[3]
        blocks, buffer = _blocks(keys, queries)
        doubled, grad = 2.0 * queries.float(), grad.float()
        four_w = 4.0 * weight.float()
        grad_keys = sink.total if summing else torch.empty_like(keys, dtype=torch.float32)
        grad_queries = torch.empty(queries.shape, dtype=torch.float32, device=keys.device)
        grad_weight = torch.zeros(dim, dtype=torch.float32, device=keys.device)
        with torch.autocast(keys.device.type, enabled=False):
            for rows in blocks:
                s = _sigmoid(values, doubled, rows, buffer)  # (b, G, L, A)
                g = grad[rows]  # (b, G, L)
                grad_weight += g.reshape(1, -1).mm(s.view(-1, dim)).view(dim)  # sum g s
                # d score / dx over 4 w: g s (1 - s), in place, in one pass
                torch.ops.aten.sigmoid_backward.grad_input(g.unsqueeze(3), s, grad_input=s)
                # 4 w is constant over the cells and the groups: applied after each sum
                torch.mul(s.sum(dim=2, keepdim=True), four_w, out=grad_queries[rows])
                summed = s if s.shape[1] == 1 else s.sum(dim=1, keepdim=True)
                if summing:
                    grad_keys[rows].addcmul_(summed, four_w)
                else:
                    torch.mul(summed, four_w, out=grad_keys[rows])
        grad_weight = 2.0 * grad_weight - grad.sum()  # sum g (2 s - 1) = sum g tanh(x)
        return _gradients(keys, queries, weight, grad, grad_keys, grad_queries, grad_weight, sink)


def _gradients(
    keys: torch.Tensor,
    queries: torch.Tensor,
    weight: torch.Tensor,
    grad: torch.Tensor,
    grad_keys: torch.Tensor,
    grad_queries: torch.Tensor,
    grad_weight: torch.Tensor,
    sink: KeysGradient | None,
) -> tuple:
    """The backward pass's return in the inputs' dtypes; with a ``sink``, the keys'
    gradient is left in it instead."""
    if sink is not None:
        sink.total, grad_keys = grad_keys, None
    return (
        None if grad_keys is None else grad_keys.to(keys.dtype),
        grad_queries.to(queries.dtype),
        grad_weight.to(weight.dtype),
        grad.sum().reshape(1).to(weight.dtype),
        None,
    )
