"""The web demo against clients that misbehave, on a real server on 127.0.0.1: clients that
hang up mid-request, slow clients (slowloris), too many connections, progressive JPEGs,
odd form values and malformed forms, requests from other origins or without a Host, example
files swapped after start-up, and limits from a checkpoint or the command line that the
demo cannot keep."""

from __future__ import annotations

import base64
import email
import hashlib
import logging
import os
import re
import select
import shutil
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from io import BytesIO
from pathlib import Path
from types import SimpleNamespace
from urllib.parse import urlsplit

import pytest
from PIL import Image

import captioning
from captioning.cli import main
from captioning.data.images import ImageLimits
from captioning.errors import CaptioningError
from captioning.serve.app import ServeSettings, prepare_upload
from captioning.serve.jpeg import WholeImageJpeg, whole_image_jpeg
from captioning.serve.limits import MAX_IMAGE_PIXELS, demo_image_limits
from captioning.serve.server import BackgroundServer, ConnectionLimits

from .test_serve_limits import Gate, multipart, post, read, send, wait_until


@pytest.fixture(scope="module")
def model(tiny_checkpoint):
    return captioning.load(tiny_checkpoint, device="cpu")


@pytest.fixture(scope="module")
def images(tiny_shapes):
    return sorted(str(p) for p in (tiny_shapes / "images" / "test").glob("*.png"))


@pytest.fixture(scope="module")
def server(model):
    with BackgroundServer(model) as url:
        yield url


class Hold:
    """Stands in for one of the model's methods: holds each call until opened."""

    def __init__(self, method) -> None:
        self.inner = method
        self.entered = threading.Event()
        self.opened = threading.Event()

    def __call__(self, *args, **kwargs):
        self.entered.set()
        assert self.opened.wait(30)
        return self.inner(*args, **kwargs)


@contextmanager
def errors_logged() -> Iterator[list[logging.LogRecord]]:
    """The records of ERROR and above that the server's loggers take while the block runs.
    Enter it once the server exists: uvicorn's config replaces its loggers' handlers."""
    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.ERROR)
    handler.emit = records.append  # type: ignore[method-assign]
    loggers = [logging.getLogger(name) for name in ("uvicorn.error", "captioning", "asyncio")]
    for logger in loggers:
        logger.addHandler(handler)
    try:
        yield records
    finally:
        for logger in loggers:
            logger.removeHandler(handler)


def connect(url: str) -> socket.socket:
    address = urlsplit(url)
    return socket.create_connection((address.hostname, address.port), timeout=10)


def request_head(content_type: str, length: int, path: str = "/api/caption") -> bytes:
    return (
        f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: {content_type}\r\n"
        f"Content-Length: {length}\r\n\r\n"
    ).encode()


def closed_by_server(conn: socket.socket, seconds: float, trickle: bytes = b"") -> float | None:
    """Seconds until the server closed ``conn`` (reading what it answers, and sending
    ``trickle`` one byte every 0.2 s meanwhile); None when it was still open after
    ``seconds``."""
    started = time.monotonic()
    while (elapsed := time.monotonic() - started) < seconds:
        readable, _, _ = select.select([conn], [], [], 0.2)
        try:
            if readable and not conn.recv(65536):
                return elapsed
            if trickle:
                conn.send(trickle[:1])
                trickle = trickle[1:]
        except OSError:  # reset, or a broken pipe: closed as well
            return time.monotonic() - started
    return None


# --- clients that hang up ---------------------------------------------------------------------


