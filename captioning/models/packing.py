"""Weights packed once for the CPU's matrix library while a batch decodes.

A decoding step multiplies a few rows (one per caption or beam) by every weight matrix of the
decoder. MKL, torch's matrix library on x86 CPUs, copies the weight into the panel layout its
kernels read at the start of every product; with 32 rows that copy of a 10,000-word output
layer costs about as much as the arithmetic. Inside :func:`packed_weights` (which
:func:`captioning.inference.decoding.decode` enters), the decoder's :class:`Linear` layers and
its :class:`LSTMCell` pack each weight once for the batch's row count and reuse the packed copy
at every later step with the same rows (MKL's ``cblas_sgemm_pack``, through torch's private
``mkl._mkl_linear``, the op that ``torch.compile`` uses for frozen weights). The products are
the same to fp32 rounding: the packed kernel may add a long dot product in another order.

Packing applies only where it pays and cannot change what is computed: fp32 on the CPU
without autocast or gradients, the same row count twice in a row (a product run once, such
as the grid's key projection, is left to MKL), and only while the private op is there and
agrees with ``F.linear`` on a probe. Elsewhere (training, bf16, CUDA, ARM CPUs) the layers
are torch's own. The packs live as long as the ``with`` block: nothing is kept on the model.

How MKL runs a product of a few rows depends on the CPU's maker. On AMD's CPUs packing buys
nothing (greedy decoding ran 1.09 times slower with it on an AMD EPYC), and the same product
written with the weight on the left, ``(W x^T)^T``, runs 1.12 to 1.26 times faster than
``x W^T`` at 32 rows, warm or after the caches were flushed. :func:`host_form` picks the form
for the CPU: ``transposed`` on AMD (up to :data:`TRANSPOSED_MAX_ROWS` rows, where it pays
for the copy back into rows), ``packed`` elsewhere where MKL packs, else torch's own. The
training word loop's cell uses the transposed form too (:mod:`captioning.models.deferred`).
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import nn

from captioning import runtime

# The fewest rows for which a packed weight is used: below it a product reads its weight
# once in the time the arithmetic takes, and packing buys nothing.
MIN_ROWS = 8
# The most rows for which the transposed form is used: at 160 rows (beam search's 5 beams
# of 32 images) it gains too little to pay for putting its output back into rows.
TRANSPOSED_MAX_ROWS = 64
# False: every decoding uses torch's own layers (the benchmarks time both).
ENABLED = True
FORMS = ("packed", "transposed", "plain")
# One of FORMS on every CPU; None: :func:`host_form` picks by CPU.
FORM: str | None = None
_LOCAL = threading.local()


class Packs:
    """The packed weights of one decoding: for each weight, the rows it was last called
    with, and its packed copy once a second call with those rows came."""

    def __init__(self, form: str = "packed") -> None:
        self.form = form
        self._packs: dict[int, tuple[int, int, torch.Tensor | None]] = {}

    def linear(
        self,
        inputs: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        any_layout: bool = False,
    ) -> torch.Tensor:
        """``F.linear(inputs, weight, bias)``, with ``weight`` packed for these rows when
        :func:`_eligible`, or in the transposed form (see the module docstring), whose
        output is copied into rows unless ``any_layout``."""
        rows = inputs.numel() // max(inputs.shape[-1], 1)
        if not _eligible(inputs, weight, rows):
            return F.linear(inputs, weight, bias)
        if self.form == "transposed":
            if rows > TRANSPOSED_MAX_ROWS:
                return F.linear(inputs, weight, bias)
            out = transposed_linear(inputs.reshape(rows, -1), weight, bias)
            if any_layout and inputs.dim() == 2:
                return out
            return out.contiguous().view(*inputs.shape[:-1], weight.shape[0])
        key, version = id(weight), weight._version
        last = self._packs.get(key)
        if last is None or last[:2] != (rows, version):  # first call with these rows
            self._packs[key] = (rows, version, None)
            return F.linear(inputs, weight, bias)
        packed = last[2]
        if packed is None:
            packed = torch.ops.mkl._mkl_reorder_linear_weight(weight, rows)
            self._packs[key] = (rows, version, packed)
        return torch.ops.mkl._mkl_linear(inputs, packed, weight, bias, rows)


def transposed_linear(
    inputs: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """``F.linear(inputs, weight, bias)`` for ``inputs`` (R, K), computed as ``W x^T`` (with
    the bias added to each column) and returned as its transpose: an (R, N) view whose
    columns are contiguous."""
    if bias is None:
        return torch.mm(weight, inputs.t()).t()
    return torch.addmm(bias.unsqueeze(1), weight, inputs.t()).t()


def _eligible(inputs: torch.Tensor, weight: torch.Tensor, rows: int) -> bool:
    return (
        rows >= MIN_ROWS
        and inputs.device.type == "cpu"
        and inputs.dtype == weight.dtype == torch.float32
        and not torch.is_grad_enabled()
        and not torch.is_autocast_enabled("cpu")
    )


@contextmanager
def packed_weights(enabled: bool | None = None) -> Iterator[None]:
    """Within the block, on this thread, the decoder's layers use packed weights where
    packing applies (see the module docstring); ``enabled`` False (default: :data:`ENABLED`)
    or a CPU without the packed kernel leaves them as they are."""
    previous = getattr(_LOCAL, "packs", None)
    enabled = ENABLED if enabled is None else enabled
    form = host_form()
    _LOCAL.packs = Packs(form) if enabled and form != "plain" else None
    try:
        yield
    finally:
        _LOCAL.packs = previous


def active() -> Packs | None:
    """This thread's packs inside :func:`packed_weights`, else None."""
    if torch.compiler.is_compiling():
        return None
    return getattr(_LOCAL, "packs", None)


