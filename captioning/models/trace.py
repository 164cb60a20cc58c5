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

    @staticmethod
    def cat(traces: Sequence[Trace], dim: int = 0) -> Trace:
        """The traces joined along ``dim``."""
        return AttentionTrace.combine(traces, lambda values: torch.cat(values, dim=dim))

    def __getitem__(self: Trace, index: Any) -> Trace:
        """Every field indexed alike on its leading dimensions: ``trace[i]`` one image,
        ``trace[:, :n]`` the first n words, ``trace[rows, beams]`` a gather of rows."""
        return self.map(lambda value: value[index])

    def index_select(self: Trace, dim: int, index: torch.Tensor) -> Trace:
        """Rows ``index`` along the leading dimension ``dim``."""
        return self.map(lambda value: value.index_select(dim, index))

    def unflatten(self: Trace, dim: int, sizes: Sequence[int]) -> Trace:
        """The leading dimension ``dim`` split into ``sizes``: (B*T, ...) → (B, T, ...)."""
        return self.map(lambda value: value.unflatten(dim, sizes))

    def where(self: Trace, mask: torch.Tensor, other: Trace) -> Trace:
        """Rows of this trace where ``mask`` (B,) is set, else rows of ``other``."""

        def pick(values: list[torch.Tensor]) -> torch.Tensor:
            new, old = values
            return torch.where(mask.view(-1, *[1] * (new.dim() - 1)), new, old)

        return AttentionTrace.combine([self, other], pick)

    def put(self, index: torch.Tensor, other: AttentionTrace) -> None:
        """Write ``other``'s rows into rows ``index`` of every field, in place."""
        for name in _names(type(self)):
            value = getattr(self, name)
            if value is not None:
                value[index] = getattr(other, name)

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
