from __future__ import annotations

import math
import warnings
from contextlib import contextmanager

import numpy as np
import pytest
from PIL import Image, ImageFile, features

from captioning.data.images import (
    MAX_JPEG_SCANS,
    NOT_AN_IMAGE,
    ImageLimits,
    check_image,
    check_images,
    jpeg_scans,
    load_image,
    load_image_bytes,
)
from captioning.errors import CaptioningError, DataError

W, H = 6, 4


def _save(image: Image.Image, path, **kwargs) -> str:
    image.save(path, **kwargs)
    return str(path)


def _loaded(path) -> Image.Image:
    image = load_image(path)
    assert image.mode == "RGB"
    assert image.size == (W, H)
    return image


def _noise_jpeg(path, size=(64, 48)) -> str:
    pixels = np.random.default_rng(0).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    return _save(Image.fromarray(pixels), path, quality=90)


# --- modes ---------------------------------------------------------------------------------


def test_rgb_is_kept(tmp_path):
    path = _save(Image.new("RGB", (W, H), (10, 200, 30)), tmp_path / "a.png")
    assert _loaded(path).getpixel((0, 0)) == (10, 200, 30)


def test_grey(tmp_path):
    path = _save(Image.new("L", (W, H), 77), tmp_path / "a.png")
    assert _loaded(path).getpixel((3, 2)) == (77, 77, 77)


def test_bilevel(tmp_path):
    image = Image.new("1", (W, H), 0)
    image.putpixel((1, 1), 1)
    image = _loaded(_save(image, tmp_path / "a.png"))
    assert image.getpixel((0, 0)) == (0, 0, 0)
    assert image.getpixel((1, 1)) == (255, 255, 255)


def test_rgba_composites_over_white(tmp_path):
    # The transparent pixel holds blue, which dropping alpha would expose.
    image = Image.new("RGBA", (W, H), (0, 0, 255, 0))
    image.putpixel((1, 1), (255, 0, 0, 255))
    image.putpixel((2, 1), (0, 0, 0, 128))
    image = _loaded(_save(image, tmp_path / "a.png"))
    assert image.getpixel((0, 0)) == (255, 255, 255)
    assert image.getpixel((1, 1)) == (255, 0, 0)
    assert all(abs(v - 127) <= 1 for v in image.getpixel((2, 1)))


def test_grey_alpha(tmp_path):
    image = Image.new("LA", (W, H), (0, 0))
    image.putpixel((1, 1), (40, 255))
    image = _loaded(_save(image, tmp_path / "a.png"))
    assert image.getpixel((0, 0)) == (255, 255, 255)
    assert image.getpixel((1, 1)) == (40, 40, 40)


def _palette_image() -> Image.Image:
    image = Image.new("P", (W, H), 0)
    image.putpalette([0, 0, 255, 255, 0, 0] + [0, 0, 0] * 254)
    image.putpixel((1, 1), 1)
    return image


def test_palette_without_transparency(tmp_path):
    image = _loaded(_save(_palette_image(), tmp_path / "a.png"))
    assert image.getpixel((0, 0)) == (0, 0, 255)
    assert image.getpixel((1, 1)) == (255, 0, 0)


@pytest.mark.parametrize("suffix", ["png", "gif"])
def test_palette_with_transparency(tmp_path, suffix):
    path = _save(_palette_image(), tmp_path / f"a.{suffix}", transparency=0)
    assert Image.open(path).mode == "P"
    image = _loaded(path)
    assert image.getpixel((0, 0)) == (255, 255, 255)
    assert image.getpixel((1, 1)) == (255, 0, 0)


def test_palette_alpha(tmp_path):
    image = _palette_image().convert("PA")
    image.putpixel((0, 0), (0, 0))
    image.putpixel((1, 1), (1, 255))
    path = tmp_path / "a.tif"
    try:
        image.save(path)
    except OSError:
        pytest.skip("this PIL cannot save mode PA")
    assert Image.open(path).mode == "PA"
    image = _loaded(path)
    assert image.getpixel((0, 0)) == (255, 255, 255)
    assert image.getpixel((1, 1)) == (255, 0, 0)


