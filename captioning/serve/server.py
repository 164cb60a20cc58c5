"""Running the demo: in the foreground (``captioning serve``) or on a thread (tests, tools),
with the limits on connections of :class:`ConnectionLimits`."""

from __future__ import annotations

import asyncio
import ctypes
import math
import socket
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import h11
import uvicorn
from starlette.applications import Starlette
from uvicorn.protocols.http.h11_impl import H11Protocol

from captioning.api import CaptionModel, load
from captioning.errors import CaptioningError
from captioning.runtime import in_passing_thread
from captioning.serve.app import ServeSettings, create_app, settings_for
from captioning.serve.origins import HostAllowList, guarded


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


@dataclass(frozen=True)
class ConnectionLimits:
    """What the server allows each connection, before and around the app's own limits.

    Args:
        max_connections: connections open at once: once they are all open, a request is
            answered 503 (uvicorn's ``limit_concurrency``) and one more connection is
            closed as soon as it opens.
        header_timeout: seconds a request's headers may take to arrive, from the moment its
            connection opened or its previous answer ended; past it the connection is closed.
        keep_alive: seconds an idle connection is kept open after an answer.
        grace: seconds past the app's ``timeout`` that a request may take from its headers
            to the end of its answer (its body read, its answer written); past it the
            connection is closed.
    """

    max_connections: int = 512
    header_timeout: float = 10.0
    keep_alive: float = 5.0
    grace: float = 10.0


class DeadlineProtocol(H11Protocol):
    """uvicorn's HTTP/1.1 protocol with the deadlines of :class:`ConnectionLimits`: each
    request's headers within ``header_timeout``, its whole exchange within the app's timeout
    and ``grace``; a connection past either is closed. uvicorn has no header deadline of its
    own (its keep-alive timer stops at a request's first byte).

    ``limits`` and ``request_timeout`` are set on a subclass by :func:`uvicorn_config`.
    """

    limits: ConnectionLimits = ConnectionLimits()
    request_timeout: float = 40.0
    _deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if len(self.connections) > self.limits.max_connections:
            transport.close()
            return
        self._watch(self.limits.header_timeout)

    def connection_lost(self, exc: Exception | None) -> None:
        self._watch(None)
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        cycle = self.cycle
        super().data_received(data)
        self._after(cycle)

    def on_response_complete(self) -> None:
        cycle = self.cycle
        super().on_response_complete()
        self._after(cycle, answered=True)

    def _after(self, cycle: Any, answered: bool = False) -> None:
        """Set the deadline for what comes after ``cycle``: a new request's exchange, or
        once an answer has ended, the next request's headers."""
        if self.cycle is not cycle:  # the headers of a request have come in
            _guard_answer(self.cycle)
            self._watch(self.request_timeout)
        elif answered:
            self._watch(self.limits.header_timeout)

    def send_400_response(self, msg: str) -> None:
        """uvicorn's answer to a request it cannot parse, with the demo's security headers."""
        headers = guarded(
            [(b"content-type", b"text/plain; charset=utf-8"), (b"connection", b"close")]
        )
        for event in (
            h11.Response(status_code=400, headers=headers, reason=b"Bad Request"),
            h11.Data(data=msg.encode("ascii")),
            h11.EndOfMessage(),
        ):
            self.transport.write(self.conn.send(event))
        self.transport.close()

    def _watch(self, seconds: float | None) -> None:
        """Close the connection in ``seconds`` (None: never), in place of any earlier time."""
        if self._deadline is not None:
            self._deadline.cancel()
        self._deadline = None if seconds is None else self.loop.call_later(seconds, self._late)

    def _late(self) -> None:
        self._deadline = None
        if not self.transport.is_closing():
            self.transport.close()


