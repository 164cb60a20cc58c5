"""Per-word attention figures: where the decoder looked for each word of a caption.

Everything renders through matplotlib's object API onto an Agg canvas and never imports
``matplotlib.pyplot``: pyplot keeps a global figure registry and may pick an interactive
backend, which breaks on headless machines and is not thread-safe. A :class:`Figure` with its
own :class:`FigureCanvasAgg` is plain data, so these functions can run in worker threads
and need no display.

Attention weights come as one row per word over ``L = grid_h * grid_w`` encoder cells,
flattened row-major: cell ``(r, c)`` is index ``r * grid_w + c``. The grid shape is always an
argument, since it depends on the encoder and its input size. Local attention's centres come
as (row, column) in cells, cell ``(r, c)`` spanning ``[r, r + 1) x [c, c + 1)``; they are
drawn as a cross. A multi-head model's heads get a figure of their own, one row per head.
"""

from __future__ import annotations

import textwrap
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import matplotlib
import numpy as np
import torch
import torch.nn.functional as F
from matplotlib import patheffects
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.colors import Colormap
from matplotlib.figure import Figure
from matplotlib.patches import Rectangle
from PIL import Image

__all__ = [
    "attention_gif",
    "attention_grid_figure",
    "centre_position",
    "heads_figure",
    "heads_grid",
    "overlay_array",
    "upsample_attention",
]

# Inches per panel side; with the default 100 dpi a panel's longer side is 240 pixels.
_PANEL_INCHES = 2.4
_DPI = 100
# Beyond this many pixels on its longer side an image is shrunk before compositing: the
# panels are far smaller anyway, and a full-resolution float heat map costs memory.
_MAX_DISPLAY_SIDE = 1024
# GIF frames are scaled so the longer side falls in this range, so a 96 px image still has
# room for a legible word and a photo does not make a huge file.
_GIF_MIN_SIDE = 320
_GIF_MAX_SIDE = 640
_BOX_COLOUR = "white"


# --- inputs ---------------------------------------------------------------------------------


def _as_numpy(values: torch.Tensor | np.ndarray | Sequence, what: str) -> np.ndarray:
    """Float64 copy of a tensor (any device or dtype, with or without grad) or array-like."""
    if isinstance(values, torch.Tensor):
        array = values.detach().to("cpu", torch.float64).numpy()
    elif isinstance(values, (list, tuple)) and values and isinstance(values[0], torch.Tensor):
        array = torch.stack([v.detach().to("cpu", torch.float64) for v in values]).numpy()
    else:
        array = np.asarray(values, dtype=np.float64)
    if not np.all(np.isfinite(array)):
        raise ValueError(f"{what} contain NaN or infinite values")
    return array


def _check_grid(grid_shape: tuple[int, int]) -> tuple[int, int]:
    if len(grid_shape) != 2 or any(int(n) != n or n < 1 for n in grid_shape):
        raise ValueError(
            f"grid_shape must be (grid_h, grid_w), positive integers; got {grid_shape!r}"
        )
    return int(grid_shape[0]), int(grid_shape[1])


def _check_size(size: tuple[int, int]) -> tuple[int, int]:
    if len(size) != 2 or any(int(n) != n or n < 1 for n in size):
        raise ValueError(f"size must be (width, height) with positive integers, got {size!r}")
    return int(size[0]), int(size[1])


def _attention_map(alpha: np.ndarray, grid_shape: tuple[int, int], what: str) -> np.ndarray:
    """One word's weights as a (grid_h, grid_w) array, whether given flat or 2-D."""
    grid_h, grid_w = grid_shape
    if alpha.ndim == 1:
        if alpha.size != grid_h * grid_w:
            raise ValueError(
                f"{what} has {alpha.size} weights but grid {grid_h}x{grid_w} "
                f"needs L = {grid_h * grid_w}"
            )
        return alpha.reshape(grid_h, grid_w)
    if alpha.shape != (grid_h, grid_w):
        raise ValueError(
            f"{what} has shape {tuple(alpha.shape)}; expected ({grid_h * grid_w},) "
            f"or ({grid_h}, {grid_w}) for grid {grid_h}x{grid_w}"
        )
    return alpha


