"""Which formats are read, and the bounded decode the web demo uses (``reduce_to``,
``reserve``): a large picture comes back reduced, close to what the full-size decode gives."""

from __future__ import annotations

import io
import subprocess
from contextlib import contextmanager

import numpy as np
import pytest
from PIL import Image

from captioning.data.images import (
    FORMATS,
    NOT_AN_IMAGE,
    as_rgb,
    check_image,
    image_type,
    load_image,
    load_image_bytes,
)
from captioning.errors import DataError

ALLOWED = {"JPEG": "jpg", "PNG": "png", "WEBP": "webp", "GIF": "gif", "BMP": "bmp", "TIFF": "tif"}
REFUSED = ["EPS", "PDF", "ICO", "TGA", "PPM", "SGI", "PCX", "QOI"]


def _encoded(image: Image.Image, fmt: str, **kwargs) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, fmt, **kwargs)
    return buffer.getvalue()


def _gradient(width: int, height: int) -> Image.Image:
    """A smooth colour picture: reductions of it must stay close to each other."""
    x = np.linspace(0, 255, width)[None, :].repeat(height, 0)
    y = np.linspace(0, 255, height)[:, None].repeat(width, 1)
    return Image.fromarray(np.stack([x, y, 255 - x], -1).astype(np.uint8))


@pytest.mark.parametrize("fmt", list(ALLOWED))
def test_the_six_formats_are_read(tmp_path, fmt):
    path = tmp_path / f"a.{ALLOWED[fmt]}"
    Image.new("RGB", (6, 4), (200, 40, 10)).save(path, fmt)
    assert load_image(path).size == (6, 4)
    assert load_image_bytes(path.read_bytes()).size == (6, 4)
    assert image_type(path) == f"image/{'jpeg' if fmt == 'JPEG' else fmt.lower()}"
    assert set(FORMATS) == set(ALLOWED)


@pytest.mark.parametrize("fmt", REFUSED)
def test_other_formats_are_not_images_even_named_png(tmp_path, fmt, monkeypatch):
    ran = []
    for name in ("Popen", "run", "call", "check_call", "check_output"):
        monkeypatch.setattr(subprocess, name, lambda *a, **k: ran.append(a))
    path = tmp_path / "photo.png"
    path.write_bytes(_encoded(Image.new("RGB", (8, 8)), fmt))
    with pytest.raises(DataError) as caught:
        load_image(path)
    assert str(caught.value) == f"{path}: {NOT_AN_IMAGE}"
    with pytest.raises(DataError, match=f"^photo.png: {NOT_AN_IMAGE}$"):
        load_image_bytes(path.read_bytes(), "photo.png")
    assert image_type(path) is None and ran == []