def _guard_answer(cycle: Any) -> None:
    """Give every answer of ``cycle`` the demo's security headers: the app's own have them,
    uvicorn's (its 503 at the connection limit, its 500) do not."""
    send = cycle.send

    async def guarded_send(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start":
            message = {**message, "headers": guarded(list(message.get("headers", [])))}
        await send(message)

    cycle.send = guarded_send


def uvicorn_config(
    app: Starlette, timeout: float, limits: ConnectionLimits, **options: Any
) -> uvicorn.Config:
    """uvicorn's config for the demo's ``app`` (whose requests take up to ``timeout``
    seconds) under ``limits``; ``options`` are other :class:`uvicorn.Config` arguments."""
    protocol = type(
        "DemoProtocol",
        (DeadlineProtocol,),
        {"limits": limits, "request_timeout": timeout + limits.grace},
    )
    return uvicorn.Config(
        app,
        http=protocol,
        limit_concurrency=limits.max_connections,
        timeout_keep_alive=limits.keep_alive,
        **options,
    )


# What each option of `captioning serve` may be: (least, most, whether the least is taken).
OPTION_RANGES = {
    "--max-upload-mb": (0, 1024, False),
    "--timeout": (0, 3600, False),
    "--max-in-flight": (0, 1024, False),
    "--max-batch": (0, 1024, False),
    "--max-queue": (0, 4096, True),
    "--batch-wait-ms": (0, 10_000, True),
}


def check_options(values: dict[str, float]) -> None:
    """A one-line :class:`CaptioningError` for the first of ``values`` (option -> value)
    outside :data:`OPTION_RANGES`."""
    for option, value in values.items():
        least, most, least_taken = OPTION_RANGES[option]
        low_ok = value >= least if least_taken else value > least
        if not (math.isfinite(value) and low_ok and value <= most):
            bound = "of 0 or more" if least_taken else "above 0"
            raise CaptioningError(
                f"{option} must be a number {bound} and at most {most:g}, got {value:g}"
            )


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
    connections: ConnectionLimits | None = None,
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
        connections: what each connection is allowed (default :class:`ConnectionLimits`).

    Raises:
        CaptioningError: an option is out of its range (before the model loads), the port
            cannot be had, or the checkpoint cannot be loaded or served.
    """
    check_options(
        {
            "--max-upload-mb": max_upload_mb,
            "--timeout": timeout,
            "--max-in-flight": max_in_flight,
            "--max-batch": max_batch,
            "--max-queue": max_queue,
            "--batch-wait-ms": batch_wait_ms,
        }
    )
    with listen(host, port) as sock:  # first: a taken port is known before the model loads
        give_back_large_blocks()
        model = in_passing_thread(load, checkpoint, device)  # the batcher's team is the only one
        hosts = HostAllowList.for_address(host, allow_hosts)
        settings = settings_for(
            model,
            max_upload_mb,
            hosts=hosts,
            max_in_flight=max_in_flight,
            max_queue=max_queue,
            timeout=timeout,
            max_batch=max_batch,
            batch_wait=batch_wait_ms / 1000,
        )
        shown = f"[{host}]" if ":" in host else host
        app = create_app(model, settings)
        print(
            f"serving {Path(checkpoint).name} on http://{shown}:{port} (Ctrl-C stops)", flush=True
        )
        config = uvicorn_config(
            app,
            timeout,
            connections or ConnectionLimits(),
            log_level="info",
            access_log=not quiet,
            timeout_graceful_shutdown=5,
        )
        uvicorn.Server(config).run(sockets=[sock])


class BackgroundServer:
    """The demo on a free port of 127.0.0.1, on a thread: ``with BackgroundServer(m) as url``.

    Args:
        model: the loaded model.
        settings: the demo's limits and examples.
        connections: what each connection is allowed (default :class:`ConnectionLimits`).
    """

    def __init__(
        self,
        model: CaptionModel,
        settings: ServeSettings | None = None,
        connections: ConnectionLimits | None = None,
    ) -> None:
        settings = settings or ServeSettings()
        self.app = create_app(model, settings)
        self.sock = listen("127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        config = uvicorn_config(
            self.app, settings.timeout, connections or ConnectionLimits(), log_level="warning"
        )
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(
            target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True
        )

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
