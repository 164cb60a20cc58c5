"""Where the demo's requests may come from and what it serves from disk.

- :class:`HostAllowList` and :class:`GuardMiddleware`: a request without a ``Host`` header
  is answered 400, and one whose ``Host`` names another host 421, so that a page elsewhere
  cannot reach a demo on 127.0.0.1 through a name that resolves there (DNS rebinding); a
  POST that a browser says comes from a page of another origin is answered 403 (a page
  elsewhere cannot have the demo caption for it); every answer carries
  :data:`SECURITY_HEADERS` (no sniffing, no framing), the page its own
  ``Content-Security-Policy`` (:func:`page_policy`).
- :func:`example_images`: the page's example files come only from the checkpoint's test
  image folder (after resolving links) and only when they are images by their content;
  :func:`read_example` checks each again when it is asked for, in the bytes it serves.
"""

from __future__ import annotations

import base64
import hashlib
import io
import ipaddress
import logging
import os
import re
import socket
import stat
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path, PurePath
from typing import Any
from urllib.parse import urlsplit

from starlette.datastructures import Headers
from starlette.responses import JSONResponse

from captioning.config import DataConfig
from captioning.data.images import image_type
from captioning.data.records import ImageRecord
from captioning.errors import CaptioningError

logger = logging.getLogger("captioning")

LOOPBACK_NAMES = ("127.0.0.1", "localhost", "::1")
# What every answer says: no content sniffing, no framing by any page (clickjacking), no
# Referer sent on, and (but for the page, which has its own policy) no content at all.
SECURITY_HEADERS = (
    (b"x-content-type-options", b"nosniff"),
    (b"x-frame-options", b"DENY"),
    (b"referrer-policy", b"no-referrer"),
)
DEFAULT_POLICY = (b"content-security-policy", b"default-src 'none'; frame-ancestors 'none'")
# Methods that change nothing: the only ones taken from a page of another origin.
SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})


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


def host_port(header: str) -> int | None:
    """The port a ``Host`` header names (``[::1]:8000``, ``name:8000``); None without one
    or with one that is not a port."""
    text = header.strip()
    if text.startswith("["):
        text = text[text.find("]") + 1 :] if "]" in text else ""
    elif text.count(":") != 1:  # no port, or a bare IPv6 address
        return None
    digits = text.rpartition(":")[2] if ":" in text else ""
    return int(digits) if digits.isascii() and digits.isdigit() and len(digits) <= 5 else None


