"""What a user feeds the project, generated instead of written by hand: caption files in
every format, ``--set`` values, config files and the demo's form fields (hypothesis), and a
corpus of damaged photographs made here from the shared real ones (truncated, bit-flipped,
scans repeated, sizes in the header past any real picture) pushed through check-data, the
Python API and the demo. Everything must end in a result or one line that says what went
wrong: no traceback, no 5xx, no decode past 2 s of CPU, nothing written where it was not
asked to be."""

import io
import json
import os
import struct
import subprocess
import sys
import time
import zlib
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from PIL import Image

import captioning
from captioning.config import Config, config_to_dict, load_config
from captioning.data.images import MAX_JPEG_SCANS, check_images
from captioning.errors import CaptioningError, ConfigError, DataError
from captioning.prepare.formats import FORMATS, read_captions
from captioning.serve.server import BackgroundServer

from .test_serve_limits import multipart, send

ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT.parent / "shared" / "data"
# CAPTIONING_FUZZ_EXAMPLES=2000 searches longer, from a random start
EXAMPLES = int(os.environ.get("CAPTIONING_FUZZ_EXAMPLES", "60"))
FUZZ = settings(
    max_examples=EXAMPLES,
    deadline=None,
    derandomize=EXAMPLES <= 60,  # the default run takes the same examples every time
    database=None,  # nothing written into the checkout
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


def one_line(error: BaseException) -> str:
    message = str(error)
    assert message and "\n" not in message and "Traceback" not in message, message
    return message


# --------------------------------------------------------------------------- caption files

NAMES = st.sampled_from(["a.jpg", "b.png", "dir/c.jpeg", "../x.jpg", "d.JPG", "e", "", "f.jpg#1"])
SEPARATORS = st.sampled_from([",", "\t", "|", "#0\t", "| 0|", " ", ";", ",,"])
SCALARS = st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=12)
JSON_VALUES = st.recursive(
    SCALARS,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner),
    max_leaves=8,
)
KEYS = st.sampled_from(
    [
        "image",
        "caption",
        "captions",
        "images",
        "annotations",
        "id",
        "file_name",
        "image_id",
        "filename",
        "sentences",
    ]
)
LINES = st.one_of(
    st.text(max_size=60),
    st.builds(lambda n, s, c: f"{n}{s}{c}", NAMES, SEPARATORS, st.text(max_size=40)),
    st.sampled_from(
        [
            "image,caption",
            "image\tcaption",
            "caption,image",
            '"',
            "\ufeff",
            "\x00",
            "image_name| comment_number| comment",
            "{",
            "[",
            "}",
        ]
    ),
    st.dictionaries(KEYS, JSON_VALUES, max_size=4).map(json.dumps),
)
CAPTION_FILES = st.one_of(
    st.lists(LINES, max_size=12).map("\n".join).map(lambda text: text.encode("utf-8", "replace")),
    st.dictionaries(KEYS, JSON_VALUES, max_size=3).map(lambda d: json.dumps(d).encode()),
    st.binary(max_size=300),
)


@FUZZ
@given(content=CAPTION_FILES, format=st.sampled_from(("auto", *FORMATS)))
def test_any_caption_file_is_read_or_refused_in_one_line(tmp_path, content, format):
    path = tmp_path / "captions.txt"
    path.write_bytes(content)
    try:
        table = read_captions(path, tmp_path / "images", format)
    except DataError as error:
        one_line(error)
        return
    assert table.format in FORMATS


# --------------------------------------------------------------------------- --set values

DEFAULT_KEYS = sorted(
    f"{section}.{key}" for section, values in config_to_dict(Config()).items() for key in values
)
VALUES = st.one_of(
    st.text(max_size=30),
    st.sampled_from(
        [
            "null",
            "~",
            "[",
            "{a: 1}",
            "[1, [2]]",
            "1e400",
            "-1",
            "nan",
            ".inf",
            "&a [*a]",
            "!!python/object:os.system",
            "0x10",
            "true",
            "''",
        ]
    ),
    JSON_VALUES.map(json.dumps),
)


@FUZZ
@given(key=st.sampled_from(DEFAULT_KEYS) | st.text(max_size=20), value=VALUES)
@example(key="0\n0", value="")  # a key with a line break: quoted, on one line
def test_any_set_value_is_taken_or_refused_in_one_line(key, value):
    try:
        cfg = load_config(None, [f"{key}={value}"])
    except ConfigError as error:
        one_line(error)
        return
    assert isinstance(cfg, Config)


