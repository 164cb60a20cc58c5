from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import textwrap
import threading
import unicodedata
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image, ImageDraw

from captioning.figures.common import DIM_FLOOR, DIM_GLOW
from captioning.figures.gif import attention_gif
from captioning.figures.heads import heads_figure, heads_grid
from captioning.figures.heatmaps import attention_grid, attention_grid_figure
from captioning.figures.maps import (
    centre_position,
    dim_array,
    overlay_array,
    smooth_grid,
    upsample_attention,
)

PAGE = Path(__file__).parents[1] / "captioning" / "serve" / "page.html"

GRID = (3, 5)  # grid_h, grid_w: deliberately not square
L = GRID[0] * GRID[1]


def _one_hot(cell: int, n: int = L) -> np.ndarray:
    alpha = np.zeros(n)
    alpha[cell] = 1.0
    return alpha


def _photo(size=(64, 40)) -> Image.Image:
    """A non-square RGB image with something to look at."""
    image = Image.new("RGB", size, (20, 20, 30))
    draw = ImageDraw.Draw(image)
    draw.rectangle([4, 4, size[0] // 3, size[1] // 2], fill=(220, 40, 40))
    draw.ellipse([size[0] // 2, size[1] // 3, size[0] - 4, size[1] - 4], fill=(40, 200, 60))
    return image


def _alphas(n_words: int, n_cells: int = L) -> np.ndarray:
    alphas = np.random.default_rng(n_words).random((n_words, n_cells))
    return alphas / alphas.sum(axis=1, keepdims=True)


# --- upsample_attention ---------------------------------------------------------------------


@pytest.mark.parametrize("r, c", [(0, 0), (1, 2), (2, 4), (2, 0)])
def test_nearest_one_hot_fills_exactly_its_cell(r, c):
    heat = upsample_attention(_one_hot(r * GRID[1] + c), GRID, (50, 30), smooth=False)
    assert heat.shape == (30, 50)
    expected = np.zeros((30, 50), dtype=bool)
    expected[r * 10 : (r + 1) * 10, c * 10 : (c + 1) * 10] = True
    np.testing.assert_array_equal(heat > 0, expected)
    np.testing.assert_allclose(heat[expected], 1.0)


@pytest.mark.parametrize("r, c", [(0, 0), (1, 2), (2, 4), (1, 3)])
def test_smooth_one_hot_peaks_inside_its_cell(r, c):
    heat = upsample_attention(_one_hot(r * GRID[1] + c), GRID, (50, 30), smooth=True)
    assert heat.shape == (30, 50)
    assert heat.min() >= 0
    y, x = np.unravel_index(np.argmax(heat), heat.shape)
    assert r * 10 <= y < (r + 1) * 10
    assert c * 10 <= x < (c + 1) * 10
    # Smoothing spreads weight beyond the cell, unlike nearest.
    assert (heat > 0).sum() > 100


def test_nearest_blocks_on_sizes_not_divisible_by_the_grid():
    # 640x427 on a 14x14 grid: every pixel takes one cell, each cell at least one block.
    heat = upsample_attention(np.arange(196.0), (14, 14), (640, 427), smooth=False)
    assert heat.shape == (427, 640)
    assert set(np.unique(heat)) == set(range(196))
    # Rows of pixels change cell only at the cell boundaries, in order.
    assert np.all(np.diff(heat[:, 0]) >= 0)
    assert np.all(np.diff(heat[0, :]) >= 0)


@pytest.mark.parametrize("smooth", [True, False])
@pytest.mark.parametrize(
    "alpha",
    [
        _alphas(1)[0],
        _alphas(1)[0].reshape(GRID),
        torch.from_numpy(_alphas(1)[0]).float(),
        torch.from_numpy(_alphas(1)[0]).float().reshape(GRID).requires_grad_(),
    ],
    ids=["flat-array", "2d-array", "flat-tensor", "2d-tensor-grad"],
)
def test_accepts_tensor_and_array_flat_and_2d(alpha, smooth):
    heat = upsample_attention(alpha, GRID, (37, 23), smooth=smooth)
    reference = upsample_attention(_alphas(1)[0], GRID, (37, 23), smooth=smooth)
    assert isinstance(heat, np.ndarray)
    assert heat.shape == (23, 37)
    assert heat.min() >= 0
    np.testing.assert_allclose(heat, reference, rtol=1e-5, atol=1e-7)


def test_upsample_never_negative():
    alpha = np.full(L, -1e-6)
    alpha[3] = 1.0
    for smooth in (True, False):
        assert upsample_attention(alpha, GRID, (50, 30), smooth=smooth).min() >= 0


@pytest.mark.parametrize(
    "alpha, match",
    [
        (np.ones(L + 1), "16 weights but grid 3x5 needs L = 15"),
        (np.ones((5, 3)), r"shape \(5, 3\)"),
        (np.ones((1, 3, 5)), r"shape \(1, 3, 5\)"),
        (np.array([np.nan] * L), "NaN"),
    ],
)
def test_upsample_rejects_bad_alpha(alpha, match):
    with pytest.raises(ValueError, match=match):
        upsample_attention(alpha, GRID, (50, 30))


@pytest.mark.parametrize("grid, size", [((0, 5), (50, 30)), ((3, 5), (0, 30)), ((3,), (50, 30))])
def test_upsample_rejects_bad_grid_or_size(grid, size):
    with pytest.raises(ValueError):
        upsample_attention(np.ones(L), grid, size)


# --- overlay_array --------------------------------------------------------------------------


def test_overlay_is_uint8_rgb_of_the_image_size():
    image = _photo().convert("L")  # any mode
    heat = upsample_attention(_one_hot(7), GRID, image.size)
    out = overlay_array(image, heat)
    assert out.dtype == np.uint8
    assert out.shape == (image.height, image.width, 3)


def test_overlay_scales_each_map_to_its_own_max():
    image = _photo()
    heat = upsample_attention(_one_hot(7), GRID, image.size, smooth=False)
    np.testing.assert_array_equal(overlay_array(image, heat), overlay_array(image, heat * 1e-3))
    # An all-zero map must not divide by zero.
    assert overlay_array(image, np.zeros_like(heat)).shape == (image.height, image.width, 3)


def test_overlay_opacity_zero_is_the_image():
    image = _photo()
    heat = upsample_attention(_one_hot(7), GRID, image.size)
    np.testing.assert_array_equal(overlay_array(image, heat, opacity=0.0), np.asarray(image))


def test_overlay_rejects_mismatched_heat():
    with pytest.raises(ValueError, match="heat has shape"):
        overlay_array(_photo((64, 40)), np.zeros((64, 40)))


# --- attention_grid_figure ------------------------------------------------------------------


def _words(n: int) -> list[str]:
    return [f"word{i}" for i in range(n)]


def test_grid_figure_writes_a_png_that_grows_in_rows(tmp_path):
    image = _photo((64, 40))
    short = attention_grid_figure(image, _words(3), _alphas(3), GRID, tmp_path / "a" / "s.png")
    long = attention_grid_figure(image, _words(12), _alphas(12), GRID, tmp_path / "b" / "l.png")
    assert short == tmp_path / "a" / "s.png"
    with Image.open(short) as small, Image.open(long) as big:
        assert small.format == big.format == "PNG"
        small.load()
        big.load()
        # 4 panels fit one row of 5; 13 panels need 3 rows.
        assert big.height > 2 * small.height
        assert big.width >= small.width


def test_grid_figure_with_chosen_cells_and_2d_tensor_alphas(tmp_path):
    image = _photo((80, 50))
    alphas = torch.from_numpy(_alphas(4)).reshape(4, *GRID)
    cells = [int(a.argmax()) for a in alphas.reshape(4, -1)]
    path = attention_grid_figure(
        image,
        ["a", "red", "$5", "<end>"],
        alphas,
        GRID,
        str(tmp_path / "hard.png"),
        smooth=False,
        chosen_cells=cells,
        columns=2,
        title="custom title",
    )
    with Image.open(path) as png:
        png.load()
        assert png.format == "PNG"
        assert png.width < png.height  # 5 panels in rows of 2


def test_grid_figure_on_a_photo_sized_image_and_many_words(tmp_path):
    path = attention_grid_figure(
        Image.new("RGB", (640, 427), (90, 120, 150)),
        _words(25),
        _alphas(25, 14 * 14),
        (14, 14),
        tmp_path / "photo.png",
    )
    with Image.open(path) as png:
        png.load()


def test_figures_are_written_at_zlibs_fastest_level(tmp_path):
    path = attention_grid_figure(_photo(), _words(3), _alphas(3), GRID, tmp_path / "f.png")
    data = path.read_bytes()
    idat = data.index(b"IDAT") + 4  # the chunk's data: a zlib stream
    assert data[idat] & 0x0F == 8  # deflate
    assert data[idat + 1] >> 6 == 0  # FLEVEL 0: the fastest levels (PIL's default 6 writes 2)


def test_grid_figure_is_safe_in_threads(tmp_path):
    errors: list[BaseException] = []

    def draw(i: int) -> None:
        try:
            attention_grid_figure(_photo(), _words(4), _alphas(4), GRID, tmp_path / f"{i}.png")
        except BaseException as error:  # reported by the main thread below
            errors.append(error)

    threads = [threading.Thread(target=draw, args=(i,)) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors
    for i in range(4):
        with Image.open(tmp_path / f"{i}.png") as png:
            png.load()


# --- attention_gif --------------------------------------------------------------------------


def test_gif_has_one_frame_per_word(tmp_path):
    words = ["a", "a", "red", "square", "<end>"]
    alphas = _alphas(5)
    alphas[1] = alphas[0]  # a repeated word with the same attention still gets its frame
    path = attention_gif(
        _photo((96, 60)), words, alphas, GRID, tmp_path / "g" / "a.gif", frame_ms=300
    )
    with Image.open(path) as gif:
        assert gif.format == "GIF"
        assert gif.n_frames == len(words)
        assert gif.info.get("loop") == 0
        assert gif.info.get("duration") == 300


def test_gif_with_chosen_cells(tmp_path):
    alphas = _alphas(3, 7 * 7)
    cells = [int(a.argmax()) for a in alphas]
    path = attention_gif(
        _photo(), ["x", "y", "z"], alphas, (7, 7), tmp_path / "h.gif", chosen_cells=cells
    )
    with Image.open(path) as gif:
        assert gif.n_frames == 3


# --- local centres and heads ----------------------------------------------------------------


def test_centre_position_maps_cells_to_pixels():
    # grid 3x5 over 50x30 px: cells of 10x10 px; the column gives x, the row y
    assert centre_position((1.5, 2.5), GRID, (50, 30)) == (25.0, 15.0)
    assert centre_position((0.0, 0.0), GRID, (50, 30)) == (0.0, 0.0)
    assert centre_position((3.0, 5.0), GRID, (50, 30)) == (50.0, 30.0)
    assert centre_position((1.0, 4.0), (2, 8), (64, 40)) == (32.0, 20.0)


def test_grid_marks_each_words_centre_with_a_cross(tmp_path):
    image = _photo((50, 30))
    centres = torch.tensor([[1.5, 2.5], [0.0, 0.0], [3.0, 5.0]])  # (T, 2) row, column
    fig = attention_grid(image, _words(3), _alphas(3), GRID, centres=centres)
    crosses = [list(ax.lines) for ax in fig.axes]
    assert crosses[0] == []  # the plain image has none
    # imshow puts pixel centres on integers: the image's edges are at -0.5
    drawn = [
        (float(line.get_xdata()[0]), float(line.get_ydata()[0]))
        for lines in crosses[1:]
        for line in lines
    ]
    assert drawn == [(24.5, 14.5), (-0.5, -0.5), (49.5, 29.5)]
    assert all(lines[0].get_marker() == "x" for lines in crosses[1:])
    assert [ax.get_xlim() for ax in fig.axes[1:]] == [(-0.5, 49.5)] * 3  # not widened
    without = attention_grid(image, _words(3), _alphas(3), GRID)
    assert all(len(ax.lines) == 0 for ax in without.axes)
    path = attention_grid_figure(
        image, _words(3), _alphas(3), GRID, tmp_path / "c.png", centres=centres.numpy()
    )
    with Image.open(path) as png:
        png.load()
    with Image.open(
        attention_gif(image, _words(3), _alphas(3), GRID, tmp_path / "c.gif", centres=centres)
    ) as gif:
        assert gif.n_frames == 3


@pytest.mark.parametrize("draw", [attention_grid_figure, attention_gif])
def test_centres_must_be_one_pair_per_word(tmp_path, draw):
    with pytest.raises(ValueError, match=r"shape \(3, 2\); got shape \(2, 2\)"):
        draw(_photo(), _words(3), _alphas(3), GRID, tmp_path / "x", centres=np.zeros((2, 2)))


def _heads(n_words: int, n_heads: int) -> np.ndarray:
    heads = np.random.default_rng(n_heads).random((n_words, n_heads, L))
    return heads / heads.sum(axis=2, keepdims=True)  # (T, H, L)


def test_heads_figure_has_a_row_per_head_and_the_mean(tmp_path):
    heads = _heads(4, 3)
    fig = heads_grid(_photo(), _words(4), heads, GRID, smooth=False, scale="word")
    assert len(fig.axes) == 4 * 4  # 3 heads and the mean, 4 words each
    assert [ax.get_ylabel() for ax in fig.axes[::4]] == ["head 1", "head 2", "head 3", "mean"]
    assert [ax.get_title() for ax in fig.axes[:4]] == _words(4)
    # the mean row shows the mean of the heads: the same panel as the mean map drawn alone
    mean = heads.mean(axis=1)
    alone = attention_grid(_photo(), _words(4), mean, GRID, smooth=False, scale="word")
    np.testing.assert_array_equal(
        fig.axes[12].images[0].get_array(), alone.axes[1].images[0].get_array()
    )
    path = heads_figure(
        _photo(),
        _words(4),
        torch.from_numpy(heads).reshape(4, 3, *GRID),
        GRID,
        tmp_path / "h" / "heads.png",
    )
    with Image.open(path) as png:
        png.load()
        assert png.format == "PNG" and png.height > png.width / 2  # 4 rows of 4 panels


@pytest.mark.parametrize(
    "heads, words, match",
    [
        (_heads(3, 2), 2, r"T = 2 words; got shape \(3, 2, 15\)"),
        (_heads(3, 2)[:, 0], 3, r"got shape \(3, 15\)"),
        (_heads(3, 2)[:, :, :14], 3, "14 weights but grid 3x5"),
        (np.zeros((0, 2, 15)), 0, "at least one word"),
    ],
)
def test_heads_figure_rejects_bad_heads(heads, words, match):
    with pytest.raises(ValueError, match=match):
        heads_grid(_photo(), _words(words), heads, GRID)


# --- bad inputs -----------------------------------------------------------------------------


@pytest.mark.parametrize("draw", [attention_grid_figure, attention_gif])
def test_word_and_alpha_counts_must_match(tmp_path, draw):
    with pytest.raises(ValueError, match="3 words but 4 attention rows"):
        draw(_photo(), _words(3), _alphas(4), GRID, tmp_path / "x.png")


@pytest.mark.parametrize("draw", [attention_grid_figure, attention_gif])
def test_alpha_length_must_match_the_grid(tmp_path, draw):
    with pytest.raises(ValueError, match="14 weights but grid 3x5 needs L = 15"):
        draw(_photo(), _words(3), _alphas(3, 14), GRID, tmp_path / "x.png")


@pytest.mark.parametrize("draw", [attention_grid_figure, attention_gif])
def test_chosen_cells_must_match_words_and_grid(tmp_path, draw):
    with pytest.raises(ValueError, match="3 words but 2 chosen_cells"):
        draw(_photo(), _words(3), _alphas(3), GRID, tmp_path / "x", chosen_cells=[0, 1])
    with pytest.raises(ValueError, match=r"\[0, 15\)"):
        draw(_photo(), _words(3), _alphas(3), GRID, tmp_path / "x", chosen_cells=[0, 1, 15])


def test_gif_needs_words(tmp_path):
    with pytest.raises(ValueError, match="at least one word"):
        attention_gif(_photo(), [], np.zeros((0, L)), GRID, tmp_path / "x.gif")


# --- the look on photographs: dimming, smoothness, whole image, scale, diacritics ---------


def _grey(size=(96, 64), level: int = 120) -> Image.Image:
    return Image.new("RGB", size, (level, level, level))


def test_dim_keeps_the_peak_and_dims_far_from_it():
    photo = np.asarray(_grey((96, 64)))
    heat = upsample_attention(_one_hot(24, 49), (7, 7), (96, 64))  # the centre cell
    peak_y, peak_x = np.unravel_index(np.argmax(heat), heat.shape)
    plain = dim_array(photo, heat, glow=0.0)
    # the peak keeps the photo's brightness, a far corner keeps the floor's share of it
    assert abs(int(plain[peak_y, peak_x, 0]) - 120) <= 1
    assert abs(int(plain[0, 0, 0]) - round(120 * DIM_FLOOR)) <= 1
    lit = dim_array(photo, heat)  # the default lightens the peak toward white
    assert int(lit[peak_y, peak_x, 0]) == round(120 + DIM_GLOW * (255 - 120))
    assert lit[0, 0, 0] < 0.3 * 120
    # brightness falls monotonically from the peak toward the edge along the middle row
    row = lit[peak_y, peak_x:, 0].astype(int)
    assert np.all(np.diff(row) <= 0) and row[0] - row[-1] > 80


def test_dim_scales_each_map_to_its_own_peak_and_checks_its_arguments():
    photo = _photo()
    heat = upsample_attention(_one_hot(7), GRID, photo.size)
    np.testing.assert_array_equal(dim_array(photo, heat), dim_array(photo, heat * 1e-3))
    np.testing.assert_array_equal(dim_array(photo, heat, floor=1.0, glow=0.0), np.asarray(photo))
    assert dim_array(photo, np.zeros_like(heat)).max() <= round(220 * DIM_FLOOR) + 1  # all dim
    with pytest.raises(ValueError, match="heat has shape"):
        dim_array(photo, heat.T)
    with pytest.raises(ValueError, match=r"floor must be in \[0, 1\], got 1.5"):
        dim_array(photo, heat, floor=1.5)


def test_smooth_map_has_no_jumps_or_kinks_unlike_nearest():
    # a one-hot 7x7 grid on a 224 px image, each neighbour step relative to the map's peak
    def steps(heat: np.ndarray, order: int) -> float:
        relative = heat / heat.max()
        return max(np.abs(np.diff(relative, order, axis=a)).max() for a in (0, 1))

    alpha = _one_hot(24, 49)
    smooth = upsample_attention(alpha, (7, 7), (224, 224), smooth=True)
    blocks = upsample_attention(alpha, (7, 7), (224, 224), smooth=False)
    assert steps(smooth, 1) < 0.04 and steps(blocks, 1) == 1.0
    # plain bilinear bends by 1/32 of the peak at each cell centre; the Gaussian removes that
    assert steps(smooth, 2) < 0.005
    # the blur spreads wider than the 3 x 3 cells around the peak (bilinear: 2 x 2 cells'
    # worth), and keeps the peak in its cell's middle
    assert (smooth > 0.01 * smooth.max()).mean() > 9 / 49
    y, x = np.unravel_index(np.argmax(smooth), smooth.shape)
    assert 96 <= y < 128 and 96 <= x < 128


def test_smooth_grid_keeps_the_mean_and_the_size():
    alpha = _alphas(1, 49)[0]
    work = smooth_grid(alpha, (7, 7))
    assert work.shape == (7 * 16, 7 * 16)
    assert work.mean() == pytest.approx(alpha.mean(), rel=0.01)  # edges extended: not exact


@pytest.mark.parametrize("cell, corner", [(0, (0, 0)), (48, (255, 383)), (6, (0, 383))])
def test_the_map_spans_the_whole_3_2_image(cell, corner):
    # the encoder sees the whole 384 x 256 photo squashed to a square: a corner cell's
    # weight lands in that corner of the photo, cells being 384/7 wide and 256/7 tall
    image = _grey((384, 256))
    heat = upsample_attention(_one_hot(cell, 49), (7, 7), image.size)
    assert heat.shape == (256, 384)
    y, x = np.unravel_index(np.argmax(heat), heat.shape)
    row, col = divmod(cell, 7)
    assert row * 256 / 7 <= y < (row + 1) * 256 / 7 and col * 384 / 7 <= x < (col + 1) * 384 / 7
    fig = attention_grid(image, ["a"], _one_hot(cell, 49)[None], (7, 7))
    panel = fig.axes[1].images[0].get_array()
    assert panel.shape == (256, 384, 3)  # the whole photo, at its own aspect ratio
    assert panel[corner][0] > 120 and panel[255 - corner[0], 383 - corner[1]][0] < 0.3 * 120


def test_figures_state_their_scale_and_each_words_peak():
    alphas = _alphas(3)
    fig = attention_grid(_photo(), ["một", "sân", "<end>"], alphas, GRID)
    titles = [ax.get_title() for ax in fig.axes[1:]]
    assert titles == [
        f"{word} ({alphas[t].max() * L:.1f}x even)"
        for t, word in enumerate(["một", "sân", "<end>"])
    ]
    texts = [text.get_text() for text in fig.texts]
    assert "dimmed 0" in texts and "1 bright" in texts
    assert any("one scale for every word" in t and "15 cells" in t for t in texts)
    fig = attention_grid(_photo(), ["một", "sân", "<end>"], alphas, GRID, scale="word")
    assert any("relative to each word's own peak" in t.get_text() for t in fig.texts)
    heads = _heads(2, 3)
    fig = heads_grid(_photo(), _words(2), heads, GRID)
    assert fig.axes[0].get_xlabel() == f"{heads[0, 0].max() * L:.1f}x even"
    assert "dimmed 0" in [text.get_text() for text in fig.texts]
    with pytest.raises(ValueError, match="scale must be one of 'caption', 'word'; got 'x'"):
        attention_grid(_photo(), _words(2), _alphas(2), GRID, scale="x")


def test_an_even_map_is_drawn_dim_beside_a_peaked_one():
    # two words look at one cell each, the third spreads evenly over the 15
    image = _grey((360, 240))
    alphas = np.stack([_one_hot(7), _one_hot(3), np.full(L, 1.0 / L)])
    fig = attention_grid(image, ["dog", "the", "a"], alphas, GRID, smooth=False)
    peaked, even = (fig.axes[i].images[0].get_array()[:, :, 0].astype(int) for i in (1, 3))
    assert fig.axes[3].get_title() == "a (1.0x even)"
    assert fig.axes[1].get_title() == "dog (15.0x even)"
    assert peaked.max() >= 120  # the attended cell keeps the photo's brightness
    # on the caption's scale (the median peak) the even map is 1/15 of it: nowhere near full
    assert even.max() <= 120 * (DIM_FLOOR + (1 - DIM_FLOOR) / L) + 3
    assert even.max() - even.min() <= 2  # and flat, not a vignette
    # on each word's own scale the even map is drawn at full brightness everywhere
    fig = attention_grid(image, ["dog", "the", "a"], alphas, GRID, smooth=False, scale="word")
    assert fig.axes[3].images[0].get_array()[:, :, 0].min() >= 118


def test_colour_style_keeps_the_old_overlay():
    image = _photo()
    alphas = _alphas(2)
    fig = attention_grid(image, _words(2), alphas, GRID, style="colour", scale="word")
    heat = upsample_attention(alphas[1], GRID, image.size)
    np.testing.assert_array_equal(fig.axes[2].images[0].get_array(), overlay_array(image, heat))
    dimmed = attention_grid(image, _words(2), alphas, GRID, scale="word")
    np.testing.assert_array_equal(dimmed.axes[2].images[0].get_array(), dim_array(image, heat))
    peak = np.median([upsample_attention(a, GRID, image.size).max() for a in alphas])
    shared = attention_grid(image, _words(2), alphas, GRID)  # one scale for the caption
    np.testing.assert_array_equal(
        shared.axes[2].images[0].get_array(), dim_array(image, heat, peak=peak)
    )
    with pytest.raises(ValueError, match="style must be one of 'dim', 'colour'; got 'jet'"):
        attention_grid(image, _words(2), alphas, GRID, style="jet")


def test_gif_frames_dim_the_photo_away_from_the_word(tmp_path):
    # a 360 x 240 grey photo, each word looking at another corner cell of a 3x5 grid
    image = _grey((360, 240))
    path = attention_gif(
        image, ["a", "b"], np.stack([_one_hot(0), _one_hot(14)]), GRID, tmp_path / "d.gif"
    )
    with Image.open(path) as gif:
        assert gif.n_frames == 2
        frames = []
        for index in range(2):
            gif.seek(index)
            frames.append(np.asarray(gif.convert("RGB")).astype(int))
    # (row, column) of the first and the last cell's centres, clear of the written text
    first, last = (40, 36), (200, 324)
    dimmed = 120 * DIM_FLOOR  # the grey level, a fifth of it
    assert frames[0][first][0] > 0.75 * 120 and abs(frames[0][last][0] - dimmed) <= 3
    assert frames[1][last][0] > 0.75 * 120 and abs(frames[1][first][0] - dimmed) <= 3


VIETNAMESE = "một người phụ nữ đang cầm vợt tennis trên sân đàn ông ử ậ ơ ư đ"


def test_vietnamese_draws_without_missing_glyphs(tmp_path):
    words = unicodedata.normalize("NFD", VIETNAMESE).split()  # marks as combining characters
    alphas = _alphas(len(words))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fig = attention_grid(_photo(), words, alphas, GRID, title=VIETNAMESE)
        fig.canvas.draw()
        attention_gif(_photo(), words, alphas, GRID, tmp_path / "vi.gif")
        heads_figure(_photo(), words[:3], _heads(3, 2), GRID, tmp_path / "vi.png")
    assert [str(w.message) for w in caught] == []
    # drawn composed, so that each letter is one DejaVu glyph with its marks in place
    assert fig.axes[1].get_title() == f"một ({alphas[0].max() * L:.1f}x even)"
    assert fig.axes[0].get_title().replace("\n", " ") == VIETNAMESE


# --- the web page draws the same map ---------------------------------------------------------


def test_page_declares_utf8_and_shows_the_whole_photo():
    page = PAGE.read_text("utf-8")
    assert '<meta charset="utf-8">' in page
    # the photo and the heatmap canvas fill a stage that takes the photo's aspect ratio: no
    # letterbox around the photo, no crop of it, and the canvas lies exactly on it
    layers = re.search(r"#photo, #heatmap \{([^}]*)\}", page).group(1)
    assert "width: 100%; height: 100%" in layers and "object-fit" not in layers
    assert "style.aspectRatio = `${photo.naturalWidth} / ${photo.naturalHeight}`" in page
    assert 'imageSmoothingQuality = "high"' in page
    assert "resized to `\n    + `${info.image_size} x ${info.image_size}" in page


@pytest.mark.skipif(shutil.which("node") is None, reason="node is not installed")
def test_page_map_matches_the_figures():
    """The page's smoothGrid and dimLayer (run in node) give the figures' smooth_grid and
    dim_array: the same map, and the same pixels once the layer is drawn over the photo."""
    page = PAGE.read_text("utf-8")
    code = page[page.index("// map-begin") : page.index("// map-end")]
    cells = np.random.default_rng(0).random(GRID)
    cells[1, 2] = 4.0
    script = code + textwrap.dedent(f"""
        const grid = smoothGrid({json.dumps(cells.ravel().tolist())}, {GRID[0]}, {GRID[1]});
        console.log(JSON.stringify({{map: Array.from(grid.map), width: grid.width,
                                     layer: Array.from(dimLayer(grid.map))}}));
    """)
    run = subprocess.run(["node", "-e", script], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    answer = json.loads(run.stdout)
    expected = smooth_grid(cells, GRID)
    got = np.array(answer["map"]).reshape(-1, answer["width"])
    np.testing.assert_allclose(got, expected, rtol=1e-9, atol=1e-12)
    layer = np.array(answer["layer"], dtype=np.float64).reshape(*expected.shape, 4) / 255.0
    photo = np.random.default_rng(1).integers(0, 256, (*expected.shape, 3)).astype(np.uint8)
    drawn = photo * (1 - layer[..., 3:]) + 255 * layer[..., :3] * layer[..., 3:]
    np.testing.assert_allclose(drawn, dim_array(photo, expected), atol=2.0)  # 8-bit layer


# --- no pyplot ------------------------------------------------------------------------------


def test_no_pyplot_import(tmp_path):
    script = textwrap.dedent(
        f"""
        import sys
        import numpy as np
        from PIL import Image
        from captioning.figures.gif import attention_gif
        from captioning.figures.heatmaps import attention_grid_figure
        from captioning.figures.maps import upsample_attention

        image = Image.new("RGB", (40, 30))
        alphas = np.full((2, 6), 1 / 6)
        upsample_attention(alphas[0], (2, 3), (40, 30))
        attention_grid_figure(image, ["a", "b"], alphas, (2, 3), {str(tmp_path / "f.png")!r})
        attention_gif(image, ["a", "b"], alphas, (2, 3), {str(tmp_path / "f.gif")!r})
        assert "matplotlib.pyplot" not in sys.modules, "pyplot was imported"
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "f.png").is_file()
    assert (tmp_path / "f.gif").is_file()
