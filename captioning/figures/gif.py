"""A caption as an animated GIF: one frame per word, its map over the photo."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from PIL import Image

from captioning.files import open_unlinked

if TYPE_CHECKING:
    pass
from captioning.figures.common import (
    _DPI,
    _GIF_MAX_SIDE,
    _GIF_MIN_SIDE,
    Scale,
    Style,
    _check_caption,
    _check_centres,
    _check_grid,
    _fit,
)
from captioning.figures.maps import (
    _STYLES,
    _cell_rectangle,
    _check_scale,
    _check_style,
    _heats,
    _mark_centre,
    _peak_label,
    _text,
)


def _gif_frame(
    pixels: np.ndarray,
    shaded: np.ndarray,
    word: str,
    counter: str,
    note: str,
    cell: int | None,
    grid_shape: tuple[int, int],
    centre: np.ndarray | None = None,
) -> Image.Image:
    """One animation frame, rendered at exactly the pixel size of ``pixels``: the word's
    map (``shaded``, already drawn over the image) with the word, ``t/T`` and the note."""
    height, width = pixels.shape[:2]
    fig = Figure(figsize=(width / _DPI, height / _DPI), dpi=_DPI)
    canvas = FigureCanvasAgg(fig)
    try:
        ax = fig.add_axes((0.0, 0.0, 1.0, 1.0))
        ax.set_axis_off()
        ax.imshow(shaded, interpolation="none", aspect="auto")
        ax.set_xlim(-0.5, width - 0.5)
        ax.set_ylim(height - 0.5, -0.5)
        if cell is not None:
            ax.add_patch(_cell_rectangle(cell, grid_shape, width, height, 2.5))
        if centre is not None:
            _mark_centre(ax, centre, grid_shape, width, height, 0.05 * height * 72 / _DPI)
        # Sized from the frame so a word reads the same at any image size, and the small
        # notes fit across a portrait frame.
        points = 0.075 * height * 72 / _DPI
        small = min(points * 0.5, 0.028 * width * 72 / _DPI)
        box = {"facecolor": "black", "alpha": 0.65, "edgecolor": "none", "pad": 3}
        common = dict(transform=ax.transAxes, color="white", bbox=box, parse_math=False)
        ax.text(0.5, 0.04, _text(word), ha="center", va="bottom", fontsize=points, **common)
        # The counter also keeps consecutive frames distinct: Pillow merges identical frames,
        # which would drop a frame for a word repeated with the same attention.
        ax.text(0.98, 0.97, counter, ha="right", va="top", fontsize=points * 0.6, **common)
        ax.text(0.02, 0.97, note, ha="left", va="top", fontsize=small, **common)
        canvas.draw()
        rgba = np.asarray(canvas.buffer_rgba())
        return Image.fromarray(rgba[:, :, :3].copy(), mode="RGB")
    finally:
        fig.clear()


def attention_gif(
    image: Image.Image,
    words: Sequence[str],
    alphas: torch.Tensor | np.ndarray,
    grid_shape: tuple[int, int],
    path: str | Path,
    smooth: bool = True,
    chosen_cells: Sequence[int] | None = None,
    frame_ms: int = 800,
    centres: torch.Tensor | np.ndarray | None = None,
    style: Style = "dim",
    scale: Scale = "caption",
) -> Path:
    """Write an animated GIF that shows each word over its attention, one frame per word.

    Frames are the whole image (rescaled so its longer side is between 320 and 640 pixels)
    with the word's attention drawn over it as in :func:`attention_grid_figure`, the word
    written at the bottom, ``t/T`` in a corner and a note on the scale in the other
    (``bright = attended, peak 7.3x even``), every frame on one brightness scale unless
    ``scale="word"``. The animation loops forever.

    Args:
        image: the captioned image, any size and mode.
        words: the caption's tokens, in order; at least one.
        alphas: ``(T, L)`` or ``(T, grid_h, grid_w)`` weights with ``T = len(words)``;
            ``alphas[t]`` is the attention used to produce ``words[t]``.
        grid_shape: ``(grid_h, grid_w)``, the encoder's feature-map shape.
        path: where to write the GIF; missing parent folders are created.
        smooth: smooth maps if True, blocky per-cell maps if False.
        chosen_cells: for hard attention, each word's chosen cell, outlined in its frame.
        frame_ms: how long each frame is shown, in milliseconds.
        centres: for local attention, ``(T, 2)`` each word's centre (row, column), a cross.
        style: ``"dim"`` or ``"colour"``, as in :func:`attention_grid`.

    Returns:
        ``path`` as a :class:`Path`.

    Raises:
        ValueError: no words, ``words``, ``alphas`` and ``chosen_cells`` disagree in length,
            a row of ``alphas`` does not match ``grid_shape``, a chosen cell is outside the grid,
            ``frame_ms`` is not positive or ``style`` is unknown.
    """
    words, maps, cells = _check_caption(words, alphas, grid_shape, chosen_cells)
    centres = _check_centres(centres, len(words))
    grid_shape = _check_grid(grid_shape)
    style, scale = _check_style(style), _check_scale(scale)
    if not words:
        raise ValueError("attention_gif needs at least one word: a GIF cannot have no frames")
    if frame_ms <= 0:
        raise ValueError(f"frame_ms must be positive, got {frame_ms}")
    shown = _fit(image, _GIF_MIN_SIDE, _GIF_MAX_SIDE)
    pixels = np.asarray(shown)
    meaning = "bright = attended" if style == "dim" else "colour = attention"
    heats, peak = _heats(maps, grid_shape, shown.size, smooth, scale)
    frames = [
        _gif_frame(
            pixels,
            _STYLES[style](pixels, heats[t], peak=peak),
            words[t],
            f"{t + 1}/{len(words)}",
            f"{meaning}, peak {_peak_label(maps[t])}",
            None if cells is None else cells[t],
            grid_shape,
            None if centres is None else centres[t],
        )
        for t in range(len(words))
    ]
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open_unlinked(path) as handle:
        frames[0].save(
            handle,
            format="GIF",
            save_all=True,
            append_images=frames[1:],
            duration=int(frame_ms),
            loop=0,
        )
    return path