def _check_centres(
    centres: torch.Tensor | np.ndarray | Sequence | None, n_words: int
) -> np.ndarray | None:
    """Local attention's centres as a (T, 2) array of (row, column), or None."""
    if centres is None:
        return None
    array = _as_numpy(centres, "centres")
    if array.shape != (n_words, 2):
        raise ValueError(f"centres must be (row, column) per word, shape ({n_words}, 2); "
                         f"got shape {tuple(array.shape)}")  # fmt: skip
    return array


def _check_caption(
    words: Sequence[str],
    alphas: torch.Tensor | np.ndarray,
    grid_shape: tuple[int, int],
    chosen_cells: Sequence[int] | None,
) -> tuple[list[str], list[np.ndarray], list[int] | None]:
    """Validate one caption's words, per-word weights and optional hard-attention cells."""
    grid_shape = _check_grid(grid_shape)
    words = [str(word) for word in words]
    array = _as_numpy(alphas, "alphas")
    if array.ndim not in (2, 3):
        raise ValueError(
            f"alphas must have one row per word, shape (T, L) or (T, grid_h, grid_w); "
            f"got shape {tuple(array.shape)}"
        )
    if len(array) != len(words):
        raise ValueError(
            f"got {len(words)} words but {len(array)} attention rows; "
            "alphas[t] must be the attention for words[t]"
        )
    maps = [_attention_map(row, grid_shape, f"alphas[{t}]") for t, row in enumerate(array)]
    cells = None
    if chosen_cells is not None:
        cells = [int(cell) for cell in chosen_cells]
        if len(cells) != len(words):
            raise ValueError(f"got {len(words)} words but {len(cells)} chosen_cells")
        n_cells = grid_shape[0] * grid_shape[1]
        bad = [cell for cell in cells if not 0 <= cell < n_cells]
        if bad:
            raise ValueError(
                f"chosen_cells must be cell indices in [0, {n_cells}) for grid "
                f"{grid_shape[0]}x{grid_shape[1]}; got {bad}"
            )
    return words, maps, cells


def _rgb(image: Image.Image | np.ndarray) -> np.ndarray:
    """uint8 (H, W, 3) pixels of a PIL image of any mode, or of an RGB / grey array."""
    if isinstance(image, Image.Image):
        return np.asarray(image.convert("RGB"), dtype=np.uint8)
    array = np.asarray(image)
    if array.ndim == 2:
        array = np.repeat(array[:, :, None], 3, axis=2)
    if array.ndim != 3 or array.shape[2] not in (3, 4):
        raise ValueError(f"image must be (H, W), (H, W, 3) or (H, W, 4); got {array.shape}")
    array = array[:, :, :3]
    if array.dtype != np.uint8:
        # Float images follow matplotlib's convention of values in [0, 1].
        scale = 255.0 if np.issubdtype(array.dtype, np.floating) else 1.0
        array = np.clip(np.rint(array * scale), 0, 255).astype(np.uint8)
    return array


def _fit(image: Image.Image, min_side: int, max_side: int) -> Image.Image:
    """``image`` as RGB, rescaled (aspect kept) so its longer side is in [min_side, max_side]."""
    image = image.convert("RGB")
    longer = max(image.size)
    target = min(max(longer, min_side), max_side)
    if target == longer:
        return image
    scale = target / longer
    size = (max(1, round(image.width * scale)), max(1, round(image.height * scale)))
    return image.resize(size, Image.Resampling.BICUBIC)


# --- maps -----------------------------------------------------------------------------------