def test_a_client_gone_mid_upload_is_dropped_without_an_error(model, images):
    body, content_type = multipart(read(images[0]))
    server = BackgroundServer(model)
    with server as url, errors_logged() as errors:
        for _ in range(5):
            with connect(url) as leaving:
                leaving.sendall(request_head(content_type, len(body)) + body[: len(body) // 2])
        admission = server.app.state.admission
        wait_until(lambda: admission.running == 0 and admission.waiting == 0)
        assert post(url, read(images[0]))[0] == 200
    assert errors == []


def test_a_client_gone_during_decoding_keeps_its_slot_until_the_decoding_ends(
    model, images, monkeypatch
):
    hold = Hold(model.prepare)
    monkeypatch.setattr(model, "prepare", hold)
    body, content_type = multipart(read(images[0]))
    server = BackgroundServer(model, ServeSettings(max_in_flight=1))
    with server as url, errors_logged() as errors:
        admission = server.app.state.admission
        with connect(url) as leaving:
            leaving.sendall(request_head(content_type, len(body)) + body)
            assert hold.entered.wait(10)
        time.sleep(0.5)  # the server has seen the connection close
        assert admission.running == 1  # the decoding still runs, and holds its slot
        hold.opened.set()
        wait_until(lambda: admission.running == 0)
        assert post(url, read(images[1]))[0] == 200
    assert errors == []


def test_a_client_gone_during_its_batch_keeps_its_slot_until_the_batch_ends(
    model, images, monkeypatch
):
    gate = Gate(model)
    monkeypatch.setattr(model, "caption_inputs", gate)
    body, content_type = multipart(read(images[0]))
    server = BackgroundServer(model, ServeSettings(max_in_flight=1))
    with server as url, errors_logged() as errors:
        admission = server.app.state.admission
        with connect(url) as leaving:
            leaving.sendall(request_head(content_type, len(body)) + body)
            assert gate.entered.wait(10)
        time.sleep(0.5)
        assert admission.running == 1  # --max-in-flight bounds the work, not the clients
        gate.opened.set()
        wait_until(lambda: admission.running == 0)
        assert server.app.state.batcher.stats.captioned == 1
        assert post(url, read(images[1]))[0] == 200
    assert errors == []


# --- slow clients -----------------------------------------------------------------------------


def test_slow_clients_are_closed_at_the_header_deadline_while_others_are_served(model, images):
    """Slowloris: 30 connections that send half their headers, and one that sends a header
    a byte at a time, are all closed within the deadline; a normal client is served."""
    server = BackgroundServer(model, connections=ConnectionLimits(header_timeout=1.0))
    with server as url:
        slow = [connect(url) for _ in range(30)]
        for conn in slow:
            conn.sendall(b"POST /api/caption HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Ty")
        until = time.monotonic() + 1.0 + 2.0
        assert post(url, read(images[0]))[0] == 200
        assert send(url, path="/api/info")[0] == 200
        with connect(url) as trickling:
            trickled = closed_by_server(trickling, 4.0, b"GET / HTTP/1.1\r\nX-Slow: " + b"a" * 40)
        waits = [closed_by_server(conn, max(until - time.monotonic(), 0.1)) for conn in slow]
        for conn in slow:
            conn.close()
    assert None not in waits
    assert trickled is not None and trickled < 1.0 + 1.0


@pytest.mark.parametrize("path", ["/api/caption", "/"])
def test_a_body_that_trickles_in_is_cut_at_the_deadline(model, images, path):
    """Read by the app (/api/caption: 503 at --timeout) or not (/: 405 at once), a body sent a
    byte at a time does not keep its connection open."""
    body, content_type = multipart(read(images[0]))
    settings = ServeSettings(timeout=1.0)
    server = BackgroundServer(model, settings, ConnectionLimits(header_timeout=1.0, grace=1.0))
    with server as url, connect(url) as conn:
        conn.sendall(request_head(content_type, len(body), path))
        seconds = closed_by_server(conn, 5.0, trickle=body)
    assert seconds is not None and seconds < 1.0 + 1.0 + 1.5


def test_past_the_connection_limit_requests_are_refused(model):
    server = BackgroundServer(model, connections=ConnectionLimits(max_connections=3))
    with server as url:
        idle = [connect(url) for _ in range(2)]
        state = server.server.server_state
        wait_until(lambda: len(state.connections) == 2)
        status, headers, _ = send(url, path="/api/info")  # the third connection: at the limit
        assert status == 503
        assert_guarded(headers)  # uvicorn's own answer, with the demo's security headers
        extra = [connect(url) for _ in range(2)]  # the fourth is closed as it opens
        assert closed_by_server(extra[1], 2.0) is not None
        for conn in [*idle, *extra]:
            conn.close()
        wait_until(lambda: len(state.connections) == 0)
        assert send(url, path="/api/info")[0] == 200


# --- progressive JPEGs ------------------------------------------------------------------------


def jpeg(width: int, height: int, progressive: bool, mode: str = "RGB") -> bytes:
    picture = Image.linear_gradient("L").resize((width, height)).convert(mode)
    buffer = BytesIO()
    picture.save(buffer, "JPEG", progressive=progressive, quality=80)
    return buffer.getvalue()


def test_a_large_progressive_jpeg_is_refused_in_one_line(model):
    settings = ServeSettings(max_progressive_pixels=1_000_000)
    with BackgroundServer(model, settings) as url:
        status, _, answer = post(url, jpeg(1200, 1000, progressive=True), "p.jpg")
        assert status == 400
        assert answer == {
            "error": "p.jpg: a progressive JPEG is decoded whole, and this one is "
            "1200 x 1000 = 1,200,000 pixels, more than the 1,000,000 the demo "
            "decodes that way; resize it or save it as a baseline JPEG"
        }
        assert post(url, jpeg(1200, 1000, progressive=False), "b.jpg")[0] == 200
        assert post(url, jpeg(800, 600, progressive=True), "small.jpg")[0] == 200


def test_a_progressive_jpeg_reserves_its_whole_image_buffers(model):
    reserved: list[int] = []

    @contextmanager
    def record(pixels: int) -> Iterator[None]:
        reserved.append(pixels)
        yield

    for progressive in (True, False):
        data = BytesIO(jpeg(1200, 1000, progressive))
        inputs = prepare_upload(model, data, "a.jpg", model.limits, record, 10**8)
        assert tuple(inputs.shape) == (3, model.input_size, model.input_size)
    progressive_share, baseline_share = reserved
    assert progressive_share >= 2 * 3 * 1200 * 1000 // 4  # coefficients, in 4-byte pixels
    assert baseline_share <= 1200 * 1000 // 16  # drafted to 1/4 or 1/8 scale


def test_which_jpegs_are_decoded_through_whole_image_buffers():
    assert whole_image_jpeg(BytesIO(jpeg(64, 48, True))) == WholeImageJpeg(64, 48, 3)
    assert whole_image_jpeg(BytesIO(jpeg(64, 48, True, "L"))) == WholeImageJpeg(64, 48, 1)
    assert whole_image_jpeg(BytesIO(jpeg(64, 48, False))) is None
    png = BytesIO()
    Image.new("RGB", (8, 8)).save(png, "PNG")
    assert whole_image_jpeg(png) is None and whole_image_jpeg(BytesIO(b"")) is None
    baseline = jpeg(64, 48, False)
    after_first_segment = 4 + int.from_bytes(baseline[4:6], "big")
    # junk between segments: Pillow and libjpeg skip it, the header is not followed further
    odd = BytesIO(baseline[:after_first_segment] + b"junk" + baseline[after_first_segment:])
    assert whole_image_jpeg(odd) == WholeImageJpeg(64, 48, 3)  # a header not followed: counted
    assert odd.tell() == 0


# --- form values and forms --------------------------------------------------------------------


@pytest.mark.parametrize("beam", ["\u00b2", "\u0663", "1" * 5000, "0", "9", "-1", "2.0", "0x2"])
def test_a_beam_size_that_is_no_whole_number_in_range_is_a_400(server, images, beam):
    with errors_logged() as errors:
        status, _, answer = post(server, read(images[0]), beam_size=beam)
        assert (status, answer) == (400, {"error": "beam_size must be a whole number from 1 to 8"})
        assert post(server, read(images[0]), beam_size=" 2 ")[0] == 200
    assert errors == []


PART = b'--b\r\nContent-Disposition: form-data; name="image"; filename="a.png"\r\n'
END = b"\r\nx\r\n--b--\r\n"
MALFORMED = {
    "no disposition": b"--b\r\nContent-Type: image/png\r\n" + END,
    "a header line without a colon": PART + b"Broken header\r\n" + END,
    "a header name with a space": PART + b"Bad Name: x\r\n" + END,
    "a header of 10 KB": PART + b"X-Long: " + b"a" * 10_000 + b"\r\n" + END,
    "100 headers": PART + b"X-A: a\r\n" * 100 + END,
    "bytes that are no text": PART.replace(b"a.png", b"\xff\xfe.png") + END,
    "no end": PART + b"\r\nx",
    "garbage": b"\x00\x01\x02--b\r\n\r\n",
}


@pytest.mark.parametrize("kind", list(MALFORMED))
def test_a_malformed_form_is_a_4xx_in_one_line(server, images, kind):
    url = server
    with errors_logged() as errors:
        for content_type in (
            "multipart/form-data; boundary=b",
            "multipart/form-data; boundary=" + "b" * 300,
            "multipart/form-data",
        ):
            status, _, body = send(
                url, "POST", "/api/caption", MALFORMED[kind], {"Content-Type": content_type}
            )
            assert 400 <= status < 500, body
            assert re.fullmatch(rb'\{"error":"[^\n]+"\}', body)
        assert post(url, read(images[0]))[0] == 200
    assert errors == []


# --- origins, hosts, headers ------------------------------------------------------------------


def test_posts_from_pages_of_other_origins_are_refused(server, images):
    body, content_type = multipart(read(images[0]))
    port = urlsplit(server).port

    def caption(**headers: str) -> tuple[int, object, bytes]:
        sent = {"Content-Type": content_type, **headers}
        return send(server, "POST", "/api/caption", body, sent)

    assert caption()[0] == 200  # a client that is no browser
    assert caption(Origin=f"http://127.0.0.1:{port}")[0] == 200
    assert caption(Origin=f"http://localhost:{port}", Host=f"localhost:{port}")[0] == 200
    assert caption(**{"Sec-Fetch-Site": "same-origin"})[0] == 200
    foreign = [
        "http://evil.example",
        "null",
        f"http://127.0.0.1:{port + 1}",
        "file://",
        f"http://localhost:{port}",
        f"http://127.0.0.1:{port}x",
    ]
    for origin in foreign:
        status, headers, answer = caption(Origin=origin)
        assert status == 403 and headers["x-frame-options"] == "DENY", origin
        assert answer == (
            b'{"error":"requests from pages of other sites are refused; use the '
            b"demo's own page, or a client that is no browser\"}"
        )
    assert caption(**{"Sec-Fetch-Site": "cross-site"})[0] == 403
    assert send(server, path="/api/info", headers={"Origin": "http://evil.example"})[0] == 200


def assert_guarded(headers) -> None:
    assert headers["X-Content-Type-Options"] == "nosniff"
    assert headers["X-Frame-Options"] == "DENY"
    assert headers["Referrer-Policy"] == "no-referrer"
    assert headers["Content-Security-Policy"] == "default-src 'none'; frame-ancestors 'none'"


@pytest.mark.parametrize(
    "request_line", [b"GET /\x00 HTTP/1.1", b"NOT HTTP AT ALL", b"GET / HTTP/9"]
)
def test_a_request_uvicorn_cannot_parse_is_a_400_with_the_security_headers(server, request_line):
    with connect(server) as conn:
        conn.sendall(request_line + b"\r\nHost: 127.0.0.1\r\n\r\n")
        reply = b""
        while chunk := conn.recv(65536):
            reply += chunk
    head, _, body = reply.partition(b"\r\n\r\n")
    status, *lines = head.decode("latin-1").split("\r\n")
    assert status.startswith("HTTP/1.1 400"), reply
    assert_guarded(email.message_from_string("\r\n".join(lines)))
    assert b"Traceback" not in body
    assert send(server, path="/api/info")[0] == 200  # and the demo is up


def test_a_request_without_a_host_is_a_400_and_a_foreign_one_learns_no_names(server):
    with connect(server) as conn:
        conn.sendall(b"GET /api/info HTTP/1.0\r\n\r\n")
        reply = b""
        while chunk := conn.recv(65536):
            reply += chunk
    assert reply.startswith(b"HTTP/1.1 400")
    assert reply.endswith(
        b'{"error":"the request needs one Host header naming the demo\'s address"}'
    )
    status, _, body = send(server, headers={"Host": "evil.example"})
    assert status == 421
    assert not any(name.encode() in body for name in ("127.0.0.1", "localhost", "::1"))


def test_no_page_may_frame_the_demo_and_the_page_runs_only_its_own_code(server):
    status, headers, page = send(server)
    assert status == 200 and headers["x-frame-options"] == "DENY"
    policy = dict(
        part.strip().split(" ", 1) for part in headers["content-security-policy"].split(";")
    )
    assert policy["frame-ancestors"] == "'none'" and policy["default-src"] == "'none'"
    for tag, source in ((b"script", "script-src"), (b"style", "style-src")):
        inline = re.search(rb"<%s>(.*?)</%s>" % (tag, tag), page, re.DOTALL).group(1)
        digest = base64.b64encode(hashlib.sha256(inline).digest()).decode()
        assert policy[source] == f"'sha256-{digest}'"
    for path in ("/api/info", "/nothing"):
        headers = send(server, path=path)[1]
        assert headers["x-frame-options"] == "DENY"
        assert headers["content-security-policy"] == "default-src 'none'; frame-ancestors 'none'"


def test_an_example_swapped_for_a_link_after_start_up_is_not_served(model, images, tmp_path):
    folder = tmp_path / "test"
    folder.mkdir()
    for name in ("a.png", "b.png"):
        shutil.copy(images[0], folder / name)
    outside = tmp_path / "secret.png"
    shutil.copy(images[1], outside)
    settings = ServeSettings(examples=(str(folder / "a.png"), str(folder / "b.png")))
    with BackgroundServer(model, settings) as url:
        assert send(url, path="/api/examples/0")[0] == 200
        os.remove(folder / "a.png")
        (folder / "a.png").symlink_to(outside)
        status, _, body = send(url, path="/api/examples/0")
        assert (status, body) == (404, b'{"error":"example 0 is no longer an image on disk"}')
        (folder / "b.png").write_text("not an image any more")
        assert send(url, path="/api/examples/1")[0] == 404


# --- limits the demo cannot keep --------------------------------------------------------------


def fake_model(image_size: int = 48, max_length: int = 20, limits: ImageLimits | None = None):
    """What :func:`demo_image_limits` reads of a model."""
    config = SimpleNamespace(decode=SimpleNamespace(max_length=max_length))
    return SimpleNamespace(input_size=image_size, config=config, limits=limits or ImageLimits())


def test_limits_from_the_checkpoint_are_bounded():
    huge = ImageLimits(max_pixels=10**12, max_text_bytes=10**9)
    bounded = demo_image_limits(fake_model(limits=huge))
    assert bounded == ImageLimits(MAX_IMAGE_PIXELS, 1 << 20)
    assert demo_image_limits(fake_model(limits=ImageLimits(1000, 10))) == ImageLimits(1000, 10)
    with pytest.raises(
        CaptioningError,
        match=r"^the checkpoint's model.image_size=4,096 is more "
        r"than the web demo serves \(1,024\); caption with",
    ):
        demo_image_limits(fake_model(image_size=4096))
    with pytest.raises(CaptioningError, match=r"decode.max_length=100,000 is more than"):
        demo_image_limits(fake_model(max_length=100_000))


@pytest.mark.parametrize(
    "option, value, message",
    [
        (
            "--max-upload-mb",
            "1e303",
            "--max-upload-mb must be a number above 0 and at most 1024, got 1e+303",
        ),
        ("--timeout", "1e10", "--timeout must be a number above 0 and at most 3600, got 1e+10"),
        (
            "--batch-wait-ms",
            "1e9",
            "--batch-wait-ms must be a number of 0 or more and at most 10000, got 1e+09",
        ),
        (
            "--max-queue",
            "100000",
            "--max-queue must be a number of 0 or more and at most 4096, got 100000",
        ),
    ],
)
def test_serve_refuses_values_it_cannot_keep_before_loading_the_model(
    option, value, message, capsys
):
    assert main(["serve", "--checkpoint", "missing.pt", option, value]) == 2
    assert capsys.readouterr().err == f"error: {message}\n"


def test_serve_names_a_checkpoint_it_cannot_serve(tiny_checkpoint, monkeypatch, capsys):
    from captioning.serve import server

    def huge_captions(checkpoint, device):
        loaded = captioning.load(checkpoint, device)
        monkeypatch.setattr(loaded.config.decode, "max_length", 5000)
        return loaded

    monkeypatch.setattr(server, "load", huge_captions)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = str(probe.getsockname()[1])
    assert main(["serve", "--checkpoint", str(tiny_checkpoint), "--port", port]) == 2
    last = capsys.readouterr().err.splitlines()[-1]  # after the dataset's split sizes
    assert last.startswith(
        "error: the checkpoint's decode.max_length=5,000 is more than the "
        "web demo serves (100); caption with"
    )


def test_the_serve_extra_floors_keep_out_versions_with_advisories():
    text = (Path(__file__).resolve().parents[1] / "pyproject.toml").read_text()
    serve = text[text.index("serve = [") : text.index("]", text.index("serve = ["))]
    floors = {
        name: tuple(map(int, floor.split(".")))
        for name, floor in re.findall(r'"([a-z0-9-]+)>=([0-9.]+)"', serve)
    }
    assert floors["starlette"] >= (1, 3, 1) and floors["h11"] >= (0, 16)
    assert floors["python-multipart"] >= (0, 0, 31)


def test_an_example_is_served_from_the_bytes_it_was_checked_in(images, tmp_path):
    from captioning.serve.origins import read_example

    folder = tmp_path / "test"
    folder.mkdir()
    shutil.copy(images[0], folder / "a.png")
    pinned = os.path.realpath(folder / "a.png")
    data, media_type = read_example(str(folder / "a.png"), pinned)
    assert data == (folder / "a.png").read_bytes() and media_type == "image/png"
    (folder / "a.png").write_bytes(b"\x89PNG not really")  # checked in what is read
    assert read_example(str(folder / "a.png"), pinned) is None
    assert read_example(str(folder / "b.png"), pinned) is None  # another file
