"""`captioning prepare`: COCO from a local HTTP server (resume, verification, layout), and a
folder of photos with a caption file made into a dataset that trains."""

import hashlib
import io
import json
import os
import threading
import zipfile
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from PIL import Image

from captioning.cli import main
from captioning.config import load_config
from captioning.errors import DataError
from captioning.prepare import coco as coco_module
from captioning.prepare import prepare_folder
from captioning.prepare.download import RemoteFile, download
from captioning.training.train import fit
from tests.conftest import make_coco

CONFIG = os.path.join(os.path.dirname(__file__), "..", "configs", "test_tiny.yaml")


class Server:
    """Files over HTTP on 127.0.0.1 with Range requests; each time a name is in ``cut`` one
    response is cut off halfway (all headers sent, half the body, then the connection
    closes)."""

    def __init__(self, files: dict[str, bytes], ranges: bool = True, lengths: bool = True):
        self.files, self.ranges, self.lengths, self.cut = files, ranges, lengths, []
        self.requests: list[tuple[str, str | None]] = []
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_GET(self):
                name = self.path.lstrip("/")
                asked = self.headers.get("Range")
                server.requests.append((name, asked))
                data = server.files.get(name)
                if data is None:
                    self.send_error(404, "Not Found")
                    return
                start = int(asked[6:].split("-")[0]) if asked and server.ranges else 0
                if start >= len(data) and start:
                    self.send_response(416)
                    self.send_header("Content-Range", f"bytes */{len(data)}")
                    self.end_headers()
                    return
                body = data[start:]
                self.send_response(206 if start else 200)
                if start:
                    self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
                if server.lengths:  # else the body ends when the connection closes
                    self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                if name in server.cut:
                    server.cut.remove(name)
                    body = body[: len(body) // 2]
                self.wfile.write(body)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, args=(0.05,), daemon=True).start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


def error_line(capsys) -> str:
    """The one ``error:`` line of stderr (log lines may come before it), checked to be last."""
    lines = capsys.readouterr().err.strip().splitlines()
    assert [line for line in lines if line.startswith("error: ")] == lines[-1:]
    return lines[-1]


def zip_folder(folder: Path, compression: int = zipfile.ZIP_DEFLATED) -> bytes:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", compression) as zf:
        for path in sorted(folder.rglob("*")):
            if path.is_file():
                zf.write(path, path.relative_to(folder).as_posix())
    return buffer.getvalue()


def karpathy_file() -> dict:
    def entry(image_id, folder, split):
        return {
            "cocoid": image_id,
            "filepath": folder,
            "split": split,
            "filename": f"{folder}_{image_id:012d}.jpg",
            "sentences": [{"raw": f"image {image_id} caption"}],
        }

    return {
        "images": [
            entry(1, "train2014", "train"),
            entry(2, "train2014", "train"),
            entry(3, "train2014", "restval"),
            entry(4, "train2014", "train"),
            entry(5, "val2014", "val"),
            entry(6, "val2014", "test"),
        ]
    }


@pytest.fixture(scope="module")
def archives(tmp_path_factory) -> dict[str, bytes]:
    """Tiny archives with the layout of COCO 2014's and Karpathy's."""
    work = tmp_path_factory.mktemp("archives")
    make_coco(work / "train", "train2014", [1, 2, 3, 4], "train2014")
    make_coco(work / "val", "val2014", [5, 6], "val2014")
    annotations = work / "annotations"
    for part in ("train", "val"):
        for path in (work / part / "annotations").iterdir():
            (annotations / "annotations").mkdir(parents=True, exist_ok=True)
            path.rename(annotations / "annotations" / path.name)
    (work / "karpathy").mkdir()
    (work / "karpathy" / "dataset_coco.json").write_text(json.dumps(karpathy_file()))
    (work / "karpathy" / "dataset_flickr8k.json").write_text("{}")
    return {
        "annotations_trainval2014.zip": zip_folder(annotations),
        # The image archives are stored, not deflated, as COCO's are (JPEGs do not shrink).
        "train2014.zip": zip_folder(work / "train", zipfile.ZIP_STORED),
        "val2014.zip": zip_folder(work / "val", zipfile.ZIP_STORED),
        "caption_datasets.zip": zip_folder(work / "karpathy"),
    }


