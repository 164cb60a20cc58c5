"""The web demo's JSON API on a real server on 127.0.0.1: answers, concurrency, and every
kind of bad input answered 4xx with one line while the server stays up."""

import json
import socket
import struct
import sys
import urllib.error
import urllib.request
import uuid
import zlib
from concurrent.futures import ThreadPoolExecutor
from io import BytesIO

import pytest
from PIL import Image

import captioning
from captioning.cli import main
from captioning.errors import CaptioningError
from captioning.serve import require
from captioning.serve.app import ServeSettings
from captioning.serve.server import BackgroundServer

LIMIT = 300_000  # bytes: the upload limit of the test server


def request(url: str, files=None, fields=None, body=None, headers=None):
    """(status, json) of a GET, or of a multipart POST of ``files`` {name: (filename, bytes)}."""
    headers = dict(headers or {})
    if files is not None or fields is not None:
        boundary = uuid.uuid4().hex
        parts = []
        for name, value in (fields or {}).items():
            parts.append(
                f'--{boundary}\r\nContent-Disposition: form-data; name="{name}"\r\n\r\n'
                f"{value}\r\n".encode()
            )
        for name, (filename, data) in (files or {}).items():
            parts.append(
                f'--{boundary}\r\nContent-Disposition: form-data; name="{name}"; '
                f'filename="{filename}"\r\nContent-Type: image/png\r\n\r\n'.encode()
                + data
                + b"\r\n"
            )
        body = b"".join(parts) + f"--{boundary}--\r\n".encode()
        headers["Content-Type"] = f"multipart/form-data; boundary={boundary}"
    req = urllib.request.Request(url, data=body, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=120) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def png_bytes(image: Image.Image) -> bytes:
    buffer = BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def png_declaring(width: int, height: int) -> bytes:
    """A small PNG whose header says ``width`` x ``height`` (a decompression bomb's shape)."""
    data = bytearray(png_bytes(Image.new("RGB", (8, 8))))
    ihdr = data.index(b"IHDR")
    data[ihdr + 4 : ihdr + 12] = struct.pack(">II", width, height)
    data[ihdr + 17 : ihdr + 21] = struct.pack(">I", zlib.crc32(bytes(data[ihdr : ihdr + 17])))
    return bytes(data)


@pytest.fixture(scope="module")
def model(tiny_checkpoint):
    return captioning.load(tiny_checkpoint, device="cpu")


@pytest.fixture(scope="module")
def images(tiny_shapes):
    return sorted(str(p) for p in (tiny_shapes / "images" / "test").glob("*.png"))[:3]


@pytest.fixture(scope="module")
def server(model, images):
    with BackgroundServer(model, ServeSettings(max_upload_bytes=LIMIT, examples=images)) as url:
        yield url


def caption(url: str, path: str, **fields):
    with open(path, "rb") as f:
        return request(f"{url}/api/caption", files={"image": ("x.png", f.read())}, fields=fields)


def test_the_api_answers_what_the_python_api_gives(server, model, images):
    status, answer = caption(server, images[0], beam_size=2)
    assert status == 200
    expected = model.caption(images[0], beam_size=2)
    assert answer["caption"] == expected.caption and answer["words"] == expected.words
    rows, cols = answer["grid"]
    assert (rows, cols) == model.grid_shape and len(answer["attention"]) == len(answer["words"])
    assert all(len(m) == rows and all(len(r) == cols for r in m) for m in answer["attention"])
    assert abs(sum(map(sum, answer["attention"][0])) - 1) < 1e-2
    assert answer["cells"] is None and answer["heads"] is None and answer["centres"] is None


def test_the_api_answers_a_local_models_centres(tiny_local_checkpoint, images):
    local = captioning.load(tiny_local_checkpoint, device="cpu")
    with BackgroundServer(local, ServeSettings(max_upload_bytes=LIMIT)) as url:
        status, answer = caption(url, images[0], beam_size=2)
    assert status == 200
    assert answer == json.loads(json.dumps(local.caption(images[0], beam_size=2).to_dict()))
    assert len(answer["centres"]) == len(answer["words"]) > 0 and answer["heads"] is None