def test_messages_name_the_problem_not_the_library(tmp_path):
    """Truncated and corrupt files: one line, no Pillow wording, no paths of the server."""
    data = _encoded(_gradient(64, 48), "PNG")
    messages = []
    for cut in (data[: len(data) // 2], data[:60], data[:20] + b"\0" * 40 + data[60:]):
        with pytest.raises(DataError) as caught:
            load_image_bytes(cut, "x.png")
        messages.append(str(caught.value))
    assert all(m.startswith("x.png: ") and "\n" not in m for m in messages)
    assert not any(word in m for m in messages for word in ("PIL", "Pillow", "Errno", "/"))
    assert messages[0] == "x.png: image is truncated or corrupt; save or download it again"


def test_a_nul_byte_in_a_path_is_one_line(tmp_path):
    path = f"{tmp_path}/a\0b.png"
    with pytest.raises(DataError) as caught:
        load_image(path)
    assert str(caught.value) == (
        f"{tmp_path}/a\\0b.png: the path holds a NUL byte; give the file's real path"
    )
    assert check_image(path).startswith("the path holds a NUL byte")


def test_an_image_without_pixels_is_refused():
    with pytest.raises(DataError, match=r"^image: image is 0 x 3 pixels: there is nothing"):
        as_rgb(Image.new("RGB", (0, 3)))


def test_an_open_file_is_read_from_its_start(tmp_path):
    upload = io.BytesIO(_encoded(Image.new("RGB", (6, 4), (9, 9, 9)), "PNG"))
    upload.seek(10)
    assert load_image_bytes(upload).getpixel((0, 0)) == (9, 9, 9)
    with pytest.raises(DataError, match="^upload: file is empty"):
        load_image_bytes(io.BytesIO())


# --- the bounded decode -----------------------------------------------------------------------


def _close(a: Image.Image, b: Image.Image, side: int) -> float:
    """Mean absolute difference (0-255) of two pictures resized to ``side`` x ``side``."""
    resized = [np.asarray(im.resize((side, side), Image.BICUBIC), np.float64) for im in (a, b)]
    return float(np.abs(resized[0] - resized[1]).mean())


def test_a_small_image_is_not_reduced():
    data = _encoded(_gradient(90, 70), "PNG")
    full = load_image_bytes(data)
    reduced = load_image_bytes(data, reduce_to=40)  # 90 // 80 = 1: nothing to gain
    assert reduced.size == (90, 70) and np.array_equal(np.asarray(reduced), np.asarray(full))


@pytest.mark.parametrize("fmt", ["PNG", "JPEG", "TIFF", "WEBP"])
def test_a_large_image_comes_back_reduced_and_close(fmt):
    data = _encoded(_gradient(500, 350), fmt)
    full = load_image_bytes(data)
    reduced = load_image_bytes(data, reduce_to=32)
    assert full.size == (500, 350)
    assert all(64 <= side <= 2 * 64 for side in reduced.size)  # kept at least twice 32
    assert reduced.mode == "RGB" and _close(full, reduced, 32) < 2.0


def test_a_jpeg_is_decoded_at_reduced_scale():
    """DCT scaling: only an eighth of the pixels are ever decoded (the reservation says so)."""
    data = _encoded(_gradient(1024, 768), "JPEG", quality=90)
    reserved = []

    @contextmanager
    def reserve(pixels: int):
        reserved.append(pixels)
        yield

    reduced = load_image_bytes(data, reduce_to=50, reserve=reserve)
    assert reserved == [256 * 192]  # scale 1/4 keeps both sides at least 100
    assert reduced.size == (128, 192)  # then the width is box-reduced by 2
    assert _close(load_image_bytes(data), reduced, 50) < 2.0


MODES = {
    "palette with transparency": lambda im: _with_hole(im.quantize(64), "P"),
    "rgba": lambda im: _with_hole(im.convert("RGBA"), "RGBA"),
    "16-bit grey": lambda im: Image.fromarray(np.asarray(im.convert("L"), np.uint16) * 257),
    "bilevel": lambda im: im.convert("1"),
    "grey with alpha": lambda im: _with_hole(im.convert("LA"), "LA"),
}


def _with_hole(image: Image.Image, mode: str) -> Image.Image:
    """``image`` with a transparent block (shown white after loading)."""
    if mode == "P":
        image.info["transparency"] = 0
        pixels = np.asarray(image).copy()
        pixels[50:150, 50:150] = 0
        out = Image.fromarray(pixels, "P")
        out.putpalette(image.getpalette())
        out.info["transparency"] = 0
        return out
    alpha = np.full(image.size[::-1], 255, np.uint8)
    alpha[50:150, 50:150] = 0
    image.putalpha(Image.fromarray(alpha))
    return image


@pytest.mark.parametrize("kind", list(MODES))
def test_every_mode_reduces_to_what_the_full_decode_shows(kind):
    data = _encoded(MODES[kind](_gradient(400, 300)), "PNG")
    full = load_image_bytes(data)
    reduced = load_image_bytes(data, reduce_to=25)
    assert reduced.size == (400 // 8, 300 // 6) and reduced.mode == "RGB"
    limit = 12.0 if kind == "bilevel" else 2.0  # dithered dots average to grey either way
    assert _close(full, reduced, 25) < limit
    if kind not in ("16-bit grey", "bilevel"):
        assert reduced.getpixel((12, 16)) == (255, 255, 255)  # the hole, over white


def test_the_exif_orientation_applies_to_a_reduced_image():
    picture = _gradient(400, 200)
    exif = Image.Exif()
    exif[0x0112] = 6  # rotate 90 degrees clockwise to show
    data = _encoded(picture, "JPEG", exif=exif.tobytes(), quality=95)
    full, reduced = load_image_bytes(data), load_image_bytes(data, reduce_to=15)
    assert full.size == (200, 400) and reduced.size != full.size
    assert _close(full, reduced, 15) < 3.0
    assert _close(full.transpose(Image.Transpose.ROTATE_90), reduced, 15) > 20  # it can fail