def cross_origin(origin: str | None, fetch_site: str | None, host: str) -> bool:
    """Whether a browser says the request comes from a page of another origin than the demo
    (reached as ``host``): its ``Origin`` names another host or port (or is ``null``), or,
    without one, its ``Sec-Fetch-Site`` says so. Clients that are no browser send neither."""
    if origin is None:
        return fetch_site not in (None, "same-origin", "none")
    parts = urlsplit(origin.strip())
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return True  # "null": a sandboxed frame, a file, a redirect from elsewhere
    try:
        origin_port = parts.port
    except ValueError:
        return True
    default_port = 443 if parts.scheme == "https" else 80
    same_host = normal_host(parts.hostname) == normal_host(host)
    return not same_host or (origin_port or default_port) != (host_port(host) or default_port)


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
    """ASGI middleware: a request without a ``Host`` is answered 400, a foreign ``Host`` 421,
    a cross-origin POST 403, each with a one-line JSON error, and every response carries
    :data:`SECURITY_HEADERS` (and :data:`DEFAULT_POLICY` unless it has a policy of its own).

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

        async def send_guarded(message: dict) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": guarded(message.get("headers", []))}
            await send(message)

        refusal = self.refusal(scope["method"], Headers(scope=scope))
        if refusal is not None:
            status, error = refusal
            response = JSONResponse({"error": error}, status_code=status)
            await response(scope, receive, send_guarded)
            return
        await self.app(scope, receive, send_guarded)

    def refusal(self, method: str, headers: Headers) -> tuple[int, str] | None:
        """(status, one-line error) for a request the demo does not answer; else None."""
        hosts = headers.getlist("host")
        if len(hosts) != 1 or not hosts[0].strip():
            return 400, "the request needs one Host header naming the demo's address"
        if not self.hosts.allows(hosts[0]):
            return 421, (
                "this demo does not answer to that host name; start it with "
                "--allow-host NAME to answer to another"
            )
        origin, fetch_site = headers.get("origin"), headers.get("sec-fetch-site")
        if method not in SAFE_METHODS and cross_origin(origin, fetch_site, hosts[0]):
            return 403, (
                "requests from pages of other sites are refused; use the demo's own "
                "page, or a client that is no browser"
            )
        return None


def guarded(headers: Sequence[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
    """A response's ``headers`` with :data:`SECURITY_HEADERS` and, unless it has a policy
    of its own, :data:`DEFAULT_POLICY`."""
    names = {name.lower() for name, _ in headers}
    extra = [h for h in SECURITY_HEADERS if h[0] not in names]
    if DEFAULT_POLICY[0] not in names:
        extra.append(DEFAULT_POLICY)
    return [*headers, *extra]


def page_policy(page: str) -> str:
    """The ``Content-Security-Policy`` of the demo's page: its own inline script and style
    (by their hashes), images from the demo and from the files the user picks, requests to
    the demo only, and no framing."""

    def hashes(tag: str) -> str:
        bodies = re.findall(rf"<{tag}>(.*?)</{tag}>", page, flags=re.DOTALL)
        digests = (hashlib.sha256(body.encode("utf-8")).digest() for body in bodies)
        return " ".join(f"'sha256-{base64.b64encode(digest).decode()}'" for digest in digests)

    return (
        f"default-src 'none'; script-src {hashes('script')}; style-src {hashes('style')}; "
        "img-src 'self' blob:; connect-src 'self'; base-uri 'none'; form-action 'none'; "
        "frame-ancestors 'none'"
    )


@dataclass(frozen=True)
class Example:
    """An example image the page offers: the file and its MIME type, and the boxes of its
    annotated objects when the data has instances: (category, (x, y, width, height) as
    shares of the image's width and height)."""

    path: str
    media_type: str
    boxes: tuple[tuple[str, tuple[float, float, float, float]], ...] = ()


def example_images(data: DataConfig, count: int = 6) -> tuple[Example, ...]:
    """Up to ``count`` images of the test split of the dataset ``data`` describes, when they
    are on disk: only files inside its test image folder once links are resolved (the
    folder pattern ``data.images`` must be relative, without ``..``), and only images by
    their content (:data:`~captioning.data.images.FORMATS`). Each carries its object boxes
    when the data has instances."""
    from captioning.data import load_splits

    folder = examples_folder(data)
    if folder is None:
        return ()
    try:
        test = load_splits(data).get("test", [])
    except (CaptioningError, OSError):
        return ()
    boxes = {record.path: object_boxes(record) for record in test}
    return checked_examples((record.path for record in test), folder, count, boxes)


def object_boxes(record: ImageRecord) -> tuple[tuple[str, tuple[float, ...]], ...]:
    """The record's objects as (category, box as shares of the image); none without a size."""
    if not record.width or not record.height:
        return ()
    width, height = float(record.width), float(record.height)
    return tuple(
        (o.category, (o.bbox[0] / width, o.bbox[1] / height, o.bbox[2] / width, o.bbox[3] / height))
        for o in record.objects
    )


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


def checked_examples(
    paths: Iterable[str], folder: Path, count: int, boxes: dict[str, tuple] | None = None
) -> tuple[Example, ...]:
    """The first ``count`` of ``paths`` that are image files inside ``folder``, each with
    its ``boxes`` (by path) when given."""
    found: list[Example] = []
    for path in paths:
        if len(found) == count:
            break
        example = checked_example(path, [folder])
        if example is not None:
            found.append(replace(example, boxes=(boxes or {}).get(path, ())))
    return tuple(found)


def checked_example(path: str, folders: Sequence[Path]) -> Example | None:
    """``path`` as an :class:`Example` when, links resolved, it lies in one of ``folders``
    and is an image by its content; else None."""
    real = os.path.realpath(path)
    if folders and not any(
        os.path.commonpath([real, str(folder)]) == str(folder) for folder in folders
    ):
        return None
    media_type = image_type(real)
    return None if media_type is None else Example(real, media_type)


# An example image is served from memory, read once from the file it was checked in.
MAX_EXAMPLE_BYTES = 32 * 2**20


def read_example(path: str, pinned: str) -> tuple[bytes, str] | None:
    """The bytes and media type of example ``path``, read from one open of the file
    ``pinned`` (where it led when the demo started) and checked in what was read: the file
    served is the file checked, whatever is swapped in at ``path`` meanwhile. None for a
    link swapped in since, a file removed, moved, grown past :data:`MAX_EXAMPLE_BYTES` or no
    longer an image."""
    if os.path.realpath(path) != pinned:
        return None
    try:
        fd = os.open(pinned, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError:
        return None
    with os.fdopen(fd, "rb") as handle:
        status = os.fstat(handle.fileno())
        if not stat.S_ISREG(status.st_mode) or status.st_size > MAX_EXAMPLE_BYTES:
            return None
        data = handle.read(MAX_EXAMPLE_BYTES + 1)
    media_type = image_type(io.BytesIO(data))
    return None if media_type is None or len(data) > MAX_EXAMPLE_BYTES else (data, media_type)
