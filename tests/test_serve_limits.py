"""The web demo under load and from elsewhere, on a real server on 127.0.0.1: requests past
the limits refused at once (503 with Retry-After), deadlines, abandoned requests dropped,
concurrent requests captioned together exactly as alone, the Host allow-list, nosniff, the
example files, and a bounded load of hostile uploads that is answered in full."""

from __future__ import annotations

import http.client
import json
import os
import socket
import struct
import threading
import time
import zlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import numpy as np
import pytest
import torch
from PIL import Image

import captioning
from captioning.cli import main
from captioning.data.images import ImageLimits, load_image
from captioning.serve.app import ServeSettings
from captioning.serve.batching import Batcher
from captioning.serve.origins import HostAllowList, example_images, normal_host
from captioning.serve.server import BackgroundServer

from .test_serve import png_bytes, png_declaring


@pytest.fixture(scope="module")
def model(tiny_checkpoint):
    return captioning.load(tiny_checkpoint, device="cpu")


@pytest.fixture(scope="module")
def images(tiny_shapes):
    return sorted(str(p) for p in (tiny_shapes / "images" / "test").glob("*.png"))


def multipart(data: bytes, name: str = "a.png", **fields: object) -> tuple[bytes, str]:
    boundary = "b0undary"
    parts = [
        f'--{boundary}\r\nContent-Disposition: form-data; name="{key}"\r\n\r\n{value}\r\n'.encode()
        for key, value in fields.items()
    ]
    parts.append(
        f'--{boundary}\r\nContent-Disposition: form-data; name="image"; '
        f'filename="{name}"\r\nContent-Type: image/png\r\n\r\n'.encode()
        + data
        + b"\r\n"
    )
    return b"".join(
        parts
    ) + f"--{boundary}--\r\n".encode(), f"multipart/form-data; boundary={boundary}"


def send(
    url: str,
    method: str = "GET",
    path: str = "/",
    body: bytes | None = None,
    headers: dict | None = None,
    timeout: float = 60,
) -> tuple[int, Any, bytes]:
    """(status, headers, body) of one request on a connection of its own."""
    address = urlsplit(url)
    connection = http.client.HTTPConnection(address.hostname, address.port, timeout=timeout)
    try:
        connection.request(method, path, body=body, headers=headers or {})
        answer = connection.getresponse()
        return answer.status, answer.headers, answer.read()  # headers: any case
    finally:
        connection.close()


def post(url: str, data: bytes, name: str = "a.png", **fields: object) -> tuple[int, Any, dict]:
    body, content_type = multipart(data, name, **fields)
    status, headers, payload = send(
        url, "POST", "/api/caption", body, {"Content-Type": content_type}
    )
    return status, headers, json.loads(payload) if payload else {}


class Gate:
    """Stands in for ``model.caption_inputs``: holds every batch until opened."""

    def __init__(self, model: captioning.CaptionModel) -> None:
        self.inner = model.caption_inputs
        self.entered = threading.Event()
        self.opened = threading.Event()
        self.batches: list[int] = []

    def __call__(self, inputs: torch.Tensor, **decoding):
        self.batches.append(len(inputs))
        self.entered.set()
        assert self.opened.wait(30)
        return self.inner(inputs, **decoding)


def wait_until(condition, seconds: float = 10) -> None:
    until = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < until, "the server did not get there in time"
        time.sleep(0.01)


def read(path: str) -> bytes:
    return Path(path).read_bytes()


# --- limits -----------------------------------------------------------------------------------


def test_past_the_queue_a_request_is_refused_at_once(model, images, monkeypatch):
    gate = Gate(model)
    monkeypatch.setattr(model, "caption_inputs", gate)
    server = BackgroundServer(model, ServeSettings(max_in_flight=1, max_queue=1))
    with server as url, ThreadPoolExecutor(2) as pool:
        first = pool.submit(post, url, read(images[0]))  # in flight, held at the model
        assert gate.entered.wait(10)
        second = pool.submit(post, url, read(images[1]))  # waits for the slot
        wait_until(lambda: server.app.state.admission.waiting == 1)
        started = time.monotonic()
        big = b"\0" * 250_000  # the whole upload: refused without waiting for it to be read
        status, headers, answer = post(url, big)
        assert status == 503 and time.monotonic() - started < 5
        assert headers["Retry-After"] == "1" and headers["x-content-type-options"] == "nosniff"
        assert answer == {
            "error": "the server is busy (1 requests in flight, 1 waiting); try again in a moment"
        }
        gate.opened.set()
        assert first.result()[0] == second.result()[0] == 200


