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
drawn as a cross. Object boxes, where a word names an annotated object, come as shares
(x, y, width, height) of the image's width and height and are outlined in yellow. A
multi-head model's heads get a figure of their own, one row per head.
The ``trace_*`` functions draw a caption's per-word record
(:class:`~captioning.models.trace.AttentionTrace`) with whatever marks its fields call for;
they are the one place that reads those fields for drawing.

The default look is the paper's (Xu et al. 2015, figures 2 to 5): the photo itself, bright
where the word's attention is high and dimmed elsewhere, the map upsampled smoothly from the
grid. The encoder sees the whole image squashed to a square, so a map always stretches over
the whole image at its own aspect ratio. ``style="colour"`` keeps the older colour-mapped
overlay.
"""

from __future__ import annotations

import textwrap
import unicodedata
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import matplotlib
import numpy as np
import torch
import torch.nn.functional as F
from matplotlib import patheffects
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.colors import Colormap
from matplotlib.figure import Figure
from matplotlib.image import BboxImage
from matplotlib.patches import Rectangle
from matplotlib.transforms import Bbox, TransformedBbox
from PIL import Image

from captioning.errors import ConfigError
from captioning.files import open_unlinked

if TYPE_CHECKING:
    from captioning.models.trace import AttentionTrace

__all__ = [
    "attention_gif",
    "attention_grid_figure",
    "trace_figure",
    "trace_gif",
    "trace_grid",
    "trace_heads_figure",
    "trace_heads_grid",
    "centre_position",
    "dim_array",
    "smooth_grid",
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
_OBJECT_COLOUR = "#ffd400"
_LEGEND_OBJECTS = "yellow: the boxes of the objects the word names"
# Brightness kept where a word's attention is zero: low enough that the attended region
# stands out, high enough that the rest of the photo can still be read.
DIM_FLOOR = 0.2
# How far the peak of a word's map is lightened toward white: a dark subject (a black dog in
# the shade) would otherwise hardly change when attended.
DIM_GLOW = 0.15
# Smooth maps are built the paper's way: upsampled to this many pixels per cell, blurred with
# a Gaussian of this many cells' standard deviation, then resized to the image.
_SMOOTH_PIXELS_PER_CELL = 16
_SMOOTH_SIGMA_CELLS = 0.5
_LEGEND_DIM = {
    "caption": "brightness: attention on one scale for every word, 1 at the median of the "
    "words' peaks",
    "word": "brightness: attention relative to each word's own peak, dimmed 0 to bright 1",
}
_LEGEND_COLOUR = {
    "caption": "colour: attention on one scale for every word, 1 at the median of the words' peaks",
    "word": "colour: attention relative to each word's own peak, 0 to 1",
}

Style = Literal["dim", "colour"]
# How bright a word's map is drawn: "caption" puts every word of a figure on one scale (the
# median of the words' peaks is 1; higher peaks saturate), so an even map looks flat and dim
# beside a peaked one; "word" scales
# each map by its own peak, which shows the shape of a map but draws an even map as brightly
# as a peaked one.
Scale = Literal["caption", "word"]
SCALES = ("caption", "word")


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
        raise ValueError(
            f"centres must be (row, column) per word, shape ({n_words}, 2); "
            f"got shape {tuple(array.shape)}"
        )
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


# --- figures --------------------------------------------------------------------------------

# Room below the panels for the scale: a ramp with its two ends named, then what it means.
_LEGEND_INCHES = 0.62


@dataclass
class _PanelLayout:
    """Rows of image panels with a wrapped heading above the first and the scale below the
    last: sizes in inches."""

    n_rows: int
    n_cols: int
    panel_w: float
    panel_h: float
    heading: str
    margin: float = 0.2
    gap_w: float = 0.2
    gap_h: float = 0.32
    bottom: float = 0.1 + _LEGEND_INCHES
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
        heading = textwrap.fill(_text(heading), max(12, int(panel_w * 11 * heading_panels)))
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


def _scale_ramp(style: str, steps: int = 256) -> np.ndarray:
    """``(1, steps, 3)`` float RGB of what relative attention 0 to 1 looks like: white paper
    dimmed by the style's rule, or the colour overlay on white."""
    relative = np.linspace(0.0, 1.0, steps)[None, :]  # (1, steps)
    paper = np.full((1, steps, 3), 255, dtype=np.uint8)
    return _STYLES[style](paper, relative).astype(np.float64) / 255.0


