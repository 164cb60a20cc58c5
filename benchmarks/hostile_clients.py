"""The web demo's hostile clients (:mod:`benchmarks.serve_stress`): what they upload
(worst-case pictures made in memory, each the smallest file that costs the demo the most, in
the multipart form and request head that carry one) and how one of them talks to the demo
and what it saw (:class:`Outcome`)."""

from __future__ import annotations

import io
import re
import select
import socket
import struct
import time
import uuid
import zlib
from collections.abc import Callable
from dataclasses import dataclass
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
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", header)
        + chunk(b"IDAT", compressed)
        + chunk(b"IEND", b"")
    )


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
    body = (
        f'--{boundary}\r\nContent-Disposition: form-data; name="image"; filename="{name}"'
        f"\r\nContent-Type: application/octet-stream\r\n\r\n"
    ).encode()
    end = f"\r\n--{boundary}--\r\n".encode()
    return body + data + end, f"multipart/form-data; boundary={boundary}"


def request_head(content_type: str, length: int) -> bytes:
    return (
        f"POST /api/caption HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: {content_type}"
        f"\r\nContent-Length: {length}\r\n\r\n"
    ).encode()


# The server's deadlines with its defaults (captioning.serve.server.ConnectionLimits, and
# `captioning serve --timeout`), and what a client allows beyond them.
HEADER_TIMEOUT = 10.0
REQUEST_TIMEOUT = 30.0 + 10.0
SLACK = 10.0


@dataclass
class Outcome:
    """What one client saw: the answer's status (None: none came), whether the server
    closed the connection without one, the seconds it took, and the answer's error."""

    kind: str
    status: int | None
    closed: bool
    seconds: float
    error: str | None = None


# --- one client -------------------------------------------------------------------------------


def talk(
    port: int,
    kind: str,
    data: bytes,
    rest: bytes = b"",
    pace: float = 0.0,
    limit: float = REQUEST_TIMEOUT + SLACK,
) -> Outcome:
    """Send ``data``, then ``rest`` (a 64 KB piece whenever the socket takes one, or, with
    ``pace``, 100 bytes every ``pace`` seconds) while reading what comes back, until an
    answer has come, the server has closed the connection, or ``limit`` seconds."""
    started = next_send = time.monotonic()
    reply = b""
    with socket.create_connection(("127.0.0.1", port), timeout=limit) as conn:
        conn.sendall(data)
        conn.setblocking(False)
        while (elapsed := time.monotonic() - started) < limit:
            writing = [conn] if rest and time.monotonic() >= next_send else []
            readable, writable, _ = select.select([conn], writing, [], 0.2)
            try:
                if readable:
                    chunk = conn.recv(65536)
                    if not chunk:
                        return answered(kind, reply, elapsed, closed=True)
                    reply += chunk
                    if complete(reply):
                        return answered(kind, reply, elapsed)
                if writable:
                    rest = rest[conn.send(rest[: 100 if pace else 65536]) :]
                    next_send = time.monotonic() + pace
            except (BlockingIOError, InterruptedError):
                continue
            except OSError:  # reset by the server
                return answered(kind, reply, time.monotonic() - started, closed=True)
    return Outcome(kind, None, False, limit)


def hang_up(port: int, kind: str, data: bytes) -> Outcome:
    """Send ``data`` (as much as the server takes within 5 s) and close the connection."""
    started = time.monotonic()
    with socket.create_connection(("127.0.0.1", port), timeout=5) as conn:
        try:
            conn.sendall(data)
        except OSError:  # a request waiting for a place: its body is not read yet
            pass
    return Outcome(kind, None, False, time.monotonic() - started)


def complete(reply: bytes) -> bool:
    """Whether ``reply`` holds a whole answer (its headers, and its body by Content-Length)."""
    head, found, body = reply.partition(b"\r\n\r\n")
    if not found:
        return False
    length = re.search(rb"(?im)^content-length:\s*(\d+)", head)
    return length is None or len(body) >= int(length.group(1))


def answered(kind: str, reply: bytes, seconds: float, closed: bool = False) -> Outcome:
    """The :class:`Outcome` of a client that read ``reply``."""
    status = re.match(rb"HTTP/1\.[01] (\d{3})", reply)
    if status is None:
        return Outcome(kind, None, closed, seconds)
    error = re.search(rb'"error":\s*"([^"]*)"', reply)
    message = error.group(1).decode(errors="replace") if error else None
    return Outcome(kind, int(status.group(1)), False, seconds, message)


def clients(bodies: dict[str, bytes]) -> list[tuple[str, Callable[[int], Outcome]]]:
    """The kinds of client, each as (name, a function of the server's port)."""
    kinds: list[tuple[str, Callable[[int], Outcome]]] = []
    for kind, data in bodies.items():
        body, content_type = form(data)
        kinds.append(
            (
                kind,
                lambda port, k=kind, b=body, c=content_type: talk(
                    port, k, request_head(c, len(b)), b
                ),
            )
        )
    slow, content_type = form(bodies["a large photo"])
    head = request_head(content_type, len(slow))
    small, small_type = form(bodies["small image"])
    whole = request_head(small_type, len(small)) + small
    kinds += [
        ("a slow body", lambda port: talk(port, "a slow body", head, slow, pace=0.5)),
        (
            "hang up mid-upload",
            lambda port: hang_up(port, "hang up mid-upload", head + slow[: len(slow) // 2]),
        ),
        ("hang up once sent", lambda port: hang_up(port, "hang up once sent", whole)),
        (
            "half the headers",
            lambda port: talk(
                port,
                "half the headers",
                b"POST /api/caption HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Ty",
                limit=HEADER_TIMEOUT + SLACK,
            ),
        ),
    ]
    return kinds