def test_grey_with_transparent_value(tmp_path):
    image = Image.new("L", (W, H), 0)
    image.putpixel((1, 1), 90)
    image = _loaded(_save(image, tmp_path / "a.png", transparency=0))
    assert image.getpixel((0, 0)) == (255, 255, 255)
    assert image.getpixel((1, 1)) == (90, 90, 90)


@pytest.mark.parametrize("suffix", ["jpg", "tif"])
def test_cmyk(tmp_path, suffix):
    path = _save(Image.new("CMYK", (W, H), (0, 255, 255, 0)), tmp_path / f"a.{suffix}")
    assert Image.open(path).mode == "CMYK"
    r, g, b = _loaded(path).getpixel((2, 2))
    assert r > 200 and g < 60 and b < 60


def test_ycbcr(tmp_path):
    path = _save(Image.new("RGB", (W, H), (255, 0, 0)).convert("YCbCr"), tmp_path / "a.tif")
    assert Image.open(path).mode == "YCbCr"
    r, g, b = _loaded(path).getpixel((0, 0))
    assert r > 240 and g < 15 and b < 15


@pytest.mark.parametrize("mode", ["I;16", "I;16B"])
def test_16bit_grey_is_scaled_not_clipped(tmp_path, mode):
    values = np.array([[0, 65535, 32768, 1000, 257, 65535]] * H, dtype=np.uint16)
    # Not convert("I;16B"): PIL clips every value to 255 on the way.
    image = Image.frombytes(
        mode, (W, H), values.astype(">u2" if mode == "I;16B" else "<u2").tobytes()
    )
    path = _save(image, tmp_path / ("a.png" if mode == "I;16" else "a.tif"))
    assert Image.open(path).mode == mode
    image = _loaded(path)
    assert [image.getpixel((x, 0))[0] for x in range(W)] == [0, 255, 128, 4, 1, 255]
    assert image.getpixel((3, 1)) == (4, 4, 4)


def test_int32_grey_is_stretched_by_range(tmp_path):
    values = np.array([[-100, 0, 100, 300, 70000, 300]] * H, dtype=np.int32)
    path = _save(Image.fromarray(values), tmp_path / "a.tif")
    assert Image.open(path).mode == "I"
    image = _loaded(path)
    expected = np.rint((values[0] + 100) * 255 / 70100).astype(int).tolist()
    assert [image.getpixel((x, 0))[0] for x in range(W)] == expected
    assert expected[0] == 0 and expected[4] == 255


def test_float_grey_is_stretched_by_range(tmp_path):
    values = np.array([[0.0, 0.25, 0.5, 1.0, 0.5, 0.5]] * H, dtype=np.float32)
    path = _save(Image.fromarray(values), tmp_path / "a.tif")
    assert Image.open(path).mode == "F"
    image = _loaded(path)
    assert [image.getpixel((x, 0))[0] for x in range(W)] == [0, 64, 128, 255, 128, 128]


@pytest.mark.parametrize(("mode", "value", "expected"), [("F", 0.5, 0), ("I", 70000, 255)])
def test_constant_wide_grey_keeps_its_clipped_value(tmp_path, mode, value, expected):
    path = _save(Image.new(mode, (W, H), value), tmp_path / "a.tif")
    assert _loaded(path).getpixel((0, 0)) == (expected,) * 3


def test_nan_in_float_image(tmp_path):
    values = np.array([[np.nan, 0.0, 2.0, 1.0, 1.0, 1.0]] * H, dtype=np.float32)
    image = _loaded(_save(Image.fromarray(values), tmp_path / "a.tif"))
    assert [image.getpixel((x, 0))[0] for x in range(3)] == [0, 0, 255]


def test_animated_gif_uses_first_frame(tmp_path):
    frames = [Image.new("RGB", (W, H), colour) for colour in [(255, 0, 0), (0, 255, 0)]]
    path = tmp_path / "a.gif"
    frames[0].save(path, save_all=True, append_images=frames[1:], duration=100)
    assert Image.open(path).n_frames == 2
    assert _loaded(path).getpixel((0, 0)) == (255, 0, 0)