def linear(inputs: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear``, through the packs inside :func:`packed_weights`."""
    packs = active()
    return F.linear(inputs, weight, bias) if packs is None else packs.linear(inputs, weight, bias)


class Linear(nn.Linear):
    """:class:`torch.nn.Linear` (same parameters, same state-dict keys) whose weight is
    packed inside :func:`packed_weights`."""

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        return linear(inputs, self.weight, self.bias)


class LSTMCell(nn.LSTMCell):
    """:class:`torch.nn.LSTMCell` whose two products use packed weights inside
    :func:`packed_weights`; the gate equations are then :func:`cell_update`."""

    def forward(
        self, inputs: torch.Tensor, hx: tuple[torch.Tensor, torch.Tensor] | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        packs = active()
        if packs is None or hx is None or inputs.dim() != 2 or self.bias_ih is None:
            return super().forward(inputs, hx)
        h, c = hx
        gates = packs.linear(h, self.weight_hh, self.bias_hh, any_layout=True) + packs.linear(
            inputs, self.weight_ih, self.bias_ih, any_layout=True
        )  # the gate equations read either layout
        return cell_update(gates, c)


def cell_update(gates: torch.Tensor, c: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """An LSTM cell's new (h, c) from its gates (R, 4H) (torch's order i, f, g, o) and its
    cell state (R, H): torch's CPU cell's equations, in its order."""
    i, f, g, o = gates.unsafe_chunk(4, 1)
    c = f.sigmoid() * c + i.sigmoid() * g.tanh()
    return o.sigmoid() * c.tanh(), c


def host_form() -> str:
    """How this CPU's few-row fp32 products run (see the module docstring): :data:`FORM`
    where set, else ``transposed`` on AMD with MKL, ``packed`` where the packed kernel
    works, else ``plain``."""
    if FORM is not None:
        if FORM not in FORMS:
            raise ValueError(
                f"packing.FORM must be one of {', '.join(FORMS)} or None, got {FORM!r}"
            )
        return FORM
    if torch.backends.mkl.is_available() and runtime.cpu_vendor() == "AuthenticAMD":
        return "transposed"
    return "packed" if packing_available() else "plain"


@functools.cache
def packing_available() -> bool:
    """Whether torch has the packed kernel and it gives ``F.linear``'s numbers on a probe
    (a private op may change in any release). Checked once per process."""
    mkl = getattr(torch.ops, "mkl", None)
    if not torch.backends.mkl.is_available() or mkl is None:
        return False
    generator = torch.Generator().manual_seed(0)
    inputs, weight, bias = (
        torch.randn(*shape, generator=generator) for shape in ((MIN_ROWS, 24), (40, 24), (40,))
    )
    try:
        with torch.no_grad(), torch.autocast("cpu", enabled=False):
            packed = mkl._mkl_reorder_linear_weight(weight, MIN_ROWS)
            out = mkl._mkl_linear(inputs, packed, weight, bias, MIN_ROWS)
            expected = F.linear(inputs, weight, bias)
    except (AttributeError, RuntimeError, TypeError):
        return False
    return out.shape == expected.shape and torch.allclose(out, expected)
