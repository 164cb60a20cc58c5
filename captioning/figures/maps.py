"""From a word's attention row to pixels: the grid smoothed and upsampled over the image, the photo
dimmed (or colour-mapped) by it, centres, cells and boxes marked."""

from __future__ import annotations

import unicodedata
from collections.abc import Sequence
from typing import TYPE_CHECKING

import matplotlib
import numpy as np
import torch
import torch.nn.functional as F
from matplotlib import patheffects
from matplotlib.colors import Colormap
from matplotlib.patches import Rectangle
from PIL import Image

if TYPE_CHECKING:
    pass
from captioning.figures.common import (
    _BOX_COLOUR,
    _OBJECT_COLOUR,
    _SMOOTH_PIXELS_PER_CELL,
    _SMOOTH_SIGMA_CELLS,
    DIM_FLOOR,
    DIM_GLOW,
    SCALES,
    _as_numpy,
    _attention_map,
    _check_grid,
    _check_size,
    _rgb,
)


def _gaussian_blur(heat: torch.Tensor, sigma: float) -> torch.Tensor:
    """``heat`` (1, 1, H, W) blurred by a Gaussian of ``sigma`` pixels, separably; the edges
    are extended by their own values, so the border does not darken."""
    radius = max(1, int(np.ceil(3.0 * sigma)))
    offsets = torch.arange(-radius, radius + 1, dtype=heat.dtype)
    kernel = torch.exp(-0.5 * (offsets / sigma) ** 2)
    kernel = kernel / kernel.sum()  # (K,)
    padded = F.pad(heat, (radius, radius, radius, radius), mode="replicate")
    rows = F.conv2d(padded, kernel.view(1, 1, 1, -1))  # (1, 1, H + 2r, W)
    return F.conv2d(rows, kernel.view(1, 1, -1, 1))  # (1, 1, H, W)


def smooth_grid(alpha: torch.Tensor | np.ndarray, grid_shape: tuple[int, int]) -> np.ndarray:
    """One word's attention upsampled the paper's way at a small working size: bilinear to
    16 pixels per cell, then a Gaussian blur of half a cell (the web page computes the same
    map, and the figures resize it to the image).

    Args:
        alpha: the word's weights, flat (``L = grid_h * grid_w``, row-major) or
            ``(grid_h, grid_w)``.
        grid_shape: ``(grid_h, grid_w)``, the encoder's feature-map shape.

    Returns:
        A float64 array of shape ``(16 * grid_h, 16 * grid_w)``, non-negative, whose mean
        is close to that of the cells (the edges are extended, not mirrored).
    """
    grid_shape = _check_grid(grid_shape)
    cells = _attention_map(_as_numpy(alpha, "alpha"), grid_shape, "alpha")
    # align_corners=False treats each weight as the value at its cell's centre, so the map
    # lines up with the per-cell blocks of smooth=False instead of shifting by half a cell.
    grid_tensor = torch.from_numpy(np.ascontiguousarray(cells))[None, None]  # (1, 1, gh, gw)
    size = (grid_shape[0] * _SMOOTH_PIXELS_PER_CELL, grid_shape[1] * _SMOOTH_PIXELS_PER_CELL)
    work = F.interpolate(grid_tensor, size=size, mode="bilinear", align_corners=False)
    work = _gaussian_blur(work, _SMOOTH_SIGMA_CELLS * _SMOOTH_PIXELS_PER_CELL)  # (1, 1, *size)
    # Weights from a model may dip a hair below zero (e.g. after a subtraction), and the
    # brightness or colour scale would misread them.
    return np.clip(work[0, 0].numpy(), 0.0, None)


