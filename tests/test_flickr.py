"""Flickr8k and Flickr30k as downloaded: the official split files decide the splits, and
every quirk of the token file and the split files is reported by line, never dropped or
matched silently; the real Flickr8k release (when ../shared is there) gives 6,000 / 1,000 /
1,000 images."""

import json
from pathlib import Path

import pytest
from PIL import Image

from captioning.cli import main
from captioning.errors import DataError
from captioning.prepare.flickr import prepare_flickr, prepare_flickr8k

SHARED = Path(__file__).resolve().parents[1] / ".." / "shared"
FLICKR8K = SHARED / "data" / "flickr8k"


def photos(folder: Path, names: list[str]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for number, name in enumerate(names):
        Image.new("RGB", (24, 16), (number * 20 % 255, 90, 160)).save(folder / name)
    return folder


def release(tmp_path: Path) -> tuple[Path, Path]:
    """A Flickr8k-shaped release of eight photos with the real release's quirks and more."""
    images = photos(tmp_path / "Flicker8k_Dataset", [f"{n}_x.jpg" for n in range(1, 9)])
    text = tmp_path / "Flickr8k_text"
    text.mkdir()
    tokens = []
    for n in range(1, 9):
        tokens += [f"{n}_x.jpg#{k}\tA dog number {n} runs , take {k} ." for k in range(2)]
    tokens += [
        "9_x.jpg.1#0\tpeople waiting for the subway",  # line 17: the .jpg.1 name
        "9_x.jpg#1\tSome people look out of windows .",  # line 18: not in the archive
    ]
    (text / "Flickr8k.token.txt").write_text("\n".join(tokens) + "\n")
    (text / "Flickr_8k.trainImages.txt").write_text("1_x.jpg\n2_x.jpg\n3_x.jpg\n9_x.jpg\n")
    (text / "Flickr_8k.devImages.txt").write_text("4_x.jpg\n\n5_x.jpg\n1_x.jpg\n")
    (text / "Flickr_8k.testImages.txt").write_text("6_x.jpg\n7_x.jpg\n")  # 8_x.jpg in none
    return images, text


def test_the_official_split_is_kept_and_every_quirk_reported_by_line(tmp_path):
    images, text = release(tmp_path)
    summary = prepare_flickr8k(images, text, tmp_path / "out", progress=False)
    assert summary.images == {"train": 3, "val": 2, "test": 2}
    assert summary.captions == {"train": 6, "val": 4, "test": 4}
    # the token file's rows naming no image: by line, neither dropped nor matched
    assert [(line, problem.split(":")[0]) for line, problem in summary.skipped] == [
        (17, "image 9_x.jpg.1"),
        (18, "image 9_x.jpg"),
    ]
    problems = "\n".join(summary.split_problems)
    assert "Flickr_8k.trainImages.txt:4: 9_x.jpg: its image is missing" in problems
    assert "Flickr_8k.devImages.txt:4: 1_x.jpg: already listed in Flickr_8k.trainImages" in problems
    assert "8_x.jpg: captioned, but no split file lists it; not used" in problems
    report = (tmp_path / "out" / "prepare_report.txt").read_text()
    assert report.startswith("captioning prepare flickr8k")
    for needle in (
        "Flickr8k.token.txt:17: image 9_x.jpg.1: no such file",
        "3 split-file problems",
        "8_x.jpg: captioned, but no split file",
    ):
        assert needle in report
    test = json.loads((tmp_path / "out" / "annotations" / "captions_test.json").read_text())
    assert [image["file_name"] for image in test["images"]] == ["6_x.jpg", "7_x.jpg"]
    assert test["info"]["split_file"] == "Flickr_8k.testImages.txt"
    assert (tmp_path / "out" / "images" / "val" / "5_x.jpg").is_file()
    # image ids are unique over the three splits
    annotations = tmp_path / "out" / "annotations"
    splits = [
        json.loads((annotations / f"captions_{s}.json").read_text())
        for s in ("train", "val", "test")
    ]
    ids = [image["id"] for split in splits for image in split["images"]]
    assert len(ids) == len(set(ids)) == 7


def test_flickr30k_split_files_may_list_ids_and_the_pipe_format_is_read(tmp_path):
    images = photos(tmp_path / "flickr30k-images", ["10.jpg", "11.jpg", "12.jpg", "13.jpg"])
    captions = tmp_path / "results.csv"
    captions.write_text(
        "image_name| comment_number| comment\n"
        + "".join(f"{n}.jpg| 0| A man at work {n} .\n" for n in range(10, 14))
        + "11.jpg| 1 A second caption that lost its bar .\n"
    )
    splits = {}
    for split, names in (("train", "10\n11\n"), ("val", "12\n"), ("test", "13.jpg\n14\n")):
        splits[split] = tmp_path / f"{split}.txt"
        splits[split].write_text(names)
    summary = prepare_flickr(images, captions, splits, tmp_path / "out", progress=False)
    assert summary.images == {"train": 2, "val": 1, "test": 1}
    assert summary.captions["train"] == 3
    assert summary.split_problems == [f"{splits['test']}:2: 14: no caption names it; not used"]


def test_a_split_left_empty_or_a_missing_file_is_one_line(tmp_path, capsys):
    images, text = release(tmp_path)
    (text / "Flickr_8k.testImages.txt").rename(tmp_path / "test.txt")
    code = main(
        [
            "--quiet",
            "prepare",
            "flickr8k",
            "--images",
            str(images),
            "--text",
            str(text),
            "--out",
            str(tmp_path / "out"),
        ]
    )
    lines = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and [line for line in lines if line.startswith("error: ")] == lines[-1:]
    assert (
        "Flickr_8k.testImages.txt: not found; --text must be the unpacked Flickr8k_text"
        in (lines[-1])
    )
    (tmp_path / "test.txt").rename(text / "Flickr_8k.testImages.txt")
    (text / "Flickr_8k.devImages.txt").write_text("9_x.jpg\n")
    with pytest.raises(DataError, match="no usable image in the val split"):
        prepare_flickr8k(images, text, tmp_path / "out2", progress=False)


def test_the_cli_prints_what_it_wrote_and_the_next_command(tmp_path, capsys):
    images, text = release(tmp_path)
    code = main(
        [
            "--quiet",
            "prepare",
            "flickr8k",
            "--images",
            str(images),
            "--text",
            str(text),
            "--out",
            str(tmp_path / "out"),
        ]
    )
    out = capsys.readouterr().out
    assert code == 0
    assert "images train 3 (6 captions), val 2 (4 captions), test 2 (4 captions)" in out
    assert "2 rows skipped, 0 images without a caption, 3 split-file problems" in out
    assert "captioning train --config configs/flickr8k_best.yaml --set" in out


@pytest.mark.slow
@pytest.mark.skipif(not FLICKR8K.is_dir(), reason="../shared/data/flickr8k is absent")
def test_the_real_flickr8k_release_gives_the_official_split(tmp_path):
    summary = prepare_flickr8k(
        FLICKR8K / "Flicker8k_Dataset",
        FLICKR8K / "Flickr8k_text",
        tmp_path / "flickr8k",
        progress=False,
    )
    assert summary.images == {"train": 6000, "val": 1000, "test": 1000}
    assert summary.captions == {"train": 30000, "val": 5000, "test": 5000}
    # 2258277193_586949ec62.jpg is not in the archive: its five rows, by line
    assert [line for line, _ in summary.skipped] == [6731, 6732, 6733, 6734, 6735]
    assert "image 2258277193_586949ec62.jpg.1: no such file" in summary.skipped[0][1]
    # 91 photos of the archive are in no split file
    assert len(summary.split_problems) == 91