@pytest.fixture
def server(archives):
    server = Server(dict(archives))
    yield server
    server.close()


@pytest.fixture
def published(monkeypatch, archives):
    """The tiny archives' sizes and checksums stand in for the official ones."""
    known = {
        name: (len(data), hashlib.sha256(data).hexdigest())
        for name, data in archives.items()
        if name != "caption_datasets.zip"
    }
    monkeypatch.setattr(coco_module, "KNOWN", known)


def prepare(server, root, *extra):
    return main(
        [
            "prepare",
            "coco",
            "--root",
            str(root),
            "--year",
            "2014",
            "--karpathy",
            "--base-url",
            server.url,
            *extra,
        ]
    )


def test_coco_with_karpathy_downloads_resumes_unpacks_and_checks(
    server, published, tmp_path, capsys
):
    server.cut.append("train2014.zip")
    assert prepare(server, tmp_path / "coco") == 0
    root = tmp_path / "coco"
    assert ("train2014.zip", None) in server.requests
    resumed = [r for name, r in server.requests if name == "train2014.zip" and r]
    assert len(resumed) == 1 and resumed[0].startswith("bytes=")  # picked up where it stopped
    assert (root / "train2014" / "train2014_000000000001.jpg").is_file()
    assert (root / "val2014" / "val2014_000000000006.jpg").is_file()
    assert (root / "annotations" / "instances_val2014.json").is_file()
    assert (root / "dataset_coco.json").is_file()
    assert not (root / "dataset_flickr8k.json").exists()  # only COCO's split file is taken
    assert not list((root / "downloads").glob("*.zip")) + list((root / "downloads").glob("*.part"))
    out = capsys.readouterr().out
    assert "all 6 images open cleanly" in out
    assert "--config configs/coco_soft_vgg19.yaml --set data.root=" in out
    # The shipped config reads the result.
    cfg = load_config("configs/coco_soft_vgg19.yaml", [f"data.root={root}"])
    assert (
        main(
            ["check-data", "--config", "configs/coco_soft_vgg19.yaml", "--set", f"data.root={root}"]
        )
        == 0
    )
    assert cfg.data.format == "karpathy"
    # A second call finds everything unpacked and fetches nothing.
    before = len(server.requests)
    assert prepare(server, root, "--no-check") == 0
    assert len(server.requests) == before


def test_coco_without_karpathy_reads_as_coco_format(server, published, tmp_path, capsys):
    assert main(["prepare", "coco", "--root", str(tmp_path / "c"), "--base-url", server.url]) == 0
    out = capsys.readouterr().out
    assert "train: 4 readable images" in out and "val  : 2 readable images" in out
    assert "--set data.format=coco" in out


