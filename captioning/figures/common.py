"""The figures' shared settings (panel size, dimming, legends) and the checks of their inputs:
attention rows, grids, sizes, captions, centres, images."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Literal

import numpy as np
import torch
from PIL import Image

if TYPE_CHECKING:
    pass


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
