"""Figures of a caption's per-word record (:class:`~captioning.models.trace.AttentionTrace`) with
whatever marks its fields call for: the one place that reads those fields for drawing."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from matplotlib.figure import Figure
from PIL import Image

from captioning.errors import ConfigError

if TYPE_CHECKING:
    from captioning.models.trace import AttentionTrace
from captioning.figures.common import Style
from captioning.figures.gif import attention_gif
from captioning.figures.heads import heads_grid
from captioning.figures.heatmaps import _save_png, attention_grid

# What asking a single-head model for its heads' figure says.
SINGLE_HEAD = (
    "this model has a single attention head, so there is no per-head figure "
    "(a multi-head model is trained with --set model.heads=H, H > 1)"
)


def _trace_marks(trace: AttentionTrace) -> dict[str, Any]:
    """What a word's panel marks besides its map, from the fields ``trace`` (T, ...) holds:
    hard attention's chosen cell (outlined) and local attention's centre (a cross)."""
    return {
        "chosen_cells": None if trace.cell is None else trace.cell.tolist(),
        "centres": trace.centre,
    }


def trace_grid(
    image: Image.Image,
    words: Sequence[str],
    trace: AttentionTrace,
    grid_shape: tuple[int, int],
    smooth: bool = True,
    columns: int = 5,
    title: str | None = None,
    style: Style = "dim",
    boxes: Sequence[Sequence[Sequence[float]]] | None = None,
) -> Figure:
    """:func:`attention_grid` of a caption's per-word ``trace`` (T, ...): each word's map
    ``trace.alpha`` (T, L), marked as the trace's other fields call for (hard attention's
    chosen cell outlined, local attention's centre crossed), and each word's object
    ``boxes`` outlined. Other arguments as :func:`attention_grid`."""
    return attention_grid(
        image,
        words,
        trace.alpha,
        grid_shape,
        smooth=smooth,
        columns=columns,
        title=title,
        style=style,
        boxes=boxes,
        **_trace_marks(trace),
    )


def trace_figure(
    image: Image.Image,
    words: Sequence[str],
    trace: AttentionTrace,
    grid_shape: tuple[int, int],
    path: str | Path,
    smooth: bool = True,
    columns: int = 5,
    title: str | None = None,
    style: Style = "dim",
    boxes: Sequence[Sequence[Sequence[float]]] | None = None,
) -> Path:
    """Write :func:`trace_grid` as a PNG at ``path`` (missing parent folders are created)
    and return ``path``."""
    fig = trace_grid(image, words, trace, grid_shape, smooth, columns, title, style, boxes)
    return _save_png(fig, path)


def trace_gif(
    image: Image.Image,
    words: Sequence[str],
    trace: AttentionTrace,
    grid_shape: tuple[int, int],
    path: str | Path,
    smooth: bool = True,
    frame_ms: int = 800,
    style: Style = "dim",
) -> Path:
    """:func:`attention_gif` of a caption's per-word ``trace``, marked as
    :func:`trace_grid` marks it."""
    return attention_gif(
        image,
        words,
        trace.alpha,
        grid_shape,
        path,
        smooth=smooth,
        frame_ms=frame_ms,
        style=style,
        **_trace_marks(trace),
    )


def trace_heads_grid(
    image: Image.Image,
    words: Sequence[str],
    trace: AttentionTrace,
    grid_shape: tuple[int, int],
    smooth: bool = True,
    title: str | None = None,
    style: Style = "dim",
) -> Figure:
    """:func:`heads_grid` of a multi-head model's per-word ``trace``.

    Raises:
        ConfigError: the trace has no heads' maps (a single-head model)."""
    if trace.heads is None:
        raise ConfigError(SINGLE_HEAD)
    return heads_grid(image, words, trace.heads, grid_shape, smooth, title, style)


def trace_heads_figure(
    image: Image.Image,
    words: Sequence[str],
    trace: AttentionTrace,
    grid_shape: tuple[int, int],
    path: str | Path,
    smooth: bool = True,
    title: str | None = None,
    style: Style = "dim",
) -> Path:
    """Write :func:`trace_heads_grid` as a PNG at ``path`` and return ``path``.

    Raises:
        ConfigError: the trace has no heads' maps (a single-head model)."""
    fig = trace_heads_grid(image, words, trace, grid_shape, smooth, title, style)
    return _save_png(fig, path)