def test_fifty_concurrent_requests_are_all_answered_correctly(server, model, images):
    expected = {path: model.caption(path).caption for path in images}
    jobs = [images[i % len(images)] for i in range(50)]
    with ThreadPoolExecutor(max_workers=25) as pool:
        answers = list(pool.map(lambda path: caption(server, path), jobs))
    assert [status for status, _ in answers] == [200] * 50
    assert [answer["caption"] for _, answer in answers] == [expected[path] for path in jobs]


TRUNCATED = png_bytes(Image.effect_noise((64, 64), 50).convert("RGB"))[:-300]

BAD = {
    "text file named .png": (
        {"image": ("notes.png", b"hello, not an image\n")},
        {},
        400,
        "notes.png: not a JPEG, PNG, WebP, GIF, BMP or TIFF image",
    ),
    "truncated image": (
        {"image": ("cut.png", TRUNCATED)},
        {},
        400,
        "cut.png: image is truncated or corrupt",
    ),
    "decompression bomb": (
        {"image": ("bomb.png", png_declaring(12000, 12000))},
        {},
        400,
        "bomb.png: image is 12000 x 12000 = 144,000,000 pixels",
    ),
    "oversized upload": (
        {"image": ("big.png", b"\0" * (LIMIT + 1))},
        {},
        413,
        "the upload is larger than the limit of 0.286102 MB",
    ),
    "empty file": ({"image": ("empty.png", b"")}, {}, 400, "empty.png: file is empty"),
    "no image field": ({"photo": ("a.png", b"x")}, {}, 400, "no image: send the file"),
    "bad beam size": (None, {"beam_size": "many"}, 400, "beam_size must be a whole number"),
}


@pytest.mark.parametrize("kind", list(BAD))
def test_bad_input_is_a_4xx_with_one_line_and_the_server_stays_up(server, images, kind):
    files, fields, status, message = BAD[kind]
    if files is None:
        files = {"image": ("a.png", open(images[0], "rb").read())}
    answer_status, answer = request(f"{server}/api/caption", files=files, fields=fields)
    assert answer_status == status
    assert set(answer) == {"error"} and answer["error"].startswith(message)
    assert "\n" not in answer["error"]
    assert caption(server, images[0])[0] == 200  # still up, still captioning


def test_a_body_that_is_not_a_form_is_a_400(server):
    status, answer = request(
        f"{server}/api/caption", body=b"{}", headers={"Content-Type": "application/json"}
    )
    assert status == 400 and answer["error"].startswith("no image")


