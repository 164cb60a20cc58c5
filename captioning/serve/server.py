"""Running the demo: in the foreground (``captioning serve``) or on a thread (tests, tools)."""

from __future__ import annotations

import ctypes
import math
import socket
import threading
import time
from collections.abc import Sequence
from pathlib import Path

import uvicorn

from captioning.api import CaptionModel, load
from captioning.errors import CaptioningError
from captioning.runtime import in_passing_thread
from captioning.serve.app import ServeSettings, create_app, settings_for
from captioning.serve.origins import HostAllowList


def listen(host: str, port: int) -> socket.socket:
    """A socket listening on ``host:port``; a one-line error when it cannot be had."""
    try:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        # IPPROTO_TCP named, not left 0: asyncio turns Nagle's algorithm off only on sockets
        # that say they are TCP. With it on, an answer's body waits for the client's delayed
        # acknowledgement of its headers: 40 ms added to every request on Linux.
        sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # inherited by connections
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(1024)  # a burst of clients waits to be accepted, not refused
    except OSError as exc:
        raise CaptioningError(
            f"cannot listen on {host}:{port} ({exc.strerror or exc}); choose another --host "
            "or --port"
        ) from exc
    return sock


# glibc's mallopt parameter for the size from which an allocation gets its own mapping.
_M_MMAP_THRESHOLD = -3


def give_back_large_blocks(threshold: int = 4 * 2**20) -> None:
    """Have glibc serve each allocation of ``threshold`` bytes or more from a mapping of its
    own, returned to the system when freed. By default that threshold rises (up to 32 MB)
    as large blocks are freed, after which decoded pictures (Pillow allocates them in 16 MB
    blocks) come from per-thread heaps that keep their memory: 60 concurrent 64M-pixel
    uploads left the demo at 4.2 GB resident, 1.0 GB with this. Nothing happens elsewhere
    than glibc."""
    try:
        ctypes.CDLL("libc.so.6").mallopt(_M_MMAP_THRESHOLD, threshold)
    except (OSError, AttributeError):
        pass


def serve(
    checkpoint: str | Path,
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
    max_upload_mb: float = 10.0,
    device: str = "auto",
    quiet: bool = False,
    allow_hosts: Sequence[str] = (),
    max_in_flight: int = 32,
    max_queue: int = 256,
    timeout: float = 30.0,
    max_batch: int = 16,
    batch_wait_ms: float = 5.0,
) -> None:
    """Load ``checkpoint`` and serve the demo on ``host:port`` until interrupted.

    Args:
        checkpoint: a ``best.pt`` / ``last.pt`` file.
        host: the address to listen on (``0.0.0.0`` for every interface).
        port: the port.
        max_upload_mb: the largest upload taken, in MB.
        device: where the model runs (``auto``, ``cpu``, ``cuda``, ...).
        quiet: no access log.
        allow_hosts: ``Host`` names answered besides ``host`` (and, for a loopback or
            every-interface ``host``, the loopback names); ``*`` answers any.
        max_in_flight: caption requests worked on at once.
        max_queue: caption requests that may wait for a slot; past it, 503 at once.
        timeout: seconds from a request's arrival to its answer; past it, 503.
        max_batch: the most images captioned together.
        batch_wait_ms: milliseconds the model waits for more images once one has come.
    """
    positive = {"--max-upload-mb": max_upload_mb, "--timeout": timeout,
                "--max-in-flight": max_in_flight, "--max-batch": max_batch}  # fmt: skip
    limits = {**positive, "--max-queue": max_queue, "--batch-wait-ms": batch_wait_ms}
    for option, value in limits.items():
        if not math.isfinite(value) or value < 0 or (value == 0 and option in positive):
            least = "above 0" if option in positive else "of 0 or more"
            raise CaptioningError(f"{option} must be a finite number {least}, got {value:g}")
    with listen(host, port) as sock:  # first: a taken port is known before the model loads
        give_back_large_blocks()
        model = in_passing_thread(load, checkpoint, device)  # the batcher's team is the only one
        hosts = HostAllowList.for_address(host, allow_hosts)
        settings = settings_for(model, max_upload_mb, hosts=hosts, max_in_flight=max_in_flight,
                                max_queue=max_queue, timeout=timeout, max_batch=max_batch,
                                batch_wait=batch_wait_ms / 1000)  # fmt: skip
        shown = f"[{host}]" if ":" in host else host
        print(f"serving {Path(checkpoint).name} on http://{shown}:{port} (Ctrl-C stops)",
              flush=True)  # fmt: skip
        config = uvicorn.Config(create_app(model, settings), log_level="info",
                                access_log=not quiet, timeout_graceful_shutdown=5)  # fmt: skip
        uvicorn.Server(config).run(sockets=[sock])


class BackgroundServer:
    """The demo on a free port of 127.0.0.1, on a thread: ``with BackgroundServer(m) as url``.

    Args:
        model: the loaded model.
        settings: the demo's limits and examples.
    """

    def __init__(self, model: CaptionModel, settings: ServeSettings | None = None) -> None:
        self.sock = listen("127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.app = create_app(model, settings)
        config = uvicorn.Config(self.app, log_level="warning")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]},
                                       daemon=True)  # fmt: skip

    def __enter__(self) -> str:
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the demo server did not start")
            time.sleep(0.02)
        return self.url

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)
        self.sock.close()
