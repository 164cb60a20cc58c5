"""The additive score ``w^T tanh(k_i + q) + b`` and its gradients as one C kernel on the CPU
(``additive_score.c``, built by :mod:`captioning.native`).

torch runs the score as separate passes over the (B, G, L, A) hidden layer: the add, the
activation, the projection, and in the backward pass as many again. Even in cache-sized
blocks (:mod:`captioning.models.tanh_score`, the blocked decoding in
:class:`captioning.models.scores.AdditiveScore`) each pass reads and writes the block, and
between a training step's words the keys leave the cache. The kernel reads each row of keys
once and keeps the hidden values in registers: the forward pass computes the scores, the
backward pass every gradient, each in one pass. Where the kernel cannot be built, or
:data:`ENABLED` is False, :func:`available` says so and the callers run their torch forms;
tests check both against autograd.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from captioning import native

SOURCE = Path(__file__).with_name("additive_score.c")
# False: the torch forms everywhere (the benchmarks time both).
ENABLED = True
# The kernel keeps a few rows of A fp32 values per thread; wider keys run the torch forms.
MAX_DIM = 1 << 16

_KEY_TYPES = (torch.float32, torch.bfloat16)


@functools.cache
def _library() -> ctypes.CDLL | None:
    library = native.load(SOURCE)
    if library is None:
        return None
    p, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    library.additive_score_forward.argtypes = [p, i32, p, p, ctypes.c_float, p, *[i64] * 4, i32]
    library.additive_score_forward.restype = None
    library.additive_score_backward.argtypes = [p, i32, p, p, p, p, i32, p, p, *[i64] * 4, i32]
    library.additive_score_backward.restype = None
    return library


def available(keys: torch.Tensor) -> bool:
    """Whether the kernel scores ``keys`` (B, L, A) or (B, 1, L, A): on the CPU, contiguous,
    fp32 or bf16, and built on this machine."""
    return (
        ENABLED
        and keys.device.type == "cpu"
        and keys.dtype in _KEY_TYPES
        and keys.is_contiguous()
        and 0 < keys.shape[-1] <= MAX_DIM
        and _library() is not None
    )


def _pointer(tensor: torch.Tensor) -> ctypes.c_void_p:
    return ctypes.c_void_p(tensor.data_ptr())


def _sizes(keys: torch.Tensor, queries: torch.Tensor) -> tuple[int, int, int, int]:
    batch, cells, dim = keys.shape[0], keys.shape[-2], keys.shape[-1]
    if queries.numel() % (batch * dim):
        raise ValueError(f"queries {tuple(queries.shape)} do not match keys {tuple(keys.shape)}")
    return batch, queries.numel() // (batch * dim), cells, dim


def forward(
    keys: torch.Tensor, queries: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor
) -> torch.Tensor:
    """Scores (B, G, L) in fp32 of ``keys`` (B, L, A) or (B, 1, L, A) against ``queries``
    (B, G, A) or (B, G, 1, A); ``weight`` (A,), ``bias`` (1,). Needs :func:`available`."""
    batch, groups, cells, dim = _sizes(keys, queries)
    queries, weight = queries.float().contiguous(), weight.float().contiguous()
    scores = torch.empty(batch, groups, cells, dtype=torch.float32)
    _library().additive_score_forward(
        _pointer(keys),
        int(keys.dtype == torch.bfloat16),
        _pointer(queries),
        _pointer(weight),
        float(bias.detach()),
        _pointer(scores),
        batch,
        groups,
        cells,
        dim,
        torch.get_num_threads(),
    )
    return scores


def backward(
    keys: torch.Tensor,
    queries: torch.Tensor,
    weight: torch.Tensor,
    grad: torch.Tensor,
    grad_keys: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The gradients (keys, queries, weight) in fp32 of the scores' ``grad`` (B, G, L), for
    the arguments of :func:`forward`; the keys' gradient has the keys' shape, the queries'
    the queries'. Given ``grad_keys`` (fp32, contiguous), the keys' gradient is added into
    it, and it is returned."""
    batch, groups, cells, dim = _sizes(keys, queries)
    queries, weight = queries.float().contiguous(), weight.float().contiguous()
    grad = grad.float().contiguous()
    accumulate = grad_keys is not None
    if grad_keys is None:
        grad_keys = torch.empty(keys.shape, dtype=torch.float32)
    elif not (
        grad_keys.dtype == torch.float32
        and grad_keys.is_contiguous()
        and grad_keys.numel() == keys.numel()
    ):
        raise ValueError(f"grad_keys must be a contiguous fp32 tensor of {keys.numel()} values")
    grad_queries = torch.empty(queries.shape, dtype=torch.float32)
    grad_weight = torch.empty(dim, dtype=torch.float32)
    _library().additive_score_backward(
        _pointer(keys),
        int(keys.dtype == torch.bfloat16),
        _pointer(queries),
        _pointer(weight),
        _pointer(grad),
        _pointer(grad_keys),
        int(accumulate),
        _pointer(grad_queries),
        _pointer(grad_weight),
        batch,
        groups,
        cells,
        dim,
        torch.get_num_threads(),
    )
    return grad_keys, grad_queries, grad_weight
