"""The demo under 300 concurrent clients sending the worst uploads it takes, as the
``captioning serve`` process with its default limits: every request answered (200, 4xx or
503), its peak memory under 2 GiB, and the server up afterwards. Slow (a minute or two):
``pytest -m slow tests/test_serve_load.py``."""

from __future__ import annotations

import io
import os
import socket
import struct
import subprocess
import sys
import time
import urllib.request
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from .test_serve import png_declaring
from .test_serve_limits import post

ROOT = Path(__file__).resolve().parents[1]
CLIENTS = 300


def png_at_the_cap(width: int = 8000, height: int = 8000) -> bytes:
    """A valid black RGB PNG of ``width`` x ``height`` (64M pixels: the default cap), a few
    hundred KB: decoding it takes 192 MB."""
    compressor = zlib.compressobj(9)
    row = b"\0" * (3 * width + 1)
    data = b"".join(compressor.compress(row * 100) for _ in range(height // 100))
    data += compressor.flush()

    def chunk(kind: bytes, payload: bytes) -> bytes:
        crc = struct.pack(">I", zlib.crc32(kind + payload))
        return struct.pack(">I", len(payload)) + kind + payload + crc

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", data) + chunk(b"IEND", b"")
    )


def big_photo() -> bytes:
    """A noisy JPEG of several MB (decoded at reduced scale)."""
    pixels = np.random.default_rng(0).integers(0, 256, (1800, 2400, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, "JPEG", quality=95)
    return buffer.getvalue()


def peak_rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmHWM in /proc")


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="needs Linux /proc")
def test_300_clients_with_the_worst_uploads(tiny_checkpoint, tmp_path):
    at_cap = png_at_the_cap()
    uploads = {
        "png at the pixel cap": at_cap,
        "the same, cut short": at_cap[: len(at_cap) // 2],
        "a bomb past the cap": png_declaring(12000, 12000),
        "10 MB of nothing": b"\0" * (10 * 2**20 - 1000),
        "a large photo": big_photo(),
    }
    kinds = list(uploads)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    command = [sys.executable, "-m", "captioning", "serve", "--checkpoint", str(tiny_checkpoint),
               "--port", str(port), "--quiet", "--device", "cpu"]  # fmt: skip
    log = open(tmp_path / "server.log", "w")
    server = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        until = time.monotonic() + 120
        while True:
            try:
                urllib.request.urlopen(f"{url}/api/info", timeout=5).read()
                break
            except OSError:
                assert server.poll() is None and time.monotonic() < until, "no server"
                time.sleep(0.2)
        started = time.monotonic()
        with ThreadPoolExecutor(CLIENTS) as pool:
            answers = list(pool.map(lambda i: post(url, uploads[kinds[i % len(kinds)]]),
                                    range(CLIENTS)))  # fmt: skip
        seconds = time.monotonic() - started
        peak = peak_rss_bytes(server.pid)
        after = post(url, big_photo())
        assert server.poll() is None
    finally:
        server.terminate()
        server.wait(timeout=30)
        log.close()
    statuses = [status for status, *_ in answers]
    summary = {kind: sorted({s for i, s in enumerate(statuses) if kinds[i % len(kinds)] == kind})
               for kind in kinds}  # fmt: skip
    print(f"{seconds:.1f} s, peak RSS {peak / 2**20:.0f} MiB, statuses {summary}")
    assert set(statuses) <= {200, 400, 413, 503}
    assert 503 in statuses  # 300 > 32 in flight + 256 waiting
    assert all("\n" not in answer.get("error", "") for *_, answer in answers)
    assert peak < 2 * 2**30
    assert after[0] == 200