def _draw_legend(
    fig: Figure,
    layout: _PanelLayout,
    style: str,
    n_cells: int,
    objects: bool = False,
    scale: str = "caption",
) -> None:
    """The scale under the panels: a ramp from 0 to 1 with its ends named, and one wrapped
    line saying what brightness (or colour) and the titles' ``max`` mean. Drawn in figure
    coordinates, so ``fig.axes`` keeps only the panels."""
    to_x, to_y = (lambda inches: inches / layout.fig_w), (lambda inches: inches / layout.fig_h)
    centre = layout.fig_w / 2
    bar_w = min(1.6, max(0.6, layout.fig_w - 1.8))
    bar_y, bar_h = 0.42, 0.13
    box = Bbox.from_extents(
        to_x(centre - bar_w / 2), to_y(bar_y), to_x(centre + bar_w / 2), to_y(bar_y + bar_h)
    )
    ramp = BboxImage(TransformedBbox(box, fig.transFigure), interpolation="bilinear")
    ramp.set_data(_scale_ramp(style))
    fig.add_artist(ramp)
    fig.add_artist(
        Rectangle(
            (box.x0, box.y0),
            box.width,
            box.height,
            transform=fig.transFigure,
            fill=False,
            edgecolor="0.3",
            linewidth=0.6,
        )
    )
    low, high = ("dimmed 0", "1 bright") if style == "dim" else ("0", "1")
    middle = to_y(bar_y + bar_h / 2)
    fig.text(to_x(centre - bar_w / 2 - 0.06), middle, low, ha="right", va="center", fontsize=9)
    fig.text(to_x(centre + bar_w / 2 + 0.06), middle, high, ha="left", va="center", fontsize=9)
    meaning = (_LEGEND_DIM if style == "dim" else _LEGEND_COLOUR)[scale]
    note = (
        f"{meaning}; Nx even: the word's largest weight on one of the {n_cells} cells, "
        f"as a multiple of an even map's 1/{n_cells}"
    )
    if objects:
        note += f"; {_LEGEND_OBJECTS}"
    fig.text(
        0.5,
        to_y(0.34),
        textwrap.fill(note, max(30, int(layout.fig_w * 15))),
        ha="center",
        va="top",
        fontsize=8,
        color="0.2",
        parse_math=False,
    )


def _draw_map(ax, pixels: np.ndarray, heat: np.ndarray, style: str, peak: float | None) -> None:
    """One word's upsampled map over the image on ``ax``, as ``style`` draws it against
    ``peak`` (None: its own maximum)."""
    ax.imshow(_STYLES[style](pixels, heat, peak=peak))


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
    style: Style = "dim",
    boxes: Sequence[Sequence[Sequence[float]]] | None = None,
    scale: Scale = "caption",
) -> Path:
    """Write :func:`attention_grid` (the image and one attention panel per word) as a PNG.

    Args: as :func:`attention_grid`, and ``path``, where to write the PNG (missing parent
    folders are created).

    Returns:
        ``path`` as a :class:`Path`.
    """
    fig = attention_grid(
        image,
        words,
        alphas,
        grid_shape,
        smooth=smooth,
        chosen_cells=chosen_cells,
        columns=columns,
        title=title,
        centres=centres,
        style=style,
        boxes=boxes,
        scale=scale,
    )
    return _save_png(fig, path)


# zlib's fastest level: a photo's figure is written in about half the time of PIL's default
# level 6, and is about a tenth larger (every epoch of a training writes one).
_PNG_COMPRESSION = 1


