"""Multi-head attention's figures: one row of panels per head, a column per word (and the
heads' mean), each head's map over the photo."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from PIL import Image

if TYPE_CHECKING:
    pass
from captioning.figures.common import (
    _DPI,
    _MAX_DISPLAY_SIDE,
    Scale,
    Style,
    _as_numpy,
    _attention_map,
    _check_grid,
    _fit,
)
from captioning.figures.heatmaps import _draw_legend, _draw_map, _PanelLayout, _save_png
from captioning.figures.maps import (
    _blank_axes,
    _check_scale,
    _check_style,
    _heats,
    _peak_label,
    _text,
)


def heads_figure(
    image: Image.Image,
    words: Sequence[str],
    heads: torch.Tensor | np.ndarray,
    grid_shape: tuple[int, int],
    path: str | Path,
    smooth: bool = True,
    title: str | None = None,
    style: Style = "dim",
    scale: Scale = "caption",
) -> Path:
    """Write :func:`heads_grid` (one row of per-word panels per head, and their mean) as a
    PNG at ``path`` (missing parent folders are created).

    Returns:
        ``path`` as a :class:`Path`.
    """
    fig = heads_grid(image, words, heads, grid_shape, smooth, title, style, scale)
    return _save_png(fig, path)


def heads_grid(
    image: Image.Image,
    words: Sequence[str],
    heads: torch.Tensor | np.ndarray,
    grid_shape: tuple[int, int],
    smooth: bool = True,
    title: str | None = None,
    style: Style = "dim",
    scale: Scale = "caption",
) -> Figure:
    """A figure of where each head of a multi-head model looked for each word: one row per
    head, then a row of their mean (the map the other figures show), one column per word.
    Each panel is drawn as in :func:`attention_grid` (``scale="caption"``: every panel on
    one scale) and labelled below with its largest weight as a multiple of an even map's; a
    scale under the panels says what brightness means.

    Args:
        image: the captioned image, any size and mode.
        words: the caption's tokens, in order.
        heads: ``(T, H, L)`` or ``(T, H, grid_h, grid_w)`` weights with ``T = len(words)``;
            ``heads[t, h]`` is head ``h``'s attention for ``words[t]``.
        grid_shape: ``(grid_h, grid_w)``, the encoder's feature-map shape.
        smooth: smooth maps if True, blocky per-cell maps if False.
        title: the heading instead of the caption.
        style: ``"dim"`` or ``"colour"``, as in :func:`attention_grid`.

    Returns:
        A matplotlib :class:`~matplotlib.figure.Figure` with an Agg canvas.

    Raises:
        ValueError: no words, ``heads`` is not one (H, ...) stack per word, a map does
            not match ``grid_shape``, or ``style`` is unknown.
    """
    grid_shape = _check_grid(grid_shape)
    style, scale = _check_style(style), _check_scale(scale)
    words = [str(word) for word in words]
    rows = _head_rows(words, _as_numpy(heads, "heads"), grid_shape)
    labels = [f"head {h + 1}" for h in range(len(rows) - 1)] + ["mean"]

    shown = _fit(image, 1, _MAX_DISPLAY_SIDE)
    width, height = shown.size
    pixels = np.asarray(shown)
    heats, peak = _heats(
        [a for maps in rows for a in maps], grid_shape, (width, height), smooth, scale
    )
    heading = title if title is not None else " ".join(words)
    layout = _heads_layout(len(rows), len(words), width, height, heading)
    fig = Figure(figsize=(layout.fig_w, layout.fig_h), dpi=_DPI)
    FigureCanvasAgg(fig)
    gs = layout.gridspec(fig)
    panels = iter(heats)
    for r, (label, maps) in enumerate(zip(labels, rows)):
        for t, alpha in enumerate(maps):
            ax = fig.add_subplot(gs[r, t])
            _blank_axes(ax)
            _draw_map(ax, pixels, next(panels), style, peak)
            _label_panel(ax, words[t] if r == 0 else None, label if t == 0 else None, alpha)
    fig.text(
        0.5,
        1 - 0.06 / layout.fig_h,
        layout.heading,
        ha="center",
        va="top",
        fontsize=10,
        parse_math=False,
    )
    _draw_legend(fig, layout, style, grid_shape[0] * grid_shape[1], scale=scale)
    return fig


def _heads_layout(rows: int, words: int, width: int, height: int, heading: str) -> _PanelLayout:
    """The panels of :func:`heads_grid`: row labels on the left, word titles above, each
    panel's peak in the gap below it."""
    layout = _PanelLayout.make(
        rows * words, words, width, height, heading, panel_inches=1.6, heading_panels=words
    )
    return replace(
        layout,
        margin=0.5,
        top=layout.top + 0.2,
        gap_h=layout.gap_h + 0.12,
        bottom=layout.bottom + 0.14,
    )


def _label_panel(ax: Any, word: str | None, row: str | None, alpha: np.ndarray) -> None:
    """A panel of :func:`heads_grid`: its word above (top row), its row's name at the left
    (first column), its peak below."""
    if word is not None:
        ax.set_title(_text(word), fontsize=10, parse_math=False)
    if row is not None:
        ax.set_ylabel(row, fontsize=10)
    ax.set_xlabel(_peak_label(alpha), fontsize=8, labelpad=2)


def _head_rows(
    words: list[str], array: np.ndarray, grid_shape: tuple[int, int]
) -> list[list[np.ndarray]]:
    """The rows of :func:`heads_grid`: each head's map for every word, then their mean."""
    if not words:
        raise ValueError("heads_grid needs at least one word")
    if array.ndim not in (3, 4) or len(array) != len(words):
        raise ValueError(
            f"heads must be (T, H, L) or (T, H, grid_h, grid_w) with T = "
            f"{len(words)} words; got shape {tuple(array.shape)}"
        )
    rows = [
        [_attention_map(array[t, h], grid_shape, f"heads[{t}, {h}]") for t in range(len(words))]
        for h in range(array.shape[1])
    ]
    rows.append([np.mean([row[t] for row in rows], axis=0) for t in range(len(words))])
    return rows
