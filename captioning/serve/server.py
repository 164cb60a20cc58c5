"""Running the demo: in the foreground (``captioning serve``) or on a thread (tests, tools)."""

from __future__ import annotations

import socket
import threading
import time
from pathlib import Path

import uvicorn

from captioning.api import CaptionModel, load
from captioning.errors import CaptioningError
from captioning.serve.app import ServeSettings, create_app, settings_for


def listen(host: str, port: int) -> socket.socket:
    """A socket listening on ``host:port``; a one-line error when it cannot be had."""
    try:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(128)
    except OSError as exc:
        raise CaptioningError(
            f"cannot listen on {host}:{port} ({exc.strerror or exc}); choose another --host "
            "or --port"
        ) from exc
    return sock


def serve(
    checkpoint: str | Path,
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
    max_upload_mb: float = 10.0,
    device: str = "auto",
    quiet: bool = False,
) -> None:
    """Load ``checkpoint`` and serve the demo on ``host:port`` until interrupted.

    Args:
        checkpoint: a ``best.pt`` / ``last.pt`` file.
        host: the address to listen on (``0.0.0.0`` for every interface).
        port: the port.
        max_upload_mb: the largest upload taken, in MB.
        device: where the model runs (``auto``, ``cpu``, ``cuda``, ...).
        quiet: no access log.
    """
    if max_upload_mb <= 0:
        raise CaptioningError(f"--max-upload-mb must be positive, got {max_upload_mb:g}")
    with listen(host, port) as sock:  # first: a taken port is known before the model loads
        model = load(checkpoint, device)
        settings = settings_for(model, max_upload_mb)
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
        config = uvicorn.Config(create_app(model, settings), log_level="warning")
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