def upsample_attention(
    alpha: torch.Tensor | np.ndarray,
    grid_shape: tuple[int, int],
    size: tuple[int, int],
    smooth: bool = True,
) -> np.ndarray:
    """Stretch one word's attention over the grid to an image-sized map.

    Args:
        alpha: the word's weights, either flat with ``L = grid_h * grid_w`` entries in
            row-major order (cell ``(r, c)`` at index ``r * grid_w + c``) or already shaped
            ``(grid_h, grid_w)``. A tensor may be on any device and require grad.
        grid_shape: ``(grid_h, grid_w)``, the encoder's feature-map shape.
        size: the output size as ``(width, height)``, the order PIL's ``Image.size`` uses.
        smooth: True for bilinear interpolation between cell centres (the usual soft look);
            False for nearest, where each cell covers exactly its own block of the image
            (every pixel takes the cell its centre falls in), which shows the real
            resolution of the attention and suits hard attention.

    Returns:
        A float64 array of shape ``(height, width)``, non-negative. The total mass is not
        preserved: values are the interpolated weights themselves.

    Raises:
        ValueError: the weights do not match ``grid_shape``, contain NaN or inf, or
            ``grid_shape`` or ``size`` are not pairs of positive integers.
    """
    grid_shape = _check_grid(grid_shape)
    width, height = _check_size(size)
    cells = _attention_map(_as_numpy(alpha, "alpha"), grid_shape, "alpha")
    if smooth:
        # align_corners=False treats each weight as the value at its cell's centre, so the
        # map lines up with the nearest-mode blocks instead of shifting by half a cell.
        # Bilinear only takes convex combinations, but weights from a model may dip a hair
        # below zero (e.g. after a subtraction), and a colormap would misread them.
        grid_tensor = torch.from_numpy(np.ascontiguousarray(cells))[None, None]
        heat = F.interpolate(
            grid_tensor, size=(height, width), mode="bilinear", align_corners=False
        )
        return np.clip(heat[0, 0].numpy(), 0.0, None)
    # Explicit index maps rather than interpolate(mode="nearest"): with sizes that are not a
    # multiple of the grid, the pixel-centre rule keeps the blocks where a cell rectangle
    # drawn at c * width / grid_w would put them.
    grid_h, grid_w = grid_shape
    rows = np.minimum(((np.arange(height) + 0.5) * grid_h / height).astype(int), grid_h - 1)
    cols = np.minimum(((np.arange(width) + 0.5) * grid_w / width).astype(int), grid_w - 1)
    return np.clip(cells[rows[:, None], cols[None, :]], 0.0, None)


def overlay_array(
    image: Image.Image | np.ndarray,
    heat: np.ndarray,
    cmap: str | Colormap = "jet",
    opacity: float = 0.6,
) -> np.ndarray:
    """Blend a colour-mapped heat map over an image.

    Args:
        image: a PIL image of any mode, or an ``(H, W)`` / ``(H, W, 3)`` / ``(H, W, 4)``
            array (uint8, or floats in [0, 1]).
        heat: non-negative ``(H, W)`` map, e.g. from :func:`upsample_attention` at the
            image's size. It is scaled by its own maximum, so each word uses the full
            colour range whatever its peak weight; an all-zero map shows as the colormap's
            low end.
        cmap: a matplotlib colormap or its registered name.
        opacity: weight of the heat colours, 0 (image only) to 1 (heat only).

    Returns:
        uint8 RGB pixels of shape ``(H, W, 3)``.

    Raises:
        ValueError: ``heat`` is not the image's height and width, or ``opacity`` is
            outside [0, 1].
    """
    pixels = _rgb(image).astype(np.float64) / 255.0
    heat = np.asarray(heat, dtype=np.float64)
    if heat.shape != pixels.shape[:2]:
        raise ValueError(
            f"heat has shape {heat.shape} but the image is {pixels.shape[:2]} (height, width)"
        )
    if not 0.0 <= opacity <= 1.0:
        raise ValueError(f"opacity must be in [0, 1], got {opacity}")
    colormap = matplotlib.colormaps[cmap] if isinstance(cmap, str) else cmap
    peak = float(heat.max()) if heat.size else 0.0
    scaled = heat / peak if peak > 0 else np.zeros_like(heat)
    colours = colormap(np.clip(scaled, 0.0, 1.0))[:, :, :3]
    blend = (1.0 - opacity) * pixels + opacity * colours
    return np.clip(np.rint(blend * 255.0), 0, 255).astype(np.uint8)