def test_a_request_past_its_deadline_is_a_503_and_its_work_is_dropped(model, images, monkeypatch):
    gate = Gate(model)
    monkeypatch.setattr(model, "caption_inputs", gate)
    server = BackgroundServer(model, ServeSettings(timeout=0.5, max_batch=1))
    with server as url, ThreadPoolExecutor(2) as pool:
        started = time.monotonic()
        answers = list(pool.map(lambda path: post(url, read(path)), images[:2]))
        assert 0.5 <= time.monotonic() - started < 5
        for status, headers, answer in answers:
            assert status == 503 and headers["Retry-After"] == "1"
            assert answer == {
                "error": "the server could not answer within 0.5 s (--timeout); "
                "try again in a moment"
            }
        gate.opened.set()  # the first batch ends; the second request's was never started
        stats = server.app.state.batcher.stats
        wait_until(lambda: stats.captioned + stats.dropped == 2)
        assert (stats.captioned, stats.dropped, gate.batches) == (1, 1, [1])
        assert post(url, read(images[0]))[0] == 200  # and the server is still up


def test_a_request_whose_client_has_gone_is_dropped_before_the_model(model, images, monkeypatch):
    gate = Gate(model)
    monkeypatch.setattr(model, "caption_inputs", gate)
    server = BackgroundServer(model, ServeSettings(max_batch=1))
    with server as url, ThreadPoolExecutor(1) as pool:
        first = pool.submit(post, url, read(images[0]))
        assert gate.entered.wait(10)
        body, content_type = multipart(read(images[1]))
        host, port = urlsplit(url).hostname, urlsplit(url).port
        with socket.create_connection((host, port), timeout=10) as leaving:
            leaving.sendall(
                f"POST /api/caption HTTP/1.1\r\nHost: {host}\r\nContent-Type: "
                f"{content_type}\r\nContent-Length: {len(body)}\r\n\r\n".encode()
                + body
            )
            wait_until(lambda: server.app.state.batcher.queued == 1)  # decoded, waiting
        wait_until(lambda: server.app.state.admission.running == 1)  # its handler has ended
        gate.opened.set()
        assert first.result()[0] == 200
        stats = server.app.state.batcher.stats
        wait_until(lambda: stats.dropped == 1)
        assert stats.captioned == 1 and gate.batches == [1]


# --- batching ---------------------------------------------------------------------------------


def test_a_batch_gives_each_image_what_it_gets_alone(model, images):
    """Tokens, words and cells equal; attention equal up to float32 summation order (the
    batched matrix products add in another order than one image's)."""
    inputs = [model.prepare(load_image(path)) for path in images[:4]]
    keys = [(2, None), (1, None)] * 2
    batcher = Batcher(model, max_batch=8, wait=1.0)
    with batcher.coming():  # one more on its way: the others are gathered with the first
        futures = [batcher.submit(x, key) for x, key in zip(inputs, keys)]
    together = [future.result(timeout=60) for future in futures]
    batcher.close()
    assert batcher.stats.batches == 2 and batcher.stats.largest == 2
    for x, (beam, _), caption in zip(inputs, keys, together):
        alone = model.caption_inputs(x[None], beam_size=beam)[0]
        assert caption.words == alone.words and caption.cells == alone.cells
        assert caption.alphas.shape == alone.alphas.shape
        assert torch.allclose(caption.alphas, alone.alphas, atol=1e-6, rtol=0)
        assert caption.image.size == (model.input_size, model.input_size)


