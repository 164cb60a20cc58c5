"""The per-word attention record: what an attention module reports about each word.

An attention module fills one :class:`AttentionTrace` per step, one row per query: the
weights ``alpha`` and, from the kinds that have them, the chosen cell, each head's weights
or the predicted centre. The decoder stacks the steps, decoding reorders and selects rows,
results keep one image's words, and the JSON writes every field, all through the operations
below, without naming a field. A new field is declared here, filled by the module that
computes it and drawn by the code that shows it (``viz.py``, ``serve/page.html``); nothing
in between changes.

Each field's metadata says how results show it: ``name``, its key in the JSON and its
attribute on a caption (default: the field's own name), and ``grid``, whether its last
dimension runs over the L cells (then results show it as rows x cols maps). Integer fields
come out as lists, floating ones as tensors (in the JSON, numbers rounded; NaN is null).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, fields
from functools import cache
from typing import Any, TypeVar

import numpy as np
import torch

Trace = TypeVar("Trace", bound="AttentionTrace")


@dataclass(frozen=True, eq=False)
class AttentionTrace:
    """Per-word attention, one row per query (or (B, T, ...) once steps are stacked).

    Every tensor has the same leading dimensions; fields a model does not report are None.
    Subclasses may add fields (of the same leading dimensions); every operation keeps them.

    Attributes:
        alpha: (N, L) the attention weights, a distribution over the L cells.
        cell: (N,) the cell hard attention chose, else None.
        heads: (N, H, L) each head's weights (multi-head attention; ``alpha`` is their
            mean), else None.
        centre: (N, 2) local attention's predicted centre (row, column, in cells; cell
            centres lie at index + 0.5), else None.
    """

    alpha: torch.Tensor = field(metadata={"name": "attention", "grid": True})
    cell: torch.Tensor | None = field(default=None, metadata={"name": "cells"})
    heads: torch.Tensor | None = field(default=None, metadata={"grid": True})
    centre: torch.Tensor | None = field(default=None, metadata={"name": "centres"})

    # ------------------------------------------------------------------ tensor operations

    def map(self: Trace, fn: Callable[[torch.Tensor], torch.Tensor]) -> Trace:
        """``fn`` applied to every field that is present (absent ones stay None)."""
        values = {}
        for name in _names(type(self)):
            value = getattr(self, name)
            values[name] = None if value is None else fn(value)
        return type(self)(**values)

    @staticmethod
    def combine(traces: Sequence[Trace], fn: Callable[[list[torch.Tensor]], torch.Tensor]) -> Trace:
        """One trace from several of one kind: ``fn`` of each field's tensors, in order."""
        first = traces[0]
        values = {}
        for name in _names(type(first)):
            values[name] = (
                None if getattr(first, name) is None else fn([getattr(t, name) for t in traces])
            )
        return type(first)(**values)

    @staticmethod
    def stack(traces: Sequence[Trace], dim: int = 0) -> Trace:
        """The steps' traces side by side: T traces (B, ...) → (B, T, ...) with ``dim=1``."""
        return AttentionTrace.combine(traces, lambda values: torch.stack(values, dim=dim))

    def __getitem__(self: Trace, index: Any) -> Trace:
        """Every field indexed alike on its leading dimensions: ``trace[i]`` one image,
        ``trace[:, :n]`` the first n words, ``trace[rows, beams]`` a gather of rows."""
        return self.map(lambda value: value[index])

    def unflatten(self: Trace, dim: int, sizes: Sequence[int]) -> Trace:
        """The leading dimension ``dim`` split into ``sizes``: (B*T, ...) → (B, T, ...)."""
        return self.map(lambda value: value.unflatten(dim, sizes))

    def portable(self: Trace) -> Trace:
        """On the CPU, floating fields in fp32 (whatever precision decoded them)."""
        return self.map(lambda value: (value.float() if value.is_floating_point() else value).cpu())

    # ------------------------------------------------------------------ results

    @classmethod
    def public_names(cls) -> tuple[str, ...]:
        """Every field's public name (its JSON key and its attribute on a caption)."""
        return tuple(_public(item)[0] for item in fields(cls))

    def shown(self, name: str, grid: tuple[int, int] | None) -> Any:
        """The field of public ``name`` as a caption shows it: a map over the cells as
        (..., rows, cols) (kept flat without a ``grid``), integers as (nested) lists, None
        when absent.

        Raises:
            AttributeError: no field has that public name."""
        for item in fields(self):
            public, on_grid = _public(item)
            if public == name:
                return _shown(getattr(self, item.name), on_grid, grid)
        raise AttributeError(name)

    def to_json(
        self, grid: tuple[int, int], decimals: int = 4, optional_only: bool = False
    ) -> dict[str, Any]:
        """Plain JSON data, one entry per field under its public name (null when absent):
        maps over the cells as rows x cols, numbers rounded to ``decimals`` (a diverged
        model's NaN is null), integers as they are. ``optional_only`` leaves out ``alpha``,
        the one field every model reports."""
        data = {}
        for item in fields(self):
            if optional_only and item.name == "alpha":
                continue
            public, on_grid = _public(item)
            value = _shown(getattr(self, item.name), on_grid, grid)
            if isinstance(value, torch.Tensor):
                value = json_numbers(value, decimals)
            data[public] = value
        return data


