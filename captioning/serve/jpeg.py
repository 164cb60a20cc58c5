"""What decoding a JPEG holds besides its picture.

libjpeg decodes a baseline JPEG one row of blocks at a time, so at 1/8 scale (the demo drafts
JPEGs to the model's input size) it holds little more than the reduced picture. A
progressive JPEG, or one whose first scan leaves out a component, is decoded through buffers
that hold the DCT coefficients of the whole image, 2 bytes per sample of each component,
whatever the scale: an 8000 x 8000 progressive file of a few hundred KB holds 384 MB.
"""

from __future__ import annotations

import io
from dataclasses import dataclass
from typing import BinaryIO

from PIL import Image

# Start-of-frame markers (SOF0-SOF15 but DHT, JPG and DAC), and the progressive ones.
_FRAMES = frozenset({0xC0, 0xC1, 0xC2, 0xC3, 0xC5, 0xC6, 0xC7, 0xC9, 0xCA, 0xCB, 0xCD, 0xCE, 0xCF})
_START_OF_SCAN = 0xDA
# Markers without a length: TEM and the restart markers.
_STANDALONE = frozenset({0x01, *range(0xD0, 0xD8)})
# Far more segments (and fill bytes before a marker) than any camera or editor writes.
_MOST_SEGMENTS = 256
_MOST_FILL = 64


@dataclass(frozen=True)
class WholeImageJpeg:
    """A JPEG decoded through whole-image coefficient buffers.

    Args:
        width: its declared width in pixels.
        height: its declared height in pixels.
        components: its colour components (3 for YCbCr, 4 for CMYK, 1 for grey).
    """

    width: int
    height: int
    components: int

    @property
    def pixels(self) -> int:
        return self.width * self.height

    @property
    def buffer_bytes(self) -> int:
        """The coefficient buffers' size (each component sampled at most at full size)."""
        return 2 * self.components * self.pixels


def whole_image_jpeg(file: BinaryIO) -> WholeImageJpeg | None:
    """``file`` as a :class:`WholeImageJpeg` when it is a JPEG that libjpeg decodes through
    whole-image buffers (progressive, or a first scan without every component; a header that
    cannot be followed counts as one); None for a baseline JPEG and for any other file.
    Reads the header only, and leaves ``file`` at its start."""
    try:
        with Image.open(file, formats=["JPEG"]) as image:
            width, height = image.size
            components = max(getattr(image, "layers", 0), len(image.getbands()))
            progressive = bool(image.info.get("progressive"))
    except Exception:  # not a JPEG, or one that its decoding will refuse in one line
        return None
    finally:
        file.seek(0)
    try:
        if not progressive and _first_scan_has_every_component(file):
            return None
    finally:
        file.seek(0)
    return WholeImageJpeg(width, height, components)


def _first_scan_has_every_component(file: BinaryIO) -> bool:
    """Whether the JPEG's markers lead, in order, to a frame and then a first scan with all
    of the frame's components; False for anything else."""
    if file.read(2) != b"\xff\xd8":
        return False
    components = None
    for _ in range(_MOST_SEGMENTS):
        marker = _next_marker(file)
        if marker is None:
            return False
        if marker in _STANDALONE:
            continue
        length = int.from_bytes(file.read(2), "big")
        if length < 2:
            return False
        if marker == _START_OF_SCAN:
            in_scan = file.read(1)
            return components is not None and in_scan == bytes([components])
        if marker in _FRAMES:
            frame = file.read(length - 2)  # precision, height, width, components, ...
            if len(frame) < 6 or components is not None:
                return False
            components = frame[5]
        else:
            file.seek(length - 2, io.SEEK_CUR)
    return False


def _next_marker(file: BinaryIO) -> int | None:
    """The next marker's code, after its 0xFF and any fill bytes; None when the next byte
    is not a marker's."""
    if file.read(1) != b"\xff":
        return None
    code = file.read(1)
    for _ in range(_MOST_FILL):
        if code != b"\xff":
            break
        code = file.read(1)
    return code[0] if code not in (b"", b"\x00", b"\xff") else None