def test_concurrent_requests_are_captioned_together_as_they_are_alone(model, images):
    sent = images[:4]
    server = BackgroundServer(model, ServeSettings(max_batch=len(sent), batch_wait=1.0))
    with server as url, ThreadPoolExecutor(len(sent)) as pool:
        answers = list(pool.map(lambda path: post(url, read(path), beam_size=2), sent))
        stats = server.app.state.batcher.stats
    assert stats.largest > 1 and stats.captioned == len(sent)
    for path, (status, _, answer) in zip(sent, answers):
        alone = model.caption(path, beam_size=2).to_dict()
        assert status == 200 and answer["words"] == alone["words"]
        # the API sends 4 decimals: at most one unit apart, where a sum rounds the other way
        assert np.allclose(answer["attention"], alone["attention"], atol=1.01e-4, rtol=0)


def test_a_failing_batch_is_a_500_without_internals_and_nosniff(model, images, monkeypatch):
    def broken(inputs, **decoding):
        raise RuntimeError("/secret/path: CUDA out of memory")

    monkeypatch.setattr(model, "caption_inputs", broken)
    with BackgroundServer(model) as url:
        status, headers, answer = post(url, read(images[0]))
    assert status == 500 and headers["x-content-type-options"] == "nosniff"
    assert answer == {"error": "internal error; the server's log has the details"}


# --- origins ----------------------------------------------------------------------------------


def test_a_foreign_host_is_a_421_and_every_answer_says_nosniff(model, images):
    with BackgroundServer(model, ServeSettings(examples=tuple(images[:1]))) as url:
        port = urlsplit(url).port
        for host in (f"127.0.0.1:{port}", f"localhost:{port}", f"[::1]:{port}", "LOCALHOST."):
            status, headers, _ = send(url, headers={"Host": host})
            assert status == 200 and headers["x-content-type-options"] == "nosniff"
        for host in ("evil.example", f"evil.example:{port}", "127.0.0.1.nip.io", "10.0.0.1"):
            status, headers, body = send(url, headers={"Host": host})
            assert status == 421 and headers["x-content-type-options"] == "nosniff"
            assert json.loads(body) == {
                "error": "this demo does not answer to that host name; "
                "start it with --allow-host NAME to answer to "
                "another"
            }
            assert send(url, "POST", "/api/caption", b"x", {"Host": host})[0] == 421
        for path in ("/api/info", "/api/examples/0", "/api/examples/9", "/nothing"):
            assert send(url, path=path)[1]["x-content-type-options"] == "nosniff"
        status, headers, _ = send(url, path="/api/examples/0")
        assert status == 200 and headers["content-type"] == "image/png"


def test_the_hosts_answered_follow_the_address_listened_on(monkeypatch):
    monkeypatch.setattr(socket, "gethostname", lambda: "Lab-Box")
    local = HostAllowList.for_address("127.0.0.1")
    assert local.names == {"127.0.0.1", "localhost", "::1"} and not local.any_address
    assert local.allows("localhost:8000") and not local.allows("lab-box")
    every = HostAllowList.for_address("0.0.0.0", ["demo.example.org"])
    assert every.allows("192.168.1.20:8000") and every.allows("[fe80::1]:80")
    assert every.allows("lab-box") and every.allows("demo.example.org.")
    assert not every.allows("attacker.example") and not every.allows("192.168.1.20.nip.io")
    one = HostAllowList.for_address("192.168.1.20")
    assert one.names == {"192.168.1.20"} and not one.allows("localhost")
    assert HostAllowList.for_address("192.168.1.20", ["*"]).allows("anything.example")
    assert [normal_host(h) for h in ("[::1]:80", "A.B:1", "::1", "x.")] == [
        "::1",
        "a.b",
        "::1",
        "x",
    ]