@dataclass(frozen=True)
class TraceLayout:
    """Where the fields of one kind of trace lie side by side in W values per row, so that
    code that moves rows around (beam search: parents, finished captions, answers) moves one
    tensor whatever the model records: the plain map (W = L) costs nothing more.

    Values are kept in ``alpha``'s dtype (integers exactly, up to 2**24 in fp32) and come
    back in their own.

    Attributes:
        kind: the trace's class.
        parts: each present field's name, the shape of one row's values, and its dtype.
    """

    kind: type[AttentionTrace]
    parts: tuple[tuple[str, tuple[int, ...], torch.dtype], ...]

    @classmethod
    def of(cls, trace: AttentionTrace) -> TraceLayout:
        """The layout of ``trace``'s rows (N, ...)."""
        parts = []
        for name in _names(type(trace)):
            value = getattr(trace, name)
            if value is not None:
                parts.append((name, tuple(value.shape[1:]), value.dtype))
        return cls(type(trace), tuple(parts))

    @property
    def width(self) -> int:
        """W, the values per row."""
        return sum(math.prod(shape) for _, shape, _ in self.parts)

    def pack(self, trace: AttentionTrace) -> torch.Tensor:
        """One step's rows side by side: (N, W); ``alpha`` itself when it is all there is."""
        if len(self.parts) == 1:
            return trace.alpha
        rows, dtype = trace.alpha.shape[0], trace.alpha.dtype
        return torch.cat(
            [getattr(trace, name).reshape(rows, -1).to(dtype) for name, _, _ in self.parts], dim=1
        )

    def unpack(self, packed: torch.Tensor) -> AttentionTrace:
        """Rows packed as (..., W) → the trace, fields (..., *shape) in their own dtypes."""
        values, start = {}, 0
        for name, shape, dtype in self.parts:
            size = math.prod(shape)
            part = packed[..., start : start + size]  # (..., size)
            values[name] = part.reshape(*packed.shape[:-1], *shape).to(dtype)
            start += size
        return self.kind(**values)


@cache
def _names(kind: type[AttentionTrace]) -> tuple[str, ...]:
    return tuple(item.name for item in fields(kind))


def _public(item: Any) -> tuple[str, bool]:
    """A field's public name and whether its last dimension runs over the cells."""
    return item.metadata.get("name", item.name), bool(item.metadata.get("grid", False))


def _shown(value: torch.Tensor | None, on_grid: bool, grid: tuple[int, int] | None) -> Any:
    if value is None:
        return None
    if not value.is_floating_point():
        return value.tolist()
    if on_grid and grid is not None:
        return value.unflatten(-1, grid)  # (..., rows, cols)
    return value


def json_numbers(values: torch.Tensor, decimals: int) -> list:
    """Nested lists of ``values`` rounded to ``decimals``; a diverged model's NaN is no JSON
    number: it becomes null."""
    rounded = np.round(values.detach().float().cpu().numpy().astype(np.float64), decimals)
    return np.where(np.isfinite(rounded), rounded, None).tolist()