@pytest.mark.parametrize("suffix", ["bmp", "tif", "gif"])
def test_other_formats(tmp_path, suffix):
    path = _save(Image.new("RGB", (W, H), (255, 0, 0)), tmp_path / f"a.{suffix}")
    assert _loaded(path).getpixel((0, 0)) == (255, 0, 0)


def test_webp_round_trip(tmp_path):
    if not features.check("webp"):
        pytest.skip("PIL built without WebP support")
    image = Image.new("RGBA", (W, H), (0, 0, 255, 0))
    image.putpixel((1, 1), (255, 0, 0, 255))
    path = _save(image, tmp_path / "a.webp", lossless=True)
    image = _loaded(path)
    assert image.getpixel((0, 0)) == (255, 255, 255)
    assert image.getpixel((1, 1)) == (255, 0, 0)


def test_result_holds_no_open_file(tmp_path):
    path = _save(Image.new("RGB", (W, H)), tmp_path / "a.png")
    image = load_image(path)
    assert getattr(image, "fp", None) is None
    (tmp_path / "a.png").unlink()
    assert image.getpixel((0, 0)) == (0, 0, 0)


# --- EXIF orientation -----------------------------------------------------------------------


@pytest.mark.parametrize(("orientation", "red_corner"), [(6, (3, 0)), (8, (0, 5)), (1, (0, 0))])
def test_exif_orientation(tmp_path, orientation, red_corner):
    # Stored 6 wide, 4 high with a red block at the stored top-left; 6 means "rotate 90
    # clockwise to display", which moves that corner to the top-right, 8 to the bottom-left.
    image = Image.new("RGB", (W, H), (255, 255, 255))
    image.paste((255, 0, 0), (0, 0, 2, 2))
    exif = image.getexif()
    exif[0x0112] = orientation
    path = _save(image, tmp_path / "a.jpg", exif=exif, quality=95)
    loaded = load_image(path)
    assert loaded.size == ((W, H) if orientation == 1 else (H, W))
    r, g, b = loaded.getpixel(red_corner)
    assert r > 200 and g < 60 and b < 60
    width, height = loaded.size
    for corner in {(0, 0), (width - 1, 0), (0, height - 1), (width - 1, height - 1)} - {red_corner}:
        assert min(loaded.getpixel(corner)) > 200


# --- bad files ------------------------------------------------------------------------------


def _assert_bad(path, problem_start: str) -> None:
    with pytest.raises(DataError) as caught:
        load_image(path)
    message = str(caught.value)
    assert isinstance(caught.value, CaptioningError)
    assert message.startswith(f"{path}: {problem_start}")
    assert "\n" not in message
    problem = check_image(path)
    assert problem is not None and problem.startswith(problem_start)


def test_missing_file(tmp_path):
    _assert_bad(str(tmp_path / "missing.png"), "no such file")


def test_missing_parent_is_a_file(tmp_path):
    path = _save(Image.new("RGB", (W, H)), tmp_path / "a.png")
    _assert_bad(f"{path}/b.png", "no such file")


def test_directory(tmp_path):
    _assert_bad(str(tmp_path), "is a directory, not an image")


def test_empty_file(tmp_path):
    path = tmp_path / "a.png"
    path.touch()
    _assert_bad(str(path), "file is empty (0 bytes)")


def test_text_named_jpg(tmp_path):
    path = tmp_path / "a.jpg"
    path.write_text("not really a picture\n")
    _assert_bad(path, NOT_AN_IMAGE)


