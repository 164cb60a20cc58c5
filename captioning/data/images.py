"""Loading image files as 8-bit RGB, and finding the ones that cannot be loaded."""

from __future__ import annotations

import io
import os
import stat
import warnings
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import BinaryIO

import numpy as np
from PIL import Image, ImageFile, ImageOps, PngImagePlugin, UnidentifiedImageError

from captioning.config import DataConfig
from captioning.errors import DataError
from captioning.progress import progress_bar
from captioning.runtime import map_in_threads

# The only formats read: raster formats that Pillow decodes in its own process. Pillow knows
# others, and some run a program on the file (EPS and PostScript run Ghostscript) or are no
# picture (PDF, ICNS, ...): a file in any of them is "not an image" before anything is decoded.
FORMATS = ("JPEG", "PNG", "WEBP", "GIF", "BMP", "TIFF")
# libjpeg walks every block of a progressive image once per scan, and a scan can be a few
# bytes: a 125 KB file that repeats one scan 1,000 times costs 11 s of CPU to decode. A
# camera or an editor writes about ten scans; libjpeg-turbo's own tools cap them too.
MAX_JPEG_SCANS = 100
# What a browser is told each format is (a JPEG with a multi-picture extension opens as MPO).
MIME_TYPES = {
    "JPEG": "image/jpeg",
    "MPO": "image/jpeg",
    "PNG": "image/png",
    "WEBP": "image/webp",
    "GIF": "image/gif",
    "BMP": "image/bmp",
    "TIFF": "image/tiff",
}
NOT_AN_IMAGE = "not a JPEG, PNG, WebP, GIF, BMP or TIFF image"

_WIDE_16BIT_MODES = frozenset({"I;16", "I;16B", "I;16L", "I;16N"})
_WIDE_RANGE_MODES = frozenset({"I", "F"})
_ALPHA_MODES = frozenset({"RGBA", "LA", "PA", "La", "RGBa"})
# Modes whose convert("RGB") is a real colour conversion, not a clip or a byte copy.
_CONVERTIBLE_MODES = frozenset({"1", "L", "P", "CMYK", "YCbCr", "LAB", "HSV", "RGBX"})


@dataclass(frozen=True)
class ImageLimits:
    """The one place that decides how large an image file may be (``data.max_image_pixels``
    and ``data.max_image_text_bytes``).

    Pillow only warns below 2 x ``Image.MAX_IMAGE_PIXELS`` (179M pixels), so a 140 KB PNG
    that declares 12000 x 12000 would be decoded in full (1.6 GB). Here the size is read from
    the header and checked before any pixel is decoded; 64M pixels (8000 x 8000) is more than
    any camera photo in common use. A PNG text or ICC chunk is decompressed whole when the
    file is opened: Pillow's limit for one chunk (``PngImagePlugin.MAX_TEXT_CHUNK``) is set
    from ``max_text_bytes``, and for all of a file's text to four times that; a file past
    either is a bad image like any other.
    """

    max_pixels: int = 64_000_000
    max_text_bytes: int = 1 << 20

    @classmethod
    def from_config(cls, cfg: DataConfig) -> ImageLimits:
        return cls(cfg.max_image_pixels, cfg.max_image_text_bytes)


DEFAULT_LIMITS = ImageLimits()
# The pixel check replaces Pillow's warning (between 89M and 179M pixels), which would
# otherwise print beside the one-line refusal.
warnings.filterwarnings("ignore", category=Image.DecompressionBombWarning)


class _Problem(Exception):
    """Why one image cannot be used; the message is the plain-words problem, without the path."""