# --------------------------------------------------------------------------- config files

SECTIONS = st.sampled_from(["model", "train", "data", "decode", "runtime", "base", "x"])
CONFIG_FILES = st.one_of(
    st.dictionaries(
        SECTIONS,
        st.dictionaries(
            st.sampled_from([k.split(".")[1] for k in DEFAULT_KEYS]), JSON_VALUES, max_size=3
        )
        | JSON_VALUES,
        max_size=4,
    ).map(json.dumps),
    st.text(max_size=200),
)


@FUZZ
@given(text=CONFIG_FILES)
@example(text='{"model": {"\\n": null}}')
def test_any_config_file_is_taken_or_refused_in_one_line(tmp_path, text):
    path = tmp_path / "config.yaml"
    path.write_text(text, encoding="utf-8", errors="surrogatepass")
    try:
        cfg = load_config(path)
    except CaptioningError as error:
        one_line(error)
        return
    assert isinstance(cfg, Config)


# --------------------------------------------------------------------------- the demo's form


@pytest.fixture(scope="module")
def model(tiny_checkpoint):
    return captioning.load(tiny_checkpoint, device="cpu")


@pytest.fixture(scope="module")
def server(model):
    with BackgroundServer(model) as url:
        yield url


def png(size: tuple[int, int] = (40, 30)) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", size, (200, 80, 20)).save(buffer, "PNG")
    return buffer.getvalue()


FIELD_VALUES = st.text(max_size=20) | st.sampled_from(["3", "0", "-1", "1e9", "nan", "²", " 2"])


@FUZZ
@given(
    fields=st.dictionaries(
        st.sampled_from(["beam_size", "hard_context", "x", "image"]), FIELD_VALUES, max_size=3
    ),
    name=st.text(max_size=30),
    data=st.sampled_from([b"", b"\x89PNG", b"GIF89a", b"\xff\xd8\xff"])
    | st.binary(max_size=64)
    | st.just(png()),
)
def test_any_form_gets_an_answer_below_500(server, fields, name, data):
    name = name.replace('"', "").replace("\r", "").replace("\n", "")
    body, content_type = multipart(data, name or "a.png", **fields)
    status, _, payload = send(server, "POST", "/api/caption", body, {"Content-Type": content_type})
    assert status < 500, payload
    if status >= 400:
        assert "\n" not in json.loads(payload)["error"]


# --------------------------------------------------------------------------- damaged photos


def _flip(data: bytes, rng: np.random.Generator, count: int, start: int = 0) -> bytes:
    out = bytearray(data)
    for index in rng.integers(start, len(out), count):
        out[index] ^= 1 << int(rng.integers(0, 8))
    return bytes(out)


def _jpeg_size(data: bytes, width: int, height: int) -> bytes:
    """``data`` with the size in its frame header (SOF0/SOF2) replaced."""
    for marker in (b"\xff\xc0", b"\xff\xc2"):
        at = data.find(marker)
        if at >= 0:
            return data[: at + 5] + struct.pack(">HH", height, width) + data[at + 9 :]
    raise AssertionError("no frame header")


def _png_size(data: bytes, width: int, height: int) -> bytes:
    """``data`` (a PNG) with the size in its IHDR replaced, and its CRC made right."""
    body = b"IHDR" + struct.pack(">II", width, height) + data[24:29]
    return data[:12] + body + struct.pack(">I", zlib.crc32(body)) + data[33:]


def _progressive(picture: Image.Image, repeats: int) -> bytes:
    buffer = io.BytesIO()
    picture.save(buffer, "JPEG", progressive=True, quality=85)
    data = buffer.getvalue()
    last, end = data.rfind(b"\xff\xda"), data.rfind(b"\xff\xd9")
    return data[:end] + data[last:end] * repeats + data[end:]