def _cell_rectangle(
    cell: int, grid_shape: tuple[int, int], width: int, height: int, linewidth: float
) -> Rectangle:
    """Outline of a flat cell index in imshow coordinates of a ``width`` x ``height`` image."""
    grid_h, grid_w = grid_shape
    row, col = divmod(cell, grid_w)
    cell_w, cell_h = width / grid_w, height / grid_h
    # imshow puts pixel centres on integers, so pixel edges (and cell edges) sit at -0.5.
    return Rectangle(
        (col * cell_w - 0.5, row * cell_h - 0.5),
        cell_w,
        cell_h,
        fill=False,
        edgecolor=_BOX_COLOUR,
        linewidth=linewidth,
    )


def centre_position(
    centre: Sequence[float] | np.ndarray, grid_shape: tuple[int, int], size: tuple[int, int]
) -> tuple[float, float]:
    """Where a local-attention centre (row, column, in cells) lies on an image of ``size``
    (width, height): ``(x, y)`` in pixels from the image's top-left corner (the column gives
    x, the row y, each times the cell size)."""
    grid_h, grid_w = _check_grid(grid_shape)
    width, height = _check_size(size)
    row, col = (float(v) for v in centre)
    return col * width / grid_w, row * height / grid_h


def _mark_centre(
    ax, centre: np.ndarray, grid_shape: tuple[int, int], width: int, height: int, size: float
) -> None:
    """A cross at a local-attention centre, in imshow coordinates (pixel edges at -0.5); not
    clipped, so that a centre on the image's edge still shows."""
    x, y = centre_position(centre, grid_shape, (width, height))
    outline = [patheffects.withStroke(linewidth=size / 3, foreground="black")]
    ax.plot([x - 0.5], [y - 0.5], marker="x", markersize=size, markeredgewidth=size / 5,
            color=_BOX_COLOUR, linestyle="none", path_effects=outline,
            clip_on=False)  # fmt: skip
    ax.set_xlim(-0.5, width - 0.5)  # a centre near an edge must not widen the axes
    ax.set_ylim(height - 0.5, -0.5)


def _blank_axes(ax) -> None:
    ax.set_xticks([])
    ax.set_yticks([])
    for spine in ax.spines.values():
        spine.set_visible(False)


# --- figures --------------------------------------------------------------------------------


