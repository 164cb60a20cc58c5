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
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.image import BboxImage
from matplotlib.patches import Rectangle
from matplotlib.transforms import Bbox, TransformedBbox
from PIL import Image

from captioning.files import open_unlinked

if TYPE_CHECKING:
    pass
from captioning.figures.common import (
    _DPI,
    _LEGEND_COLOUR,
    _LEGEND_DIM,
    _LEGEND_OBJECTS,
    _MAX_DISPLAY_SIDE,
    _PANEL_INCHES,
    Scale,
    Style,
    _check_caption,
    _check_centres,
    _check_grid,
    _fit,
)
from captioning.figures.maps import (
    _STYLES,
    _blank_axes,
    _cell_rectangle,
    _check_boxes,
    _check_scale,
    _check_style,
    _draw_boxes,
    _heats,
    _mark_centre,
    _peak_label,
    _text,
)

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
