"""Where the demo's requests may come from and what it serves from disk.

- :class:`HostAllowList` and :class:`GuardMiddleware`: a request whose ``Host`` header names
  another host is answered 421, so that a page elsewhere cannot reach a demo on 127.0.0.1
  through a name that resolves there (DNS rebinding); every answer says
  ``X-Content-Type-Options: nosniff``.
- :func:`example_images`: the page's example files come only from the checkpoint's test
  image folder (after resolving links) and only when they are images by their content.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import socket
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path, PurePath
from typing import Any

from starlette.datastructures import Headers
from starlette.responses import JSONResponse

from captioning.config import DataConfig
from captioning.data.images import image_type
from captioning.errors import CaptioningError

logger = logging.getLogger("captioning")

LOOPBACK_NAMES = ("127.0.0.1", "localhost", "::1")
NOSNIFF = (b"x-content-type-options", b"nosniff")


@dataclass(frozen=True)
class HostAllowList:
    """The ``Host`` header values (names without the port) the demo answers to.

    Args:
        names: lower-case host names and addresses.
        any_address: any IP address is taken too (a demo listening on every interface: an
            address in ``Host`` means the browser's page came from that address itself).
        anything: every host is taken (``--allow-host '*'``).
    """

    names: frozenset[str] = frozenset(LOOPBACK_NAMES)
    any_address: bool = False
    anything: bool = False

    @classmethod
    def for_address(cls, host: str, extra: Iterable[str] = ()) -> HostAllowList:
        """What a demo listening on ``host`` answers to: that host; with a loopback host,
        every loopback name; with ``0.0.0.0`` or ``::``, any address, the loopback names and
        this machine's name; and the ``extra`` names (``*``: anything)."""
        names = {normal_host(host)}
        extra = [normal_host(name) for name in extra]
        any_address = normal_host(host) in ("0.0.0.0", "::", "")
        if _is_loopback(host) or any_address:
            names.update(LOOPBACK_NAMES)
        if any_address:
            names.add(socket.gethostname().lower())
        return cls(frozenset(names | set(extra)) - {""}, any_address, "*" in extra)

    def allows(self, header: str) -> bool:
        """Whether a request with this ``Host`` header is answered."""
        if self.anything:
            return True
        name = normal_host(header)
        if name in self.names:
            return True
        return self.any_address and _is_address(name)


def normal_host(header: str) -> str:
    """``Host`` header -> the lower-case name or address without port or brackets."""
    text = header.strip().lower()
    if text.startswith("["):  # [::1]:8000
        return text[1 : text.find("]")] if "]" in text else text
    if text.count(":") == 1:  # name:port (an IPv6 address has several colons)
        text = text.split(":")[0]
    return text.rstrip(".")


def _is_address(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


def _is_loopback(host: str) -> bool:
    name = normal_host(host)
    return name == "localhost" or (_is_address(name) and ipaddress.ip_address(name).is_loopback)


class GuardMiddleware:
    """ASGI middleware: a foreign ``Host`` is answered 421 with a one-line JSON error, and
    every response carries ``X-Content-Type-Options: nosniff``.

    Args:
        app: the ASGI app inside.
        hosts: the hosts answered.
    """

    def __init__(self, app: Any, hosts: HostAllowList) -> None:
        self.app = app
        self.hosts = hosts

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_nosniff(message: dict) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), NOSNIFF]}
            await send(message)

        host = Headers(scope=scope).get("host")
        if host is not None and not self.hosts.allows(host):
            shown = ", ".join(sorted(self.hosts.names))
            response = JSONResponse(
                {
                    "error": f"this demo answers to the hosts {shown} only; start it with "
                    "--allow-host NAME to answer to another"
                },  # fmt: skip
                status_code=421,
            )
            await response(scope, receive, send_nosniff)
            return
        await self.app(scope, receive, send_nosniff)


@dataclass(frozen=True)
class Example:
    """An example image the page offers: the file and its MIME type."""

    path: str
    media_type: str


def example_images(data: DataConfig, count: int = 6) -> tuple[Example, ...]:
    """Up to ``count`` images of the test split of the dataset ``data`` describes, when they
    are on disk: only files inside its test image folder once links are resolved (the
    folder pattern ``data.images`` must be relative, without ``..``), and only images by
    their content (:data:`~captioning.data.images.FORMATS`)."""
    from captioning.data import load_splits

    folder = examples_folder(data)
    if folder is None:
        return ()
    try:
        test = load_splits(data).get("test", [])
    except (CaptioningError, OSError):
        return ()
    return checked_examples((record.path for record in test), folder, count)


def examples_folder(data: DataConfig) -> Path | None:
    """The test split's image folder, resolved; None (with a log line) when ``data.images``
    would lead out of ``data.root``."""
    split = data.splits.get("test", "test")
    if data.format == "karpathy":
        pattern = data.images.replace("{split}", "")
    else:
        pattern = data.images.replace("{split}", split)
    if PurePath(pattern).is_absolute() or ".." in PurePath(pattern).parts:
        logger.warning("no example images: data.images=%r leads out of data.root", pattern)
        return None
    return Path(os.path.realpath(Path(data.root) / pattern))


def checked_examples(paths: Iterable[str], folder: Path, count: int) -> tuple[Example, ...]:
    """The first ``count`` of ``paths`` that are image files inside ``folder``."""
    found: list[Example] = []
    for path in paths:
        if len(found) == count:
            break
        example = checked_example(path, [folder])
        if example is not None:
            found.append(example)
    return tuple(found)


def checked_example(path: str, folders: Sequence[Path]) -> Example | None:
    """``path`` as an :class:`Example` when, links resolved, it lies in one of ``folders``
    and is an image by its content; else None."""
    real = os.path.realpath(path)
    if folders and not any(os.path.commonpath([real, str(folder)]) == str(folder)
                           for folder in folders):  # fmt: skip
        return None
    media_type = image_type(real)
    return None if media_type is None else Example(real, media_type)