@dataclass
class _PanelLayout:
    """Rows of image panels with a wrapped heading above the first: sizes in inches."""

    n_rows: int
    n_cols: int
    panel_w: float
    panel_h: float
    heading: str
    margin: float = 0.2
    gap_w: float = 0.2
    gap_h: float = 0.32
    bottom: float = 0.1
    top: float = 0.32

    @classmethod
    def make(
        cls,
        n_panels: int,
        columns: int,
        width: int,
        height: int,
        heading: str,
        panel_inches: float = _PANEL_INCHES,
        heading_panels: int = 1,
    ) -> _PanelLayout:
        n_cols = min(columns, n_panels)
        panel_w = panel_inches * width / max(width, height)
        panel_h = panel_inches * height / max(width, height)
        # Roughly the characters of 10 pt text that fit above ``heading_panels`` panels, so
        # the caption wraps instead of running over its neighbours.
        heading = textwrap.fill(heading, max(12, int(panel_w * 11 * heading_panels)))
        # Each row's word title lives in the gap above its panel, and the top margin grows
        # with the heading's line count so it never leaves the figure.
        top = 0.14 + 0.18 * (heading.count("\n") + 1)
        return cls(-(-n_panels // n_cols), n_cols, panel_w, panel_h, heading, top=top)

    @property
    def fig_w(self) -> float:
        return self.n_cols * self.panel_w + (self.n_cols - 1) * self.gap_w + 2 * self.margin

    @property
    def fig_h(self) -> float:
        return self.n_rows * self.panel_h + (self.n_rows - 1) * self.gap_h + self.top + self.bottom

    def gridspec(self, fig: Figure) -> Any:
        return fig.add_gridspec(
            self.n_rows,
            self.n_cols,
            left=self.margin / self.fig_w,
            right=1 - self.margin / self.fig_w,
            bottom=self.bottom / self.fig_h,
            top=1 - self.top / self.fig_h,
            wspace=self.gap_w / self.panel_w,
            hspace=self.gap_h / self.panel_h,
        )


def attention_grid_figure(
    image: Image.Image,
    words: Sequence[str],
    alphas: torch.Tensor | np.ndarray,
    grid_shape: tuple[int, int],
    path: str | Path,
    smooth: bool = True,
    chosen_cells: Sequence[int] | None = None,
    columns: int = 5,
    title: str | None = None,
    centres: torch.Tensor | np.ndarray | None = None,
) -> Path:
    """Write :func:`attention_grid` (the image and one attention overlay per word) as a PNG.

    Args: as :func:`attention_grid`, and ``path``, where to write the PNG (missing parent
    folders are created).

    Returns:
        ``path`` as a :class:`Path`.
    """
    fig = attention_grid(image, words, alphas, grid_shape, smooth=smooth,
                         chosen_cells=chosen_cells, columns=columns, title=title,
                         centres=centres)  # fmt: skip
    return _save_png(fig, path)


def _save_png(fig: Figure, path: str | Path) -> Path:
    """Write ``fig`` at ``path`` (parent folders created) and free it."""
    try:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, format="png", dpi=_DPI)
    finally:
        fig.clear()
    return path


def attention_grid(
    image: Image.Image,
    words: Sequence[str],
    alphas: torch.Tensor | np.ndarray,
    grid_shape: tuple[int, int],
    smooth: bool = True,
    chosen_cells: Sequence[int] | None = None,
    columns: int = 5,
    title: str | None = None,
    centres: torch.Tensor | np.ndarray | None = None,
) -> Figure:
    """A figure of the image and one attention overlay per word (no pyplot involved).

    The first panel is the plain image, titled with the caption (or ``title``); then one
    panel per word, titled with the word, showing its attention upsampled to the image,
    scaled to its own maximum and blended over the image. Panels fill rows of ``columns``,
    so a long caption makes a taller figure.

    Args:
        image: the captioned image, any size and mode.
        words: the caption's tokens, in order (``<end>`` included if it was attended).
        alphas: ``(T, L)`` or ``(T, grid_h, grid_w)`` weights with ``T = len(words)``;
            ``alphas[t]`` is the attention used to produce ``words[t]``.
        grid_shape: ``(grid_h, grid_w)``, the encoder's feature-map shape.
        smooth: bilinear maps if True, blocky per-cell maps if False (see
            :func:`upsample_attention`).
        chosen_cells: for hard attention, the flat index of the cell sampled (or the argmax)
            for each word; that cell is outlined on the word's panel.
        columns: panels per row.
        title: the first panel's title instead of the caption.
        centres: for local attention, ``(T, 2)`` the centre (row, column, in cells) the
            model predicted for each word; a cross marks it on the word's panel.

    Returns:
        A matplotlib :class:`~matplotlib.figure.Figure` with an Agg canvas.

    Raises:
        ValueError: ``words``, ``alphas``, ``chosen_cells`` and ``centres`` disagree in
            length, a row of ``alphas`` does not match ``grid_shape``, a chosen cell is
            outside the grid, or ``columns`` is below 1.
    """
    words, maps, cells = _check_caption(words, alphas, grid_shape, chosen_cells)
    centres = _check_centres(centres, len(words))
    grid_shape = _check_grid(grid_shape)
    if columns < 1:
        raise ValueError(f"columns must be at least 1, got {columns}")
    shown = _fit(image, 1, _MAX_DISPLAY_SIDE)
    width, height = shown.size
    pixels = np.asarray(shown)

    n_panels = 1 + len(words)
    heading = title if title is not None else " ".join(words)
    layout = _PanelLayout.make(n_panels, columns, width, height, heading)

    fig = Figure(figsize=(layout.fig_w, layout.fig_h), dpi=_DPI)
    FigureCanvasAgg(fig)
    n_cols = layout.n_cols
    gs = layout.gridspec(fig)
    for panel in range(n_panels):
        ax = fig.add_subplot(gs[panel // n_cols, panel % n_cols])
        _blank_axes(ax)
        if panel == 0:
            ax.imshow(pixels)
            # parse_math=False: captions are data, and a "$" in one must not start TeX.
            ax.set_title(layout.heading, fontsize=10, parse_math=False)
            continue
        t = panel - 1
        heat = upsample_attention(maps[t], grid_shape, (width, height), smooth=smooth)
        ax.imshow(overlay_array(pixels, heat))
        if cells is not None:
            ax.add_patch(_cell_rectangle(cells[t], grid_shape, width, height, 2.0))
        if centres is not None:
            _mark_centre(ax, centres[t], grid_shape, width, height, 10.0)
        ax.set_title(words[t], fontsize=11, parse_math=False)
    return fig


def heads_figure(
    image: Image.Image,
    words: Sequence[str],
    heads: torch.Tensor | np.ndarray,
    grid_shape: tuple[int, int],
    path: str | Path,
    smooth: bool = True,
    title: str | None = None,
) -> Path:
    """Write :func:`heads_grid` (one row of per-word overlays per head, and their mean) as a
    PNG at ``path`` (missing parent folders are created).

    Returns:
        ``path`` as a :class:`Path`.
    """
    return _save_png(heads_grid(image, words, heads, grid_shape, smooth, title), path)


def heads_grid(
    image: Image.Image,
    words: Sequence[str],
    heads: torch.Tensor | np.ndarray,
    grid_shape: tuple[int, int],
    smooth: bool = True,
    title: str | None = None,
) -> Figure:
    """A figure of where each head of a multi-head model looked for each word: one row per
    head, then a row of their mean (the map the other figures show), one column per word.

    Args:
        image: the captioned image, any size and mode.
        words: the caption's tokens, in order.
        heads: ``(T, H, L)`` or ``(T, H, grid_h, grid_w)`` weights with ``T = len(words)``;
            ``heads[t, h]`` is head ``h``'s attention for ``words[t]``.
        grid_shape: ``(grid_h, grid_w)``, the encoder's feature-map shape.
        smooth: bilinear maps if True, blocky per-cell maps if False.
        title: the heading instead of the caption.

    Returns:
        A matplotlib :class:`~matplotlib.figure.Figure` with an Agg canvas.

    Raises:
        ValueError: no words, ``heads`` is not one (H, ...) stack per word, or a map does
            not match ``grid_shape``.
    """
    grid_shape = _check_grid(grid_shape)
    words = [str(word) for word in words]
    array = _as_numpy(heads, "heads")
    if not words:
        raise ValueError("heads_grid needs at least one word")
    if array.ndim not in (3, 4) or len(array) != len(words):
        raise ValueError(f"heads must be (T, H, L) or (T, H, grid_h, grid_w) with T = "
                         f"{len(words)} words; got shape {tuple(array.shape)}")  # fmt: skip
    n_heads = array.shape[1]
    rows = [[_attention_map(array[t, h], grid_shape, f"heads[{t}, {h}]") for t in range(len(words))]
            for h in range(n_heads)]  # fmt: skip
    rows.append([np.mean([row[t] for row in rows], axis=0) for t in range(len(words))])
    labels = [f"head {h + 1}" for h in range(n_heads)] + ["mean"]

    shown = _fit(image, 1, _MAX_DISPLAY_SIDE)
    width, height = shown.size
    pixels = np.asarray(shown)
    heading = title if title is not None else " ".join(words)
    layout = _PanelLayout.make(len(rows) * len(words), len(words), width, height, heading,
                               panel_inches=1.6, heading_panels=len(words))  # fmt: skip
    layout = replace(layout, margin=0.5, top=layout.top + 0.2)  # row labels, word titles
    fig = Figure(figsize=(layout.fig_w, layout.fig_h), dpi=_DPI)
    FigureCanvasAgg(fig)
    gs = layout.gridspec(fig)
    for r, (label, maps) in enumerate(zip(labels, rows)):
        for t, alpha in enumerate(maps):
            ax = fig.add_subplot(gs[r, t])
            _blank_axes(ax)
            heat = upsample_attention(alpha, grid_shape, (width, height), smooth=smooth)
            ax.imshow(overlay_array(pixels, heat))
            if r == 0:
                ax.set_title(words[t], fontsize=10, parse_math=False)
            if t == 0:
                ax.set_ylabel(label, fontsize=10)
    fig.text(0.5, 1 - 0.06 / layout.fig_h, layout.heading, ha="center", va="top",
             fontsize=10, parse_math=False)  # fmt: skip
    return fig


def _gif_frame(
    pixels: np.ndarray,
    heat: np.ndarray,
    word: str,
    counter: str,
    cell: int | None,
    grid_shape: tuple[int, int],
    centre: np.ndarray | None = None,
) -> Image.Image:
    """One animation frame, rendered at exactly the pixel size of ``pixels``."""
    height, width = pixels.shape[:2]
    fig = Figure(figsize=(width / _DPI, height / _DPI), dpi=_DPI)
    canvas = FigureCanvasAgg(fig)
    try:
        ax = fig.add_axes((0.0, 0.0, 1.0, 1.0))
        ax.set_axis_off()
        ax.imshow(overlay_array(pixels, heat), interpolation="none", aspect="auto")
        ax.set_xlim(-0.5, width - 0.5)
        ax.set_ylim(height - 0.5, -0.5)
        if cell is not None:
            ax.add_patch(_cell_rectangle(cell, grid_shape, width, height, 2.5))
        if centre is not None:
            _mark_centre(ax, centre, grid_shape, width, height, 0.05 * height * 72 / _DPI)
        # Sized from the frame's height so a word reads the same at any image size.
        points = 0.075 * height * 72 / _DPI
        box = {"facecolor": "black", "alpha": 0.65, "edgecolor": "none", "pad": 3}
        ax.text(
            0.5,
            0.04,
            word,
            transform=ax.transAxes,
            ha="center",
            va="bottom",
            fontsize=points,
            color="white",
            bbox=box,
            parse_math=False,
        )
        # The counter also keeps consecutive frames distinct: Pillow merges identical frames,
        # which would drop a frame for a word repeated with the same attention.
        ax.text(
            0.98,
            0.97,
            counter,
            transform=ax.transAxes,
            ha="right",
            va="top",
            fontsize=points * 0.6,
            color="white",
            bbox=box,
            parse_math=False,
        )
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
) -> Path:
    """Write an animated GIF that shows each word over its attention, one frame per word.

    Frames are the image (rescaled so its longer side is between 320 and 640 pixels) with
    the word's attention blended over it as in :func:`attention_grid_figure`, the word
    written at the bottom and ``t/T`` in a corner. The animation loops forever.

    Args:
        image: the captioned image, any size and mode.
        words: the caption's tokens, in order; at least one.
        alphas: ``(T, L)`` or ``(T, grid_h, grid_w)`` weights with ``T = len(words)``;
            ``alphas[t]`` is the attention used to produce ``words[t]``.
        grid_shape: ``(grid_h, grid_w)``, the encoder's feature-map shape.
        path: where to write the GIF; missing parent folders are created.
        smooth: bilinear maps if True, blocky per-cell maps if False.
        chosen_cells: for hard attention, the flat cell index chosen for each word; it is
            outlined in that word's frame.
        frame_ms: how long each frame is shown, in milliseconds.
        centres: for local attention, ``(T, 2)`` each word's predicted centre (row,
            column, in cells), marked with a cross.

    Returns:
        ``path`` as a :class:`Path`.

    Raises:
        ValueError: no words, ``words``, ``alphas`` and ``chosen_cells`` disagree in length,
            a row of ``alphas`` does not match ``grid_shape``, a chosen cell is outside the grid,
            or ``frame_ms`` is not positive.
    """
    words, maps, cells = _check_caption(words, alphas, grid_shape, chosen_cells)
    centres = _check_centres(centres, len(words))
    grid_shape = _check_grid(grid_shape)
    if not words:
        raise ValueError("attention_gif needs at least one word: a GIF cannot have no frames")
    if frame_ms <= 0:
        raise ValueError(f"frame_ms must be positive, got {frame_ms}")
    shown = _fit(image, _GIF_MIN_SIDE, _GIF_MAX_SIDE)
    pixels = np.asarray(shown)
    frames = [
        _gif_frame(
            pixels,
            upsample_attention(maps[t], grid_shape, shown.size, smooth=smooth),
            words[t],
            f"{t + 1}/{len(words)}",
            None if cells is None else cells[t],
            grid_shape,
            None if centres is None else centres[t],
        )
        for t in range(len(words))
    ]
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    frames[0].save(
        path,
        format="GIF",
        save_all=True,
        append_images=frames[1:],
        duration=int(frame_ms),
        loop=0,
    )
    return path