def upsample_attention(
    alpha: torch.Tensor | np.ndarray,
    grid_shape: tuple[int, int],
    size: tuple[int, int],
    smooth: bool = True,
) -> np.ndarray:
    """Stretch one word's attention over the grid to an image-sized map.

    The map covers the whole image whatever its aspect ratio, as the encoder saw it: the
    image is squashed to a square, so cells are as wide as ``width / grid_w`` and as tall as
    ``height / grid_h``.

    Args:
        alpha: the word's weights, either flat with ``L = grid_h * grid_w`` entries in
            row-major order (cell ``(r, c)`` at index ``r * grid_w + c``) or already shaped
            ``(grid_h, grid_w)``. A tensor may be on any device and require grad.
        grid_shape: ``(grid_h, grid_w)``, the encoder's feature-map shape.
        size: the output size as ``(width, height)``, the order PIL's ``Image.size`` uses.
        smooth: True for the paper's smooth map (:func:`smooth_grid`: bilinear between
            cell centres, then a Gaussian blur of half a cell, resized to ``size``); False
            for nearest, where each cell covers exactly its own block of the image (every
            pixel takes the cell its centre falls in), which shows the real resolution of
            the attention and suits hard attention.

    Returns:
        A float64 array of shape ``(height, width)``, non-negative. The total mass is not
        preserved: values are (smoothed) weights themselves.

    Raises:
        ValueError: the weights do not match ``grid_shape``, contain NaN or inf, or
            ``grid_shape`` or ``size`` are not pairs of positive integers.
    """
    grid_shape = _check_grid(grid_shape)
    width, height = _check_size(size)
    cells = _attention_map(_as_numpy(alpha, "alpha"), grid_shape, "alpha")
    if smooth:
        work = torch.from_numpy(smooth_grid(cells, grid_shape))[None, None]  # (1, 1, 16gh, 16gw)
        # antialias matters only when shrinking (a small image or a large grid).
        heat = F.interpolate(
            work, size=(height, width), mode="bilinear", align_corners=False, antialias=True
        )
        return np.clip(heat[0, 0].numpy(), 0.0, None)
    # Explicit index maps rather than interpolate(mode="nearest"): with sizes that are not a
    # multiple of the grid, the pixel-centre rule keeps the blocks where a cell rectangle
    # drawn at c * width / grid_w would put them.
    grid_h, grid_w = grid_shape
    rows = np.minimum(((np.arange(height) + 0.5) * grid_h / height).astype(int), grid_h - 1)
    cols = np.minimum(((np.arange(width) + 0.5) * grid_w / width).astype(int), grid_w - 1)
    return np.clip(cells[rows[:, None], cols[None, :]], 0.0, None)


def dim_array(
    image: Image.Image | np.ndarray,
    heat: np.ndarray,
    floor: float = DIM_FLOOR,
    glow: float = DIM_GLOW,
    peak: float | None = None,
) -> np.ndarray:
    """The image bright where ``heat`` is high and dimmed where it is low (the paper's look).

    With ``m = heat / peak`` (``peak``: the map's own maximum unless given), each pixel is
    first multiplied by ``floor + (1 - floor) * m`` (the word's peak keeps the photo's own
    brightness, a place with no attention keeps ``floor`` of it), then lightened toward white by
    ``glow * m ** 2``, so that the attended region stands out even on a dark photo. An
    all-zero map dims everything.

    Args:
        image: a PIL image of any mode, or an ``(H, W)`` / ``(H, W, 3)`` / ``(H, W, 4)``
            array (uint8, or floats in [0, 1]).
        heat: non-negative ``(H, W)`` map, e.g. from :func:`upsample_attention` at the
            image's size.
        floor: the brightness kept where the attention is zero, in [0, 1].
        glow: how far the peak is lightened toward white, in [0, 1]; 0 keeps the photo's
            own pixels there.
        peak: the heat drawn at full brightness (values above it too); None: the map's
            own maximum. One peak for several maps puts them on one scale.

    Returns:
        uint8 RGB pixels of shape ``(H, W, 3)``.

    Raises:
        ValueError: ``heat`` is not the image's height and width, or ``floor`` or ``glow``
            is outside [0, 1].
    """
    pixels = _rgb(image).astype(np.float64)
    relative = _relative(heat, pixels.shape[:2], peak)[:, :, None]  # (H, W, 1)
    for name, value in (("floor", floor), ("glow", glow)):
        if not 0.0 <= value <= 1.0:
            raise ValueError(f"{name} must be in [0, 1], got {value}")
    dimmed = pixels * (floor + (1.0 - floor) * relative)
    lit = dimmed + glow * relative**2 * (255.0 - dimmed)
    return np.clip(np.rint(lit), 0, 255).astype(np.uint8)


def _relative(heat: np.ndarray, shape: tuple[int, ...], peak: float | None = None) -> np.ndarray:
    """``heat`` divided by ``peak`` (None: its own maximum), clipped to [0, 1]; zeros when
    the peak is not positive."""
    heat = np.asarray(heat, dtype=np.float64)
    if heat.shape != tuple(shape):
        raise ValueError(
            f"heat has shape {heat.shape} but the image is {tuple(shape)} (height, width)"
        )
    if peak is None:
        peak = float(heat.max()) if heat.size else 0.0
    return np.clip(heat / peak, 0.0, 1.0) if peak > 0 else np.zeros_like(heat)