def _save_png(fig: Figure, path: str | Path) -> Path:
    """Write ``fig`` at ``path`` (parent folders created) and free it."""
    try:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        with open_unlinked(path) as handle:  # a link there is refused, not written through
            fig.savefig(
                handle, format="png", dpi=_DPI, pil_kwargs={"compress_level": _PNG_COMPRESSION}
            )
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
    style: Style = "dim",
    boxes: Sequence[Sequence[Sequence[float]]] | None = None,
    scale: Scale = "caption",
) -> Figure:
    """A figure of the image and one attention panel per word (no pyplot involved).

    The first panel is the plain image, titled with the caption (or ``title``); then one
    panel per word, titled with the word and its largest weight as a multiple of an even
    map's (``sân (7.3x even)``): the image bright where the word's attention is high and
    dimmed to a fifth where it is zero, every word on one scale (:data:`Scale`), as a scale
    under the panels says. Panels fill rows of ``columns``.

    Args:
        image: the captioned image, any size and mode.
        words: the caption's tokens, in order (``<end>`` included if it was attended).
        alphas: ``(T, L)`` or ``(T, grid_h, grid_w)`` weights with ``T = len(words)``;
            ``alphas[t]`` is the attention used to produce ``words[t]``.
        grid_shape: ``(grid_h, grid_w)``, the encoder's feature-map shape.
        smooth: smooth maps if True, blocky per-cell maps if False.
        chosen_cells: for hard attention, each word's sampled (or argmax) cell, outlined.
        columns, title: panels per row; the first panel's title instead of the caption.
        centres: for local attention, ``(T, 2)`` the centre (row, column, in cells) the
            model predicted for each word; a cross marks it on the word's panel.
        style: ``"dim"`` (:func:`dim_array`) or ``"colour"`` (:func:`overlay_array`).
        boxes: per word, the boxes of the objects it names (none for other words), each
            (x, y, width, height) as shares of the image; outlined in yellow on its panel.
        scale: ``"caption"`` or ``"word"`` (:data:`Scale`).

    Returns:
        A matplotlib :class:`~matplotlib.figure.Figure` with an Agg canvas.

    Raises:
        ValueError: ``words``, ``alphas``, ``chosen_cells``, ``centres`` and ``boxes``
            disagree in length, a row of ``alphas`` does not match ``grid_shape``, a chosen cell is
            outside the grid, ``columns`` is below 1, or ``style`` or ``scale`` is unknown.
    """
    words, maps, cells = _check_caption(words, alphas, grid_shape, chosen_cells)
    centres = _check_centres(centres, len(words))
    boxes = _check_boxes(boxes, len(words))
    grid_shape = _check_grid(grid_shape)
    style, scale = _check_style(style), _check_scale(scale)
    if columns < 1:
        raise ValueError(f"columns must be at least 1, got {columns}")
    shown = _fit(image, 1, _MAX_DISPLAY_SIDE)
    width, height = shown.size
    pixels = np.asarray(shown)
    heats, peak = _heats(maps, grid_shape, (width, height), smooth, scale)
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
        _draw_map(ax, pixels, heats[t], style, peak)
        _draw_marks(ax, t, cells, centres, boxes, grid_shape, (width, height))
        ax.set_title(f"{_text(words[t])} ({_peak_label(maps[t])})", fontsize=11, parse_math=False)
    _draw_legend(fig, layout, style, grid_shape[0] * grid_shape[1], any(boxes or []), scale)
    return fig


def _draw_marks(
    ax,
    t: int,
    cells: Sequence[int] | None,
    centres: np.ndarray | None,
    boxes: list[list[tuple[float, ...]]] | None,
    grid_shape: tuple[int, int],
    size: tuple[int, int],
) -> None:
    """Word ``t``'s marks on its panel: hard attention's chosen cell, local attention's
    centre and the boxes of the objects the word names, each where the caption has them."""
    width, height = size
    if cells is not None:
        ax.add_patch(_cell_rectangle(cells[t], grid_shape, width, height, 2.0))
    if centres is not None:
        _mark_centre(ax, centres[t], grid_shape, width, height, 10.0)
    if boxes is not None:
        _draw_boxes(ax, boxes[t], width, height)


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


# --- a caption's trace ----------------------------------------------------------------------

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
