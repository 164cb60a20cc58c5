"""What the web demo's hostile clients upload (:mod:`benchmarks.serve_stress`): worst-case
pictures made in memory, each the smallest file that costs the demo the most, and the
multipart form and request head that carry one."""

from __future__ import annotations

import io
import struct
import uuid
import zlib
from typing import Any

import numpy as np
from PIL import Image


def png_at_the_cap(width: int = 8000, height: int = 8000) -> bytes:
    """A valid black RGB PNG of ``width`` x ``height`` (64M pixels: the default cap), a few
    hundred KB: decoding it takes 192 MB."""
    compressor = zlib.compressobj(9)
    row = b"\0" * (3 * width + 1)
    data = b"".join(compressor.compress(row * 100) for _ in range(height // 100))
    return _png(width, height, data + compressor.flush())


def png_declaring(width: int, height: int) -> bytes:
    """A tiny PNG whose header says ``width`` x ``height`` (a decompression bomb's shape)."""
    return _png(width, height, zlib.compress(b"\0" * 4))


def _png(width: int, height: int, compressed: bytes) -> bytes:
    def chunk(kind: bytes, payload: bytes) -> bytes:
        crc = struct.pack(">I", zlib.crc32(kind + payload))
        return struct.pack(">I", len(payload)) + kind + payload + crc

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", compressed)
            + chunk(b"IEND", b""))  # fmt: skip


def encoded(picture: Image.Image, format: str, **options: Any) -> bytes:
    buffer = io.BytesIO()
    picture.save(buffer, format, **options)
    return buffer.getvalue()


def big_photo() -> bytes:
    """A noisy JPEG of several MB (decoded at reduced scale)."""
    pixels = np.random.default_rng(0).integers(0, 256, (1800, 2400, 3), dtype=np.uint8)
    return encoded(Image.fromarray(pixels), "JPEG", quality=95)


def progressive_jpeg(side: int, mode: str = "RGB") -> bytes:
    """A progressive JPEG of ``side`` x ``side``: decoded through whole-image buffers."""
    picture = Image.linear_gradient("L").resize((side, side)).convert(mode)
    return encoded(picture, "JPEG", progressive=True, quality=75)


def scan_bomb(side: int = 4000, repeats: int = 1000) -> bytes:
    """A progressive JPEG of ``side`` x ``side`` with its shortest scan (a few dozen bytes)
    repeated ``repeats`` more times: libjpeg would walk the whole image once a scan, about
    10 s of CPU for a file of about 100 KB. The demo refuses it before decoding."""
    data = encoded(Image.new("L", (side, side), 128), "JPEG", progressive=True, quality=75)
    end = data.rfind(b"\xff\xd9")
    starts = [i for i in range(end) if data[i : i + 2] == b"\xff\xda"]
    scans = [data[a:b] for a, b in zip(starts, [*starts[1:], end])]
    return data[:end] + min(scans, key=len) * repeats + data[end:]


def uploads() -> dict[str, bytes]:
    """The files the uploading clients send, by kind."""
    at_cap = png_at_the_cap()
    return {
        "png at the pixel cap": at_cap,
        "the same, cut short": at_cap[: len(at_cap) // 2],
        "a bomb past the cap": png_declaring(12000, 12000),
        "10 MB of nothing": b"\0" * (10 * 2**20 - 1000),
        "a large photo": big_photo(),
        "progressive JPEG at the bound": progressive_jpeg(4000),
        "progressive JPEG past it": progressive_jpeg(8000, "L"),
        "small image": encoded(Image.linear_gradient("L").convert("RGB"), "PNG"),
    }


def form(data: bytes, name: str = "upload") -> tuple[bytes, str]:
    """A multipart body with ``data`` in the field ``image``, and its content type."""
    boundary = uuid.uuid4().hex
    body = (f'--{boundary}\r\nContent-Disposition: form-data; name="image"; filename="{name}"'
            f"\r\nContent-Type: application/octet-stream\r\n\r\n").encode()  # fmt: skip
    end = f"\r\n--{boundary}--\r\n".encode()
    return body + data + end, f"multipart/form-data; boundary={boundary}"


def request_head(content_type: str, length: int) -> bytes:
    return (f"POST /api/caption HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: {content_type}"
            f"\r\nContent-Length: {length}\r\n\r\n").encode()  # fmt: skip