def load_image(path: str | Path, limits: ImageLimits = DEFAULT_LIMITS) -> Image.Image:
    """Open an image file and return it fully decoded as an upright 8-bit RGB image.

    Transparent pixels are composited over white, 16-bit and float greyscale is scaled to
    8 bits by value range, the EXIF orientation is applied, and for animated formats the
    first frame is used.

    Args:
        path: the image file: JPEG, PNG, WebP, GIF, BMP or TIFF (:data:`FORMATS`; no other
            format is opened, whatever its name).
        limits: how large a file may be (see :class:`ImageLimits`).

    Returns:
        A new ``RGB`` image that holds no open file.

    Raises:
        DataError: the file is missing, empty, a directory, not an image, truncated or
            corrupt, too large to decode safely, or of an unsupported mode.
    """
    try:
        return _load(path, limits)
    except _Problem as problem:
        shown = str(path).replace("\0", "\\0")  # a NUL byte would end the line on a terminal
        raise DataError(f"{shown}: {problem}") from problem.__cause__


def load_image_bytes(
    data: bytes | BinaryIO,
    name: str = "upload",
    limits: ImageLimits = DEFAULT_LIMITS,
    *,
    reduce_to: int | None = None,
    reserve: Callable[[int], AbstractContextManager] | None = None,
) -> Image.Image:
    """:func:`load_image` for an image held in memory or in an open file (an upload), with
    the same checks.

    Args:
        data: the file's bytes, or a binary file open for reading (read from its start).
        name: what the error messages call the image (a file name).
        limits: as for :func:`load_image`.
        reduce_to: the side the image is about to be resized to (a model's input size).
            Then the image may come back smaller, by whole factors that keep each side at
            least twice ``reduce_to``: a JPEG is decoded at 1/2, 1/4 or 1/8 scale, other
            formats are box-reduced before their colours are converted, so that a large
            picture is held at full size no longer than its decoding takes.
        reserve: called with the number of pixels about to be decoded (after any JPEG
            scaling); the decoding runs inside the context it returns (the web demo bounds
            the pixels being decoded at once with it).

    Raises:
        DataError: as :func:`load_image` (``"<name>: file is empty (0 bytes)"``, ...).
    """
    try:
        if isinstance(data, bytes | bytearray | memoryview):
            if not data:
                raise _Problem("file is empty (0 bytes)")
            source: BinaryIO = io.BytesIO(data)
        else:
            empty = data.seek(0, io.SEEK_END) == 0
            data.seek(0)
            if empty:
                raise _Problem("file is empty (0 bytes)")
            source = data
        return _decode(source, limits, reduce_to, reserve)
    except _Problem as problem:
        raise DataError(f"{name}: {problem}") from problem.__cause__


def image_type(path: str | Path | BinaryIO) -> str | None:
    """The MIME type of an image file (a path, or a binary file) in one of
    :data:`FORMATS`, from its header alone; None for anything else (a missing file, another
    format, a folder)."""
    try:
        if isinstance(path, str | Path):
            _check_file(path)
        with Image.open(path, formats=FORMATS) as image:
            return MIME_TYPES.get(image.format or "")
    except (_Problem, OSError, ValueError, SyntaxError):
        return None


def as_rgb(image: Image.Image, limits: ImageLimits = DEFAULT_LIMITS) -> Image.Image:
    """An in-memory PIL image as 8-bit RGB, converted as :func:`load_image` converts files
    (transparency over white, wide greyscale scaled, EXIF orientation applied).

    Raises:
        DataError: the image is past ``limits.max_pixels`` or of an unsupported mode.
    """
    try:
        _check_pixels(image, limits)
        return _upright_rgb(image)
    except _Problem as problem:
        raise DataError(f"image: {problem}") from problem.__cause__


def check_image(path: str | Path, limits: ImageLimits = DEFAULT_LIMITS) -> str | None:
    """Say whether an image file loads, without raising.

    Args:
        path: the image file.
        limits: as for :func:`load_image`.

    Returns:
        None when :func:`load_image` succeeds, else the problem in plain words
        (``"file is empty (0 bytes)"``, ``"no such file"``, ...).
    """
    try:
        _load(path, limits)
    except _Problem as problem:
        return str(problem)
    return None