def overlay_array(
    image: Image.Image | np.ndarray,
    heat: np.ndarray,
    cmap: str | Colormap = "jet",
    opacity: float = 0.6,
    peak: float | None = None,
) -> np.ndarray:
    """Blend a colour-mapped heat map over an image.

    Args:
        image: a PIL image of any mode, or an ``(H, W)`` / ``(H, W, 3)`` / ``(H, W, 4)``
            array (uint8, or floats in [0, 1]).
        heat: non-negative ``(H, W)`` map, e.g. from :func:`upsample_attention` at the
            image's size. It is scaled by ``peak`` (by default its own maximum, so each
            word uses the full colour range whatever its peak weight); an all-zero map shows
            as the colormap's low end.
        cmap: a matplotlib colormap or its registered name.
        opacity: weight of the heat colours, 0 (image only) to 1 (heat only).
        peak: the heat given the colormap's high end; None: the map's own maximum.

    Returns:
        uint8 RGB pixels of shape ``(H, W, 3)``.

    Raises:
        ValueError: ``heat`` is not the image's height and width, or ``opacity`` is
            outside [0, 1].
    """
    pixels = _rgb(image).astype(np.float64) / 255.0
    scaled = _relative(heat, pixels.shape[:2], peak)
    if not 0.0 <= opacity <= 1.0:
        raise ValueError(f"opacity must be in [0, 1], got {opacity}")
    colormap = matplotlib.colormaps[cmap] if isinstance(cmap, str) else cmap
    colours = colormap(scaled)[:, :, :3]
    blend = (1.0 - opacity) * pixels + opacity * colours
    return np.clip(np.rint(blend * 255.0), 0, 255).astype(np.uint8)


# How each style draws a word's map over the image: (image, heat) -> uint8 RGB.
_STYLES = {"dim": dim_array, "colour": overlay_array}


def _check_style(style: str) -> str:
    if style not in _STYLES:
        raise ValueError(f"style must be one of {', '.join(map(repr, _STYLES))}; got {style!r}")
    return style


def _text(value: str) -> str:
    """Text as drawn: NFC-composed, so that a Vietnamese letter written as a base and
    combining marks shows as its single DejaVu glyph with the marks in place."""
    return unicodedata.normalize("NFC", str(value))


def _check_scale(scale: str) -> str:
    if scale not in SCALES:
        raise ValueError(f"scale must be one of {', '.join(map(repr, SCALES))}; got {scale!r}")
    return scale


def _peak_label(alpha: np.ndarray) -> str:
    """The map's largest weight as a multiple of an even map's (1 / L): ``7.3x even``."""
    return f"{float(alpha.max()) * alpha.size:.1f}x even"


def _heats(
    maps: Sequence[np.ndarray],
    grid_shape: tuple[int, int],
    size: tuple[int, int],
    smooth: bool,
    scale: str,
) -> tuple[list[np.ndarray], float | None]:
    """Each map upsampled to ``size``, and the peak they are drawn against: the median of
    their peaks (``scale="caption"``: a word that looks harder than most saturates, one that
    spreads its attention stays dim) or None (each its own)."""
    heats = [upsample_attention(alpha, grid_shape, size, smooth=smooth) for alpha in maps]
    if scale == "word" or not heats:
        return heats, None
    return heats, float(np.median([heat.max() for heat in heats]))


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
    ax.plot(
        [x - 0.5],
        [y - 0.5],
        marker="x",
        markersize=size,
        markeredgewidth=size / 5,
        color=_BOX_COLOUR,
        linestyle="none",
        path_effects=outline,
        clip_on=False,
    )
    ax.set_xlim(-0.5, width - 0.5)  # a centre near an edge must not widen the axes
    ax.set_ylim(height - 0.5, -0.5)


def _check_boxes(
    boxes: Sequence[Sequence[Sequence[float]]] | None, n_words: int
) -> list[list[tuple[float, ...]]] | None:
    """Per word, its object boxes as shares (x, y, width, height) of the image; checked."""
    if boxes is None:
        return None
    if len(boxes) != n_words:
        raise ValueError(
            f"boxes has {len(boxes)} entries for {n_words} words; give one list "
            "of boxes per word (empty for a word that names no object)"
        )
    checked = []
    for word_boxes in boxes:
        shares = [tuple(float(v) for v in box) for box in word_boxes]
        if any(len(box) != 4 for box in shares):
            raise ValueError("a box is 4 numbers: x, y, width, height as shares of the image")
        checked.append(shares)
    return checked


def _draw_boxes(ax, boxes: Sequence[tuple[float, ...]], width: int, height: int) -> None:
    """Outline object boxes (shares of the image) in imshow coordinates (edges at -0.5)."""
    outline = [patheffects.withStroke(linewidth=3.0, foreground="black")]
    for x, y, w, h in boxes:
        ax.add_patch(
            Rectangle(
                (x * width - 0.5, y * height - 0.5),
                w * width,
                h * height,
                fill=False,
                edgecolor=_OBJECT_COLOUR,
                linewidth=1.5,
                path_effects=outline,
            )
        )


def _blank_axes(ax) -> None:
    ax.set_xticks([])
    ax.set_yticks([])
    for spine in ax.spines.values():
        spine.set_visible(False)