def test_examples_come_only_from_the_test_image_folder_and_are_images(model, tmp_path):
    data = model.config.data
    found = example_images(data)
    folder = os.path.realpath(Path(data.root) / "images" / "test")
    assert len(found) == 6 and all(e.path.startswith(folder + os.sep) for e in found)
    assert {e.media_type for e in found} == {"image/png"}
    assert example_images(replace(data, images="/etc")) == ()
    assert example_images(replace(data, images="images/../../{split}")) == ()
    # a copy of the dataset whose test folder holds a link out, a text file and one image
    root = tmp_path / "data"
    for name in ("annotations", "images/test"):
        (root / name).mkdir(parents=True)
    for split in ("train", "val", "test"):
        source = Path(data.root) / "annotations" / f"captions_{split}.json"
        (root / "annotations" / f"captions_{split}.json").write_bytes(source.read_bytes())
    names = sorted(p.name for p in (Path(data.root) / "images" / "test").iterdir())
    outside = tmp_path / "outside.png"
    Image.new("RGB", (8, 8)).save(outside)
    (root / "images" / "test" / names[0]).symlink_to(outside)
    (root / "images" / "test" / names[1]).write_text("not an image")
    Image.new("RGB", (8, 8)).save(root / "images" / "test" / names[2])
    copy = replace(data, root=str(root), instances=None)
    assert [Path(e.path).name for e in example_images(copy)] == [names[2]]


def test_serve_refuses_limits_it_cannot_keep_before_loading(capsys):
    for option, value, message in [
        (
            "--max-upload-mb",
            "inf",
            "--max-upload-mb must be a number above 0 and at most 1024, got inf",
        ),
        ("--max-queue", "-1", "--max-queue must be a number of 0 or more and at most 4096, got -1"),
        (
            "--batch-wait-ms",
            "nan",
            "--batch-wait-ms must be a number of 0 or more and at most 10000, got nan",
        ),
    ]:
        assert main(["serve", "--checkpoint", "missing.pt", option, value]) == 2
        assert capsys.readouterr().err == f"error: {message}\n"


# --- a bounded load of hostile uploads --------------------------------------------------------


def zero_png(width: int, height: int) -> bytes:
    """A valid black RGB PNG, compressed to almost nothing (the most pixels per byte)."""
    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    raw = zlib.compress(b"\0" * ((3 * width + 1) * height), 9)

    def chunk(kind: bytes, data: bytes) -> bytes:
        return (
            struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
        )

    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", raw) + chunk(b"IEND", b"")


def test_a_burst_of_hostile_uploads_is_answered_in_full(model, images, monkeypatch):
    """48 clients at once on 12 places: pictures at the pixel cap, the same cut short,
    bombs past it, uploads past the size limit and plain images; each answered 200, 4xx or
    503 within the deadline, and the server still captions afterwards."""
    monkeypatch.setattr(model, "limits", ImageLimits(max_pixels=1_500_000))
    at_cap = zero_png(1500, 1000)
    uploads = [
        at_cap,
        at_cap[: len(at_cap) // 2],
        png_declaring(3000, 3000),
        b"\0" * 300_000,
        read(images[0]),
        png_bytes(Image.new("RGB", (60, 40))),
    ]
    settings = ServeSettings(max_in_flight=4, max_queue=8, timeout=5.0, max_upload_bytes=200_000)
    server = BackgroundServer(model, settings)
    with server as url, ThreadPoolExecutor(48) as pool:
        started = time.monotonic()
        answers = list(pool.map(lambda i: post(url, uploads[i % len(uploads)]), range(48)))
        seconds = time.monotonic() - started
        after = post(url, read(images[1]))
        admission = server.app.state.admission  # a batch past a deadline gives its slot back
        wait_until(lambda: admission.running == 0 and admission.waiting == 0, seconds=5)
    statuses = [status for status, *_ in answers]
    assert set(statuses) <= {200, 400, 413, 503} and 503 in statuses and 200 in statuses
    assert all(set(answer) <= {"error"} or "caption" in answer for *_, answer in answers)
    assert all("\n" not in answer.get("error", "") for *_, answer in answers)
    assert seconds < 5.0 + 3 and after[0] == 200


def test_connections_send_without_waiting_for_acknowledgements():
    """The listening socket says it is TCP and turns Nagle's algorithm off, and the
    connections it accepts inherit that: an answer's body is never held back until the
    client acknowledges its headers (a 40 ms stall per request on Linux)."""
    from captioning.serve.server import listen

    sock = listen("127.0.0.1", 0)
    try:
        assert sock.proto == socket.IPPROTO_TCP  # what asyncio checks before its own NODELAY
        assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)
        client = socket.create_connection(sock.getsockname())
        connection, _ = sock.accept()
        with client, connection:
            assert connection.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)
    finally:
        sock.close()