def check_images(
    paths: Sequence[str],
    num_threads: int = 4,
    progress: bool = False,
    limits: ImageLimits = DEFAULT_LIMITS,
) -> list[tuple[str, str]]:
    """Decode every image once and list those that cannot be loaded.

    Args:
        paths: the image files.
        num_threads: worker threads; PIL releases the GIL while decoding, so threads help.
        progress: a bar on a terminal, one summary line in a log (see captioning.progress).
        limits: as for :func:`load_image`.

    Returns:
        ``(path, problem)`` for each bad image, in the order of ``paths``.
    """
    if num_threads < 1:
        raise ValueError(f"num_threads must be at least 1, got {num_threads}")
    results = map_in_threads(partial(check_image, limits=limits), paths, num_threads)
    bar = progress_bar(
        results, total=len(paths), desc="checking images", unit="img", enabled=progress
    )
    # Exhaust the iterator before zipping: zip stops early and the bar would never close.
    problems = list(bar)
    return [(path, problem) for path, problem in zip(paths, problems) if problem is not None]


def _load(path: str | Path, limits: ImageLimits = DEFAULT_LIMITS) -> Image.Image:
    _check_file(path)
    return _decode(path, limits)


def _decode(
    source: str | Path | BinaryIO,
    limits: ImageLimits,
    reduce_to: int | None = None,
    reserve: Callable[[int], AbstractContextManager] | None = None,
) -> Image.Image:
    """Open and fully decode ``source`` (a path or a binary file) under ``limits``; see
    :func:`load_image_bytes` for ``reduce_to`` and ``reserve``."""
    if ImageFile.LOAD_TRUNCATED_IMAGES:
        # The flag is process-wide and read by PIL while decoding, so flipping it here would
        # race with other threads; warn that truncated files now pass as grey-padded images.
        warnings.warn(
            "PIL.ImageFile.LOAD_TRUNCATED_IMAGES is True: truncated images cannot be detected",
            RuntimeWarning,
            stacklevel=4,
        )
    if PngImagePlugin.MAX_TEXT_CHUNK != limits.max_text_bytes:  # the same value all run long
        PngImagePlugin.MAX_TEXT_CHUNK = limits.max_text_bytes
        # All the text an open image holds: an upload is held open while it waits to be
        # decoded, and a few KB of compressed text would otherwise hold 64 MB each.
        PngImagePlugin.MAX_TEXT_MEMORY = 4 * limits.max_text_bytes
    try:
        image = Image.open(source, formats=FORMATS)
    except Image.DecompressionBombError as err:
        raise _Problem(_too_large()) from err
    except UnidentifiedImageError as err:
        raise _Problem(NOT_AN_IMAGE) from err
    except FileNotFoundError as err:
        raise _Problem("no such file") from err
    except PermissionError as err:
        raise _Problem("permission denied") from err
    except OSError as err:
        # Plugins raise errno-less OSErrors ("Truncated File Read") for a cut-off header.
        if err.errno is None:
            raise _Problem(TRUNCATED) from err
        raise _Problem(f"cannot read file ({err.strerror or 'input/output error'})") from err
    except ValueError as err:
        # PNG text/ICC chunks that decompress past Pillow's limit: "Decompressed data too large".
        raise _Problem(
            f"image metadata is too large to read safely (more than "
            f"data.max_image_text_bytes={limits.max_text_bytes:,} in one chunk, or four times "
            "that in all); save the image without it"
        ) from err
    with image:
        _check_pixels(image, limits)
        if image.format in ("JPEG", "MPO"):
            _check_scans(source)
        if reduce_to is not None and image.format in ("JPEG", "MPO"):
            image.draft(None, (2 * reduce_to, 2 * reduce_to))  # DCT scaling: 1/2, 1/4, 1/8
        with reserve(_pixels_held(image)) if reserve else nullcontext():
            try:
                image.load()
            except Image.DecompressionBombError as err:
                raise _Problem(_too_large()) from err
            except Exception as err:
                # Format plugins report bad data with many exception types (OSError,
                # SyntaxError, struct.error, IndexError, ...); all mean the same to the user.
                raise _Problem(TRUNCATED) from err
            if reduce_to is not None:
                return _reduced_rgb(image, 2 * reduce_to)
            return _upright_rgb(image)