def test_truncated_jpeg(tmp_path):
    path = tmp_path / "a.jpg"
    data = open(_noise_jpeg(path), "rb").read()
    path.write_bytes(data[: len(data) // 2])
    _assert_bad(str(path), "image is truncated or corrupt;")


def test_truncated_png(tmp_path):
    path = tmp_path / "a.png"
    pixels = np.random.default_rng(0).integers(0, 256, (48, 64, 3), dtype=np.uint8)
    data = open(_save(Image.fromarray(pixels), path), "rb").read()
    path.write_bytes(data[: len(data) // 2])
    _assert_bad(str(path), "image is truncated or corrupt;")


def test_decompression_bomb(tmp_path, monkeypatch):
    path = _save(Image.new("RGB", (W, H)), tmp_path / "a.png")
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 5)
    _assert_bad(path, "image is too large to decode safely (")


def test_unsupported_mode(tmp_path, monkeypatch):
    from captioning.data import images

    monkeypatch.setattr(images, "_CONVERTIBLE_MODES", frozenset())
    path = _save(Image.new("L", (W, H)), tmp_path / "a.png")
    _assert_bad(path, "unsupported image mode 'L'")


def test_truncated_images_flag_is_left_false(tmp_path):
    path = tmp_path / "a.jpg"
    data = open(_noise_jpeg(path), "rb").read()
    path.write_bytes(data[: len(data) // 2])
    check_images([str(path)] * 4, num_threads=2)
    assert ImageFile.LOAD_TRUNCATED_IMAGES is False


def test_warns_when_someone_else_allows_truncated_images(tmp_path, monkeypatch):
    path = _noise_jpeg(tmp_path / "a.jpg")
    monkeypatch.setattr(ImageFile, "LOAD_TRUNCATED_IMAGES", True)
    with pytest.warns(RuntimeWarning, match="LOAD_TRUNCATED_IMAGES"):
        load_image(path)


def test_good_image_gives_no_problem_and_no_warning(tmp_path):
    path = _noise_jpeg(tmp_path / "a.jpg")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert check_image(path) is None


# --- check_images ---------------------------------------------------------------------------


@pytest.mark.parametrize("progress", [False, True])
def test_check_images_lists_bad_ones_in_order(tmp_path, progress):
    good = [_noise_jpeg(tmp_path / f"good{i}.jpg") for i in range(6)]
    empty = tmp_path / "empty.png"
    empty.touch()
    text = tmp_path / "text.jpg"
    text.write_text("hello")
    truncated = tmp_path / "cut.jpg"
    truncated.write_bytes(open(good[0], "rb").read()[:300])
    missing = str(tmp_path / "missing.jpg")
    paths = [
        good[0],
        str(truncated),
        good[1],
        good[2],
        missing,
        str(empty),
        good[3],
        str(text),
        good[4],
        good[5],
    ]
    bad = check_images(paths, num_threads=4, progress=progress)
    assert [path for path, _ in bad] == [str(truncated), missing, str(empty), str(text)]
    assert bad[1] == (missing, "no such file")
    assert bad[2] == (str(empty), "file is empty (0 bytes)")
    assert bad[3] == (str(text), NOT_AN_IMAGE)
    assert bad[0][1].startswith("image is truncated or corrupt;")


def test_check_images_all_good_and_empty(tmp_path):
    paths = [_noise_jpeg(tmp_path / f"{i}.jpg") for i in range(3)]
    assert check_images(paths, num_threads=3) == []
    assert check_images([], num_threads=2) == []
    with pytest.raises(ValueError):
        check_images(paths, num_threads=0)


def _png_declaring(path, width: int, height: int) -> str:
    """A small PNG whose header declares ``width`` x ``height`` (its pixel data is short)."""
    import struct
    import zlib

    data = bytearray(open(_save(Image.new("RGB", (W, H)), path), "rb").read())
    ihdr = data.index(b"IHDR")
    data[ihdr + 4 : ihdr + 12] = struct.pack(">II", width, height)
    crc = zlib.crc32(bytes(data[ihdr : ihdr + 17])) & 0xFFFFFFFF
    data[ihdr + 17 : ihdr + 21] = struct.pack(">I", crc)
    path.write_bytes(bytes(data))
    return str(path)


def test_an_image_past_the_pixel_limit_is_refused_before_decoding(tmp_path):
    big = _png_declaring(tmp_path / "big.png", 12000, 12000)
    good = _save(Image.new("RGB", (W, H)), tmp_path / "good.png")
    _assert_bad(
        big,
        "image is 12000 x 12000 = 144,000,000 pixels, more than data.max_image_pixels=64,000,000",
    )
    assert check_image(good, ImageLimits(max_pixels=W * H)) is None
    assert "more than data.max_image_pixels=23" in check_image(
        good, ImageLimits(max_pixels=W * H - 1)
    )
    assert check_images([good, big, good]) == [(big, check_image(big))]


def test_a_png_whose_text_chunk_inflates_past_the_limit_is_a_bad_image(tmp_path):
    from PIL.PngImagePlugin import PngInfo

    info = PngInfo()
    info.add_text("comment", "x" * (3 << 20), zip=True)  # 3 MB of text, a few KB on disk
    path = _save(Image.new("RGB", (W, H)), tmp_path / "text.png", pnginfo=info)
    assert (tmp_path / "text.png").stat().st_size < 50_000
    _assert_bad(path, "image metadata is too large to read safely (")
    assert "data.max_image_text_bytes=1,048,576" in check_image(path)
    assert check_image(path, ImageLimits(max_text_bytes=8 << 20)) is None  # configurable
    assert check_image(path) is not None  # and back
    good = _save(Image.new("RGB", (W, H)), tmp_path / "good.png")
    assert check_images([path, good]) == [(path, check_image(path))]


def _progressive(path, repeats: int = 0) -> bytes:
    """A progressive JPEG with its last scan repeated ``repeats`` more times (libjpeg decodes
    each repeat as another pass over the whole image)."""
    pixels = np.random.default_rng(0).integers(0, 256, (96, 128, 3), dtype=np.uint8)
    Image.fromarray(pixels).save(path, "JPEG", progressive=True, quality=90)
    data = path.read_bytes()
    last, end = data.rfind(b"\xff\xda"), data.rfind(b"\xff\xd9")
    data = data[:end] + data[last:end] * repeats + data[end:]
    path.write_bytes(data)
    return data


def test_a_jpeg_with_too_many_scans_is_refused_before_decoding(tmp_path):
    plain = tmp_path / "plain.jpg"
    data = _progressive(plain)
    assert 2 <= jpeg_scans(plain) <= 20  # what an encoder writes
    assert load_image(plain).size == (128, 96)
    bomb = tmp_path / "bomb.jpg"
    data = _progressive(bomb, repeats=MAX_JPEG_SCANS)
    assert jpeg_scans(bomb) > MAX_JPEG_SCANS
    for load in (lambda: load_image(bomb), lambda: load_image_bytes(data, "bomb.jpg")):
        with pytest.raises(
            DataError, match=f"bomb.jpg: JPEG has [0-9,]+ scans, more than the {MAX_JPEG_SCANS}"
        ):
            load()
    assert "scans" in check_image(bomb)
    # an open file is read from its start and left where it was
    with open(bomb, "rb") as handle:
        handle.seek(7)
        assert jpeg_scans(handle) == jpeg_scans(bomb) and handle.tell() == 7


def test_scans_are_counted_across_chunk_boundaries(tmp_path, monkeypatch):
    path = tmp_path / "x.jpg"
    path.write_bytes(b"\x00" * ((1 << 20) - 1) + b"\xff\xda" + b"\xff\xda")
    assert jpeg_scans(path) == 2


@pytest.mark.parametrize(
    "mode, info, share",
    [
        ("I;16", {}, 6 / 4),
        ("P", {"transparency": 0}, 5 / 4),
        ("P", {}, 1.0),
        ("RGB", {}, 1.0),
    ],
)
def test_the_pixels_reserved_count_what_converting_holds(tmp_path, mode, info, share):
    """load_image_bytes reserves the picture's pixels in 4-byte units: more for the modes
    whose conversion to RGB holds more than 4 bytes a pixel."""
    image = Image.new(mode, (40, 25))
    path = tmp_path / "x.png"
    image.save(path, **info)
    asked = []

    @contextmanager
    def reserve(pixels):
        asked.append(pixels)
        yield

    load_image_bytes(path.read_bytes(), "x.png", reserve=reserve)
    assert asked == [math.ceil(40 * 25 * share)]