def test_an_interrupted_download_resumes_from_its_part_file(server, archives, tmp_path):
    data = archives["val2014.zip"]
    (tmp_path / "val2014.zip.part").write_bytes(data[: len(data) // 3])
    remote = RemoteFile(
        "val2014.zip", f"{server.url}/val2014.zip", len(data), hashlib.sha256(data).hexdigest()
    )
    path = download(remote, tmp_path, progress=False)
    assert path.read_bytes() == data
    assert server.requests == [("val2014.zip", f"bytes={len(data) // 3}-")]
    assert not (tmp_path / "val2014.zip.part").exists()


def test_a_connection_that_keeps_dropping_keeps_its_part_for_the_next_call(
    server, archives, tmp_path
):
    server.cut.extend(["val2014.zip"] * 2)
    remote = RemoteFile("val2014.zip", f"{server.url}/val2014.zip")
    with pytest.raises(DataError, match="failed 2 times .* run the same command again to resume"):
        download(remote, tmp_path, progress=False, attempts=2, retry_wait=0)
    kept = (tmp_path / "val2014.zip.part").stat().st_size
    assert 0 < kept < len(archives["val2014.zip"])
    assert download(remote, tmp_path, progress=False).read_bytes() == archives["val2014.zip"]
    assert server.requests[-1] == ("val2014.zip", f"bytes={kept}-")


def test_a_server_without_range_support_starts_over(archives, tmp_path):
    server = Server(dict(archives), ranges=False)
    try:
        data = archives["val2014.zip"]
        (tmp_path / "val2014.zip.part").write_bytes(b"x" * 100)
        server.cut.append("val2014.zip")
        path = download(
            RemoteFile("val2014.zip", f"{server.url}/val2014.zip"), tmp_path, progress=False
        )
        assert path.read_bytes() == data and len(server.requests) == 2
    finally:
        server.close()


def corrupt(data: bytes) -> bytes:
    """The same archive, of the same size, with one byte of its last member's data changed."""
    member = zipfile.ZipFile(io.BytesIO(data)).infolist()[-1]
    name_length, extra_length = (
        int.from_bytes(data[member.header_offset + 26 : member.header_offset + 28], "little"),
        int.from_bytes(data[member.header_offset + 28 : member.header_offset + 30], "little"),
    )
    at = member.header_offset + 30 + name_length + extra_length + member.compress_size // 2
    return data[:at] + bytes([data[at] ^ 0xFF]) + data[at + 1 :]


@pytest.mark.parametrize("checked", ["sha256", "crc"])
def test_a_corrupted_archive_is_refused_in_one_line(
    server, published, archives, tmp_path, capsys, monkeypatch, checked
):
    server.files["train2014.zip"] = corrupt(archives["train2014.zip"])
    if checked == "crc":  # no published checksum: the zip's own CRCs catch it
        monkeypatch.setitem(
            coco_module.KNOWN, "train2014.zip", (len(archives["train2014.zip"]), None)
        )
    assert prepare(server, tmp_path / "coco") == 2
    err = error_line(capsys)
    if checked == "sha256":
        assert "train2014.zip: SHA-256 " in err and "differs from the published" in err
    else:
        assert "train2014.zip: the archive is damaged (Bad CRC-32" in err
    assert "run the command again" in err
    assert not list((tmp_path / "coco" / "downloads").glob("train2014.zip*"))
    # Fixed on the server, the next call fetches only what is left.
    server.files["train2014.zip"] = archives["train2014.zip"]
    server.requests.clear()
    assert prepare(server, tmp_path / "coco", "--no-check") == 0
    assert [name for name, _ in server.requests] == ["train2014.zip"]


@pytest.mark.parametrize(
    "args, message",
    [
        (["--year", "2017", "--karpathy"], "use --year 2014 with --karpathy"),
        (["--base-url", "http://127.0.0.1:9/none"], "cannot connect"),
        (["--base-url", "file:///etc"], "'file:///etc' is not an http:// or https:// address"),
        (["--base-url", "ftp://example.org/coco"], "is not an http:// or https:// address"),
        (["--base-url", "https:///no-host"], "is not an http:// or https:// address"),
    ],
)
def test_coco_refusals_are_one_line(tmp_path, capsys, args, message):
    assert main(["prepare", "coco", "--root", str(tmp_path / "c"), *args]) == 2
    assert message in error_line(capsys)


def test_a_file_the_server_does_not_have_is_one_line(server, published, tmp_path, capsys):
    del server.files["val2014.zip"]
    assert main(["prepare", "coco", "--root", str(tmp_path / "c"), "--base-url", server.url]) == 2
    assert error_line(capsys).endswith(
        "val2014.zip: the server answered 404 Not Found; check the address (--base-url) and "
        "try again"
    )


def test_a_full_disk_while_unpacking_is_one_line_and_the_next_call_finishes(
    server, published, tmp_path, capsys, monkeypatch
):
    import errno
    import shutil

    real_copy = shutil.copyfileobj

    def disk_fills(source, target, *args):  # half a member written, then the disk is full
        target.write(source.read(10))
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(shutil, "copyfileobj", disk_fills)
    root = tmp_path / "coco"
    assert prepare(server, root, "--no-check") == 2
    err = error_line(capsys)
    assert (
        "annotations/captions_train2014.json from annotations_trainval2014.zip (No space "
        "left on device); free some space or choose another --root" in err
    )
    assert not (root / "annotations" / "captions_train2014.json").exists()  # no half file
    assert (root / "downloads" / "annotations_trainval2014.zip").is_file()  # nothing lost
    assert not list((root / "downloads").glob("*.unpacked"))
    monkeypatch.setattr(shutil, "copyfileobj", real_copy)
    server.requests.clear()
    assert prepare(server, root, "--no-check") == 0
    assert ("annotations_trainval2014.zip", None) not in server.requests  # not fetched again
    assert json.loads((root / "annotations" / "captions_train2014.json").read_text())["images"]


def bomb(size: int) -> bytes:
    """A zip whose dataset_coco.json unpacks to ``size`` bytes of zeros (deflate shrinks
    them about a thousandfold)."""
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED) as zf:
        zf.writestr("dataset_coco.json", b"\0" * size)
    return buffer.getvalue()


def test_karpathys_zip_is_bounded_in_what_it_unpacks(
    server, published, tmp_path, capsys, monkeypatch
):
    monkeypatch.setattr(coco_module, "KARPATHY_MAX_UNPACKED", 8_000_000)
    server.files["caption_datasets.zip"] = bomb(9_000_000)
    assert len(server.files["caption_datasets.zip"]) < 20_000
    root = tmp_path / "coco"
    assert prepare(server, root, "--no-check") == 2
    assert error_line(capsys).endswith(
        "caption_datasets.zip: unpacks to 9.00MB, more than the 8.00MB this archive can hold; "
        "it is not the expected file and was removed (check --base-url)"
    )
    assert not (root / "dataset_coco.json").exists()  # refused before anything was written
    assert not list((root / "downloads").glob("caption_datasets.zip*"))


@pytest.mark.parametrize("lengths", [True, False])
def test_karpathys_zip_is_bounded_in_what_it_downloads(
    archives, tmp_path, capsys, monkeypatch, published, lengths
):
    server = Server(dict(archives), lengths=lengths)
    try:
        monkeypatch.setattr(coco_module, "KARPATHY_MAX_DOWNLOAD", 300)
        assert len(archives["caption_datasets.zip"]) > 300
        root = tmp_path / "coco"
        assert prepare(server, root, "--no-check") == 2
        err = error_line(capsys)
        assert err.endswith(
            "caption_datasets.zip: more than 300B, the most "
            "caption_datasets.zip can be; this is not the expected file (check "
            "--base-url)"
        )
        assert not list((root / "downloads").glob("caption_datasets.zip*"))  # no part kept
    finally:
        server.close()


# --------------------------------------------------------------------------- own photos


def photos(folder: Path, count: int) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for index in range(count):
        Image.new("RGB", (48, 40), (index * 20, 100, 0)).save(folder / f"p{index:02d}.jpg")


def test_a_folder_with_bad_rows_becomes_a_dataset_that_trains(tmp_path, capsys):
    images = tmp_path / "photos"
    photos(images, 12)
    photos(images / "holiday", 1)
    (images / "broken.jpg").write_bytes(b"not a jpeg")
    rows = ["image,caption"]
    rows += [f"p{i:02d}.jpg,a red photo number {i}" for i in range(12)]
    rows += [f'p{i:02d}.jpg,"another caption, with a comma"' for i in range(6)]
    rows += [
        "holiday/p00.jpg,a photo in a subfolder",
        "missing.jpg,a photo that is not there",
        "broken.jpg,a photo that does not open",
        "p01.jpg,  ",
        "p02.jpg,one,unquoted",
        "p03.jpg",
        "../outside.jpg,a path out of the folder",
    ]
    captions = tmp_path / "captions.csv"
    captions.write_text("\n".join(rows) + "\n")
    out = tmp_path / "dataset"
    args = [
        "prepare",
        "folder",
        "--images",
        str(images),
        "--captions",
        str(captions),
        "--out",
        str(out),
        "--val",
        "0.2",
        "--test",
        "0.1",
    ]
    assert main(args) == 0
    output = capsys.readouterr()
    assert [line for line in output.err.splitlines() if "row skipped" in line] == [
        f"{captions}:21: image missing.jpg: no such file; row skipped",
        f"{captions}:22: image broken.jpg: not a JPEG, PNG, WebP, GIF, BMP or TIFF image; row "
        "skipped",
        f"{captions}:23: empty caption; row skipped",
        f"{captions}:25: 1 column, the header has 2; row skipped",
        f"{captions}:26: image '../outside.jpg' is not a path inside {images}; row skipped",
    ]
    assert "5 rows skipped, 0 images without a caption" in output.out
    splits = {}
    for split in ("train", "val", "test"):
        data = json.loads((out / "annotations" / f"captions_{split}.json").read_text())
        splits[split] = {image["file_name"] for image in data["images"]}
        for image in data["images"]:
            assert (out / "images" / split / image["file_name"]).is_file()
    assert [len(splits[s]) for s in ("train", "val", "test")] == [9, 3, 1]  # of 13 images
    assert "holiday/p00.jpg" in set().union(*splits.values())
    # A caption holding the separator unquoted (caption is the last column) is kept whole.
    texts = {
        a["caption"]
        for s in ("train", "val", "test")
        for a in json.loads((out / "annotations" / f"captions_{s}.json").read_text())["annotations"]
    }
    assert "one,unquoted" in texts and "another caption, with a comma" in texts
    # The same files and seed give the same split, and the default configs read it.
    again = prepare_folder(images, captions, tmp_path / "again", val=0.2, test=0.1, progress=False)
    assert again.images == {"train": 9, "val": 3, "test": 1}
    summary = fit(
        load_config(CONFIG, [f"data.root={out}", "train.epochs=1"]), out_dir=tmp_path / "run"
    )
    assert summary["steps"] == 2 and (tmp_path / "run" / "best.pt").is_file()


def test_jsonl_captions_and_lists(tmp_path):
    images = tmp_path / "photos"
    photos(images, 4)
    lines = [
        json.dumps({"image": "p00.jpg", "captions": ["one", "two"]}),
        json.dumps({"image": "p01.jpg", "caption": "three"}),
        "",
        "{not json",
        json.dumps({"image": "p02.jpg", "caption": None}),
        json.dumps({"image": "p03.jpg", "captions": ["four"]}),
    ]
    (tmp_path / "c.jsonl").write_text("\n".join(lines) + "\n")
    summary = prepare_folder(images, tmp_path / "c.jsonl", tmp_path / "out", val=0.3, test=0)
    assert summary.skipped == [(4, "not a JSON object"), (5, "a caption that is not text")]
    assert sum(summary.images.values()) == 3 and sum(summary.captions.values()) == 4


@pytest.mark.parametrize(
    "content, suffix, message",
    [
        ("file,text\na.jpg,x\n", ".csv", "header naming the columns 'image' and 'caption'"),
        ("image\tcaption\nmissing.jpg\tx\n", ".tsv", "no row names a readable image"),
        (
            "just some words\n",
            ".txt",
            "cannot tell the caption format from its first lines "
            "('just some words'); name it with --format csv|tsv|jsonl|lines|flickr|coco",
        ),
    ],
)
def test_folder_refusals_are_one_line(tmp_path, capsys, content, suffix, message):
    photos(tmp_path / "photos", 1)
    (tmp_path / f"c{suffix}").write_text(content)
    args = [
        "prepare",
        "folder",
        "--images",
        str(tmp_path / "photos"),
        "--captions",
        str(tmp_path / f"c{suffix}"),
        "--out",
        str(tmp_path / "out"),
    ]
    assert main(args) == 2
    assert message in error_line(capsys)


def test_a_folder_too_small_to_split_is_refused(tmp_path):
    photos(tmp_path / "photos", 2)
    (tmp_path / "c.csv").write_text("image,caption\np00.jpg,a\np01.jpg,b\n")
    with pytest.raises(DataError, match="2 usable images cannot be split"):
        prepare_folder(tmp_path / "photos", tmp_path / "c.csv", tmp_path / "out")