TRUNCATED = "image is truncated or corrupt; save or download it again"


def _too_large() -> str:
    """Pillow's own limit, met only when data.max_image_pixels is set above it."""
    return (
        f"image is too large to decode safely (more than {2 * Image.MAX_IMAGE_PIXELS:,} "
        "pixels); resize it"
    )


def _pixels_held(image: Image.Image) -> int:
    """What decoding and converting ``image`` holds at its peak, counted in the 4-byte
    pixels of an RGB picture (the unit of the web demo's pixel budget): a 16-bit grey image
    converts through 6 bytes a pixel, a palette with transparency through 5 (RGBA beside the
    palette's indices), every other mode through at most 4."""
    pixels = image.width * image.height
    if image.mode.startswith("I;16"):
        return -(-pixels * 6 // 4)
    if image.mode in ("P", "PA") and (image.mode == "PA" or "transparency" in image.info):
        return -(-pixels * 5 // 4)
    return pixels


def jpeg_scans(source: str | Path | BinaryIO) -> int:
    """The start-of-scan markers in a JPEG file (a path, or a binary file, read from its
    start and left where it was), counted as the bytes FF DA: inside entropy-coded data an
    FF byte is always followed by 00 or a restart marker, so every FF DA starts a scan (or
    one of an embedded thumbnail). Read in chunks, so a large file costs no memory."""
    handle = open(source, "rb") if isinstance(source, str | Path) else source  # noqa: SIM115
    position = None if handle is not source else handle.tell()
    try:
        handle.seek(0)
        count, previous = 0, b""
        while chunk := handle.read(1 << 20):
            count += (previous + chunk).count(b"\xff\xda")
            previous = chunk[-1:] if chunk.endswith(b"\xff") else b""
        return count
    finally:
        if position is None:
            handle.close()
        else:
            handle.seek(position)


def _check_scans(source: str | Path | BinaryIO) -> None:
    """Refuse a JPEG with more scans than :data:`MAX_JPEG_SCANS`, before decoding it."""
    try:
        scans = jpeg_scans(source)
    except OSError as err:
        raise _Problem(f"cannot read file ({err.strerror or 'input/output error'})") from err
    if scans > MAX_JPEG_SCANS:
        raise _Problem(
            f"JPEG has {scans:,} scans, more than the {MAX_JPEG_SCANS} any camera or editor "
            "writes (each one costs a pass over the whole image); save it again as a JPEG"
        )


def _check_pixels(image: Image.Image, limits: ImageLimits) -> None:
    """Refuse an image whose declared size is past the limit, before decoding its pixels."""
    width, height = image.size
    if width < 1 or height < 1:
        raise _Problem(f"image is {width} x {height} pixels: there is nothing to caption")
    if width * height > limits.max_pixels:
        raise _Problem(
            f"image is {width} x {height} = {width * height:,} pixels, more than "
            f"data.max_image_pixels={limits.max_pixels:,}; resize it, or raise the limit"
        )


def _upright_rgb(image: Image.Image) -> Image.Image:
    try:
        upright = ImageOps.exif_transpose(image)
    except Exception:
        # Orientation is a nicety: a malformed EXIF block must not discard pixels that
        # decoded fine.
        upright = image.copy()
    return _to_rgb(upright)


# EXIF orientation -> the transposition that makes the picture upright (ImageOps' table).
_UPRIGHT = {
    2: Image.Transpose.FLIP_LEFT_RIGHT,
    3: Image.Transpose.ROTATE_180,
    4: Image.Transpose.FLIP_TOP_BOTTOM,
    5: Image.Transpose.TRANSPOSE,
    6: Image.Transpose.ROTATE_270,
    7: Image.Transpose.TRANSVERSE,
    8: Image.Transpose.ROTATE_90,
}


def _reduced_rgb(image: Image.Image, smallest: int) -> Image.Image:
    """``image`` (decoded) box-reduced by the largest whole factors that keep each side at
    least ``smallest``, upright, as 8-bit RGB. The colour conversion runs on the reduced
    pixels, so a large picture is never converted (or copied) at full size."""
    factors = (max(1, image.width // smallest), max(1, image.height // smallest))
    if factors == (1, 1):
        return _upright_rgb(image)
    try:
        orientation = int(image.getexif().get(0x0112, 1))
    except Exception:
        orientation = 1  # a malformed EXIF block: the pixels still count
    reduced = _reducible(image).reduce(factors)
    if reduced.mode == "I" and image.mode in _WIDE_16BIT_MODES:
        reduced = reduced.convert("I;16")  # scaled by 16 bits, as the full-size path scales
    if orientation in _UPRIGHT:
        reduced = reduced.transpose(_UPRIGHT[orientation])
    return _to_rgb(reduced)


def _reducible(image: Image.Image) -> Image.Image:
    """``image`` in a mode whose pixels may be averaged: palettes and colour keys become
    alpha (composited over white later), bilevel becomes grey, 16-bit grey 32-bit."""
    mode = image.mode
    if mode in ("P", "PA") or (mode in ("L", "RGB") and "transparency" in image.info):
        return image.convert("RGBA" if "transparency" in image.info or mode == "PA" else "RGB")
    if mode == "1":
        return image.convert("L")
    if mode in _WIDE_16BIT_MODES:
        return image.convert("I")
    return image


def _check_file(path: str | Path) -> None:
    """Give the plain-words problem for paths that are not a non-empty regular file."""
    try:
        info = os.stat(path)
    except (FileNotFoundError, NotADirectoryError) as err:
        raise _Problem("no such file") from err
    except PermissionError as err:
        raise _Problem("permission denied") from err
    except OSError as err:
        raise _Problem(f"cannot read file ({err.strerror or 'input/output error'})") from err
    except ValueError as err:  # "embedded null byte": no file can have such a name
        raise _Problem("the path holds a NUL byte; give the file's real path") from err
    if stat.S_ISDIR(info.st_mode):
        raise _Problem("is a directory, not an image")
    # Opening a FIFO or device would block or read forever.
    if not stat.S_ISREG(info.st_mode):
        raise _Problem("not a regular file")
    if info.st_size == 0:
        raise _Problem("file is empty (0 bytes)")


def _to_rgb(image: Image.Image) -> Image.Image:
    mode = image.mode
    if mode in _WIDE_16BIT_MODES:
        # PIL's own convert clips every value above 255 to white.
        grey = np.asarray(image, dtype=np.float64) * (255.0 / 65535.0)
        return _grey_to_rgb(grey)
    if mode in _WIDE_RANGE_MODES:
        return _grey_to_rgb(_stretch(np.asarray(image, dtype=np.float64)))
    if mode in _ALPHA_MODES or (mode in ("P", "L", "RGB") and "transparency" in image.info):
        # Premultiplied La has no direct conversion to RGBA; LA un-premultiplies it.
        rgba = (image.convert("LA") if mode == "La" else image).convert("RGBA")
        # Colour under transparent pixels is arbitrary, so compositing is the only safe way.
        white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(white, rgba).convert("RGB")
    if mode == "RGB":
        return image
    if mode in _CONVERTIBLE_MODES:
        return image.convert("RGB")
    raise _Problem(f"unsupported image mode {mode!r}")


def _stretch(values: np.ndarray) -> np.ndarray:
    """Map the finite range of ``values`` linearly onto 0..255."""
    finite = values[np.isfinite(values)]
    if finite.size == 0:
        return np.zeros_like(values)
    low, high = finite.min(), finite.max()
    if high > low:
        values = (values - low) * (255.0 / (high - low))
    # A constant image has no range to stretch; keep its value (clipped below).
    return np.nan_to_num(values, nan=0.0, posinf=255.0, neginf=0.0)


def _grey_to_rgb(grey: np.ndarray) -> Image.Image:
    pixels = np.clip(np.rint(grey), 0, 255).astype(np.uint8)
    return Image.fromarray(pixels).convert("RGB")