def test_an_upload_without_a_declared_length_is_cut_at_the_limit(server):
    """A chunked body has no Content-Length to refuse up front: reading stops at the limit."""
    host, port = server.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as conn:
        conn.sendall(
            b"POST /api/caption HTTP/1.1\r\nHost: 127.0.0.1\r\nTransfer-Encoding: "
            b"chunked\r\nContent-Type: multipart/form-data; boundary=b\r\n"
            b"\r\n"
        )
        part = b'--b\r\nContent-Disposition: form-data; name="image"; filename="a.png"\r\n\r\n'
        conn.sendall(b"%x\r\n" % len(part) + part + b"\r\n")
        chunk = b"\0" * 65536
        for _ in range(LIMIT // len(chunk) + 2):
            conn.sendall(b"%x\r\n" % len(chunk) + chunk + b"\r\n")
        conn.sendall(b"0\r\n\r\n")
        reply = b""
        while not reply.endswith(b"}") and (part := conn.recv(65536)):  # headers, then body
            reply += part
    reply = reply.decode(errors="replace")
    assert reply.startswith("HTTP/1.1 413") and "larger than the limit" in reply


def test_the_page_info_and_examples(server, model, images):
    with urllib.request.urlopen(server + "/", timeout=30) as page:
        assert "<title>Show, Attend and Tell</title>" in page.read().decode()
    status, info = request(f"{server}/api/info")
    assert status == 200 and info["attention"] == "soft" and info["hard_contexts"] == []
    assert info["image_size"] == model.model.encoder.image_size  # what the page says it saw
    assert [e["name"] for e in info["examples"]] == [p.rsplit("/", 1)[1] for p in images]
    with urllib.request.urlopen(server + info["examples"][0]["url"], timeout=30) as example:
        assert example.read() == open(images[0], "rb").read()
    assert request(f"{server}/api/examples/7") == (404, {"error": "no example 7: there are 3"})
    # not a number of examples, however long: a 404 that names it, never a 500
    for name in ("9" * 5000, "-1", "x", "%C2%B2", "1e3"):
        status, answer = request(f"{server}/api/examples/{name}")
        assert status == 404 and "examples are numbered from 0" in answer["error"], name


def test_a_hard_attention_model_offers_its_decode_modes(tiny_hard_checkpoint, images):
    hard = captioning.load(tiny_hard_checkpoint, device="cpu")
    with BackgroundServer(hard) as url:
        _, info = request(f"{url}/api/info")
        assert info["attention"] == "hard" and "argmax" in info["hard_contexts"]
        status, answer = caption(url, images[0], hard_context="argmax")
        assert status == 200 and len(answer["cells"]) == len(answer["words"])
        assert answer["words"] == hard.caption(images[0], hard_context="argmax").words
        status, answer = caption(url, images[0], hard_context="psychic")
        assert status == 400 and answer["error"].startswith("hard_context must be one of")


def test_serve_refuses_a_port_in_use_in_one_line(tiny_checkpoint, capsys):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = str(taken.getsockname()[1])
        assert main(["serve", "--checkpoint", str(tiny_checkpoint), "--port", port]) == 2
    assert capsys.readouterr().err.startswith(f"error: cannot listen on 127.0.0.1:{port} (")
    with pytest.raises(SystemExit) as exit:  # argparse's usage error
        main(["serve", "--checkpoint", str(tiny_checkpoint), "--max-upload-mb", "0"])
    assert exit.value.code == 2
    assert "--max-upload-mb: must be a positive number, got '0'" in capsys.readouterr().err


def test_a_missing_extra_is_named_in_one_line(monkeypatch):
    monkeypatch.setitem(sys.modules, "uvicorn", None)
    with pytest.raises(
        CaptioningError, match=r"needs the serve extra .*pip install -e '.\[serve\]'"
    ):
        require()


def test_a_checkpoints_own_beam_is_kept_within_what_the_page_offers(model):
    """A client that sends no beam size gets the model's, but never more beams than
    /api/info advertises; one that asks for more is refused."""
    from dataclasses import replace

    from captioning.serve.app import BadRequest, decoding_fields

    settings = ServeSettings(max_beam_size=8)
    wide = replace(model.config.decode, strategy="beam", beam_size=40)
    original = model.config.decode
    model.config.decode = wide
    try:
        assert decoding_fields({}, model, settings) == {"beam_size": 8}
        assert decoding_fields({"beam_size": "3"}, model, settings) == {"beam_size": 3}
        with pytest.raises(BadRequest, match="from 1 to 8"):
            decoding_fields({"beam_size": "9"}, model, settings)
        model.config.decode = replace(wide, beam_size=5)
        assert decoding_fields({}, model, settings) == {}  # the model's own 5
    finally:
        model.config.decode = original


def test_the_cli_bounds_the_beam(capsys, tiny_checkpoint, images):
    with pytest.raises(SystemExit) as stopped:
        main(["caption", images[0], "--checkpoint", str(tiny_checkpoint), "--beam-size", "65"])
    assert stopped.value.code == 2
    assert "--beam-size: must be at most 64, got '65'" in capsys.readouterr().err