def damaged(photo: Path, seed: int) -> dict[str, bytes]:
    """A real photo made into the files a user should not send: each name says how."""
    data = photo.read_bytes()
    rng = np.random.default_rng(seed)
    picture = Image.open(io.BytesIO(data)).convert("RGB")
    as_png = io.BytesIO()
    picture.save(as_png, "PNG")
    stem = photo.stem
    return {
        f"{stem}-cut10.jpg": data[: len(data) // 10],
        f"{stem}-cut90.jpg": data[: len(data) * 9 // 10],
        f"{stem}-header-flips.jpg": _flip(data, rng, 4, start=2)[:600] + data[600:],
        f"{stem}-body-flips.jpg": _flip(data, rng, 40, start=600),
        f"{stem}-scans.jpg": _progressive(picture, MAX_JPEG_SCANS + 50),
        f"{stem}-huge.jpg": _jpeg_size(data, 65000, 65000),
        f"{stem}-zero.jpg": _jpeg_size(data, 0, 480),
        f"{stem}-huge.png": _png_size(as_png.getvalue(), 200_000, 200_000),
        f"{stem}-png-cut.png": as_png.getvalue()[: len(as_png.getvalue()) // 2],
    }


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    photos = [
        SHARED / "flickr8k" / "Flicker8k_Dataset",
        SHARED / "coco_mini" / "train2017",
        SHARED / "photos_vi" / "images",
    ]
    if not all(folder.is_dir() for folder in photos):
        pytest.skip(f"the damaged-photo corpus is made from ../shared/data ({photos[0]} ...)")
    folder = tmp_path_factory.mktemp("damaged")
    for seed, source in enumerate(photos):
        photo = sorted(p for p in source.iterdir() if p.suffix.lower() in (".jpg", ".jpeg"))[0]
        for name, data in damaged(photo, seed).items():
            (folder / name).write_bytes(data)
    return folder


def listing(folder: Path) -> dict[str, int]:
    return {str(p): p.stat().st_mtime_ns for p in folder.rglob("*")}


def test_damaged_photos_are_reported_by_check_data_in_a_line_each(corpus, tiny_shapes, tmp_path):
    """check-data over a data set whose training images are the damaged photos."""
    data = tmp_path / "data"
    subprocess.run(["cp", "-r", str(tiny_shapes), str(data)], check=True)
    train = sorted((data / "images" / "train").iterdir())
    damaged_files = sorted(corpus.iterdir())
    for target, source in zip(train, damaged_files):
        target.write_bytes(source.read_bytes())
    before = listing(data)
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    args = [
        sys.executable,
        "-m",
        "captioning",
        "check-data",
        "--config",
        str(ROOT / "configs" / "test_tiny.yaml"),
        "--set",
        f"data.root={data}",
    ]
    result = subprocess.run(args, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 1, result.stderr[-2000:]  # bad images found, each named
    assert "Traceback" not in result.stderr
    said = result.stdout + result.stderr
    reported = {path.name for path in train if f"{path}:" in said}
    refused = {
        path.name for path, source in zip(train, damaged_files) if check_images([str(source)])
    }
    assert reported == refused and len(refused) >= 15, (sorted(reported), sorted(refused))
    assert listing(data) == before  # nothing written


def test_each_damaged_photo_is_decoded_or_refused_within_2_s_of_cpu(corpus):
    for path in sorted(corpus.iterdir()):
        started = time.process_time()
        problems = check_images([str(path)], num_threads=1)
        seconds = time.process_time() - started
        assert seconds < 2.0, (path.name, seconds)
        for _, problem in problems:
            assert "\n" not in problem and problem, path.name
    refused = {Path(p).name for p, _ in check_images([str(p) for p in corpus.iterdir()])}
    for kind in ("cut10", "scans", "huge.jpg", "zero", "huge.png"):
        assert any(kind in name for name in refused), (kind, sorted(refused))


def test_damaged_photos_through_the_api_and_the_demo(corpus, model, server, tmp_path):
    before = listing(corpus)
    for path in sorted(corpus.iterdir()):
        started = time.process_time()
        try:
            model.caption(str(path))
        except DataError as error:
            assert path.name in one_line(error)
        assert time.process_time() - started < 2.0, path.name
        body, content_type = multipart(path.read_bytes(), path.name)
        status, _, payload = send(
            server, "POST", "/api/caption", body, {"Content-Type": content_type}
        )
        assert status == 200 or 400 <= status < 500, (path.name, status, payload)
        if status != 200:
            assert "\n" not in json.loads(payload)["error"]
    assert send(server, path="/api/info")[0] == 200  # the demo is up
    assert listing(corpus) == before
