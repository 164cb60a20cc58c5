"""The caption files people have: every format read whole, told apart by content, overridden
with --format; names that differ only by leading zeros reported, never matched; every image
without a caption named; and the real Vietnamese caption file read without a caption lost."""

import csv
import json
import logging
import time
import unicodedata
from pathlib import Path

import pytest
from PIL import Image

from captioning.cli import main
from captioning.errors import DataError
from captioning.prepare import prepare_folder
from captioning.prepare.folder import match_images
from captioning.prepare.formats import detect_format, read_captions

SHARED = Path(__file__).parents[1] / ".." / "shared"

# Vietnamese captions with commas of their own, and one with a tab inside.
COMMAS = "Một người đàn ông, đang đứng trên đỉnh núi ."
TAB = "Hai con chó chạy trên bãi biển\tvào buổi sáng ."
MANY = "Một cô gái mặc áo đỏ, cầm ô, đi trên phố ."
EXPECTED = {"a.jpg": [COMMAS, MANY], "b.jpg": [TAB]}


def coco(indent=None) -> str:
    return json.dumps(
        {
            "images": [{"id": 1, "file_name": "a.jpg"}, {"id": 2, "file_name": "b.jpg"}],
            "annotations": [
                {"id": 1, "image_id": 1, "caption": COMMAS},
                {"id": 2, "image_id": 2, "caption": TAB},
                {"id": 3, "image_id": 1, "caption": MANY},
            ],
        },
        indent=indent,
        ensure_ascii=False,
    )


FILES = {
    "csv": ("csv", f'image,caption\na.jpg,"{COMMAS}"\nb.jpg,{TAB}\na.jpg,{MANY}\n'),
    "tsv": ("tsv", f"image\tcaption\na.jpg\t{COMMAS}\nb.jpg\t{TAB}\na.jpg\t{MANY}\n"),
    "jsonl": (
        "jsonl",
        json.dumps({"image": "a.jpg", "captions": [COMMAS, MANY]})
        + "\n\n"
        + json.dumps({"image": "b.jpg", "caption": TAB}, ensure_ascii=False)
        + "\n",
    ),
    "lines comma": ("lines", f"a.jpg, {COMMAS}\nb.jpg, {TAB} \na.jpg, {MANY}\n"),
    "lines tab": ("lines", f"a.jpg\t{COMMAS}\r\nb.jpg\t{TAB}\r\na.jpg\t{MANY}\r\n"),
    "lines pipe": ("lines", f"a.jpg|{COMMAS}\nb.jpg|{TAB}\na.jpg|{MANY}"),
    "flickr token": ("flickr", f"a.jpg#0\t{COMMAS}\nb.jpg#0\t{TAB}\na.jpg#1\t{MANY}\n"),
    # Flickr30k's results.csv; its row that lost the second '|' is read too.
    "flickr pipes": (
        "flickr",
        f"image_name| comment_number| comment\na.jpg| 0| {COMMAS}\n"
        f"b.jpg| 0| {TAB}\na.jpg| 1 {MANY}\n",
    ),
    "coco": ("coco", coco()),
    "coco indented": ("coco", coco(indent=2)),
}


def write(path: Path, text: str, encoding: str = "utf-8") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(text.encode(encoding))
    return path


def photos(folder: Path, names: list[str]) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for index, name in enumerate(names):
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        Image.new("RGB", (24, 20), (index * 9 % 256, 90, 0)).save(folder / name, format="JPEG")


@pytest.mark.parametrize("kind", list(FILES))
def test_every_format_is_detected_and_read_whole(tmp_path, kind, caplog):
    fmt, text = FILES[kind]
    path = write(tmp_path / "captions.txt", text)  # the suffix says nothing
    assert detect_format(text) == fmt
    with caplog.at_level(logging.INFO, logger="captioning"):
        table = read_captions(path, tmp_path, format="auto")
    assert table.format == fmt and table.problems == []
    assert dict(table.captions) == EXPECTED
    assert f"read as {fmt}" in caplog.text and "detected from its content" in caplog.text


@pytest.mark.parametrize(
    "text, expected",
    [
        ('{"image": "a.jpg", "caption": "x"}\n{"image": "b.jpg", "caption": "y"}', "jsonl"),
        ('{"images": [], "annotations": []}', "coco"),
        ('{\n  "images": [\n', "coco"),
        ("Image , Caption\na.jpg,x", "csv"),
        ("caption,image\nx,a.jpg", "csv"),
        ("image\tcaption\na.jpg\tx", "tsv"),
        ("\n\n1000268201_693b08cb0b.jpg#0\tA child .\n", "flickr"),
        ("2258277193_586949ec62.jpg.1#0\tA dog .\n", "flickr"),
        ("1000092795.jpg| 0| Two young guys .", "flickr"),
        ("0000001.jpg, Một người , đứng .", "lines"),
        ("photos/IMG_1.JPEG\tA cat, asleep .", "lines"),
    ],
)
def test_the_format_is_told_from_the_first_lines(text, expected):
    assert detect_format(text) == expected


def test_the_separator_of_lines_is_the_one_after_the_image_name(tmp_path):
    tab = read_captions(write(tmp_path / "t", "a.jpg\tcap, with comma\n"), tmp_path)
    comma = read_captions(write(tmp_path / "c", "a.jpg, cap\twith tab | bar\n"), tmp_path)
    assert (tab.separator, dict(tab.captions)) == ("\t", {"a.jpg": ["cap, with comma"]})
    assert (comma.separator, dict(comma.captions)) == (",", {"a.jpg": ["cap\twith tab | bar"]})
    assert comma.describe() == "lines of NAME,CAPTION, split at the first ','"


@pytest.mark.parametrize(
    "text, message",
    [
        (
            "just some words\nand more\n",
            "cannot tell the caption format from its first lines "
            "('just some words'); name it with --format csv|tsv|jsonl|lines|flickr|coco",
        ),
        (
            "file,text\na.jpg,x\nb.jpg,y\n",
            "the first line 'file,text' looks like a header; a "
            "header naming the columns 'image' and 'caption' is needed",
        ),
        ("\n \n", "the caption file is empty"),
    ],
)
def test_a_format_that_cannot_be_told_is_one_line_naming_the_choices(tmp_path, text, message):
    with pytest.raises(DataError) as error:
        read_captions(write(tmp_path / "c.txt", text), tmp_path)
    assert message in str(error.value) and "\n" not in str(error.value)


def test_bad_rows_of_each_format_are_recorded_by_line(tmp_path):
    lines = read_captions(write(tmp_path / "l", "a.jpg, x\na.jpg no comma\n\nb.jpg,  \n"), tmp_path)
    assert lines.problems == [
        (2, "no ',' between an image name and a caption"),
        (4, "empty caption"),
    ]
    flickr = read_captions(write(tmp_path / "f", "a.jpg#0\tx\na.jpg x\n"), tmp_path)
    assert flickr.problems == [(2, "not NAME#N<TAB>CAPTION")]
    data = {
        "images": [{"id": 1, "file_name": "a.jpg"}, {"id": 2}],
        "annotations": [
            {"image_id": 1, "caption": "x"},
            {"image_id": 3, "caption": "y"},
            {"image_id": 2, "caption": "z"},
            {"image_id": 1},
        ],
    }
    table = read_captions(write(tmp_path / "c.json", json.dumps(data)), tmp_path)
    assert table.problems == [
        (2, "image_id 3 is not in 'images'"),
        (3, "image 2 has no 'file_name' in 'images'"),
        (4, "no 'caption'"),
    ]
    assert table.where("c.json", 2) == "c.json: annotation 2"


def test_a_quote_left_open_is_reported_not_swallowed(tmp_path):
    text = 'image,caption\na.jpg,"a sign, open\nb.jpg,a dog\nc.jpg,"a cat"\nd.jpg,"two\nlines"\n'
    table = read_captions(write(tmp_path / "c.csv", text), tmp_path)
    assert table.problems == [
        (
            2,
            "a quote opened here is closed only on line 4, so lines 2-4 "
            "are one field; close or remove it",
        )
    ]
    assert dict(table.captions) == {"d.jpg": ["two lines"]}


@pytest.mark.parametrize("delimiter", [",", "\t"])
def test_a_field_past_128_kib_is_read_and_one_past_the_bound_skipped_by_line(
    tmp_path, monkeypatch, delimiter
):
    from captioning.prepare import formats

    long = "a dog " * 40_000  # 240,000 characters: past the csv module's default bound
    rows = ["a.jpg", f'"{long}"', "b.jpg", "a cat", "c.jpg", "a bird"]
    text = f"image{delimiter}caption\n" + "".join(
        f"{name}{delimiter}{caption}\n" for name, caption in zip(rows[::2], rows[1::2])
    )
    path = write(tmp_path / "c.csv", text)
    table = read_captions(path, tmp_path)
    assert table.problems == [] and table.format == ("csv" if delimiter == "," else "tsv")
    assert dict(table.captions) == {
        "a.jpg": [long.strip()],
        "b.jpg": ["a cat"],
        "c.jpg": ["a bird"],
    }
    monkeypatch.setattr(formats, "MAX_FIELD_CHARS", 100_000)
    table = read_captions(path, tmp_path)
    assert dict(table.captions) == {"b.jpg": ["a cat"], "c.jpg": ["a bird"]}
    assert table.problems == [
        (2, "not readable as CSV/TSV (field larger than field limit (100000)); a quote not closed?")
    ]
    assert csv.field_size_limit() == 131072  # the module's bound is restored


def test_captions_are_nfc_without_invisible_characters(tmp_path):
    decomposed = unicodedata.normalize("NFD", "Người đàn ông")
    text = "\ufeffimage,caption\n" + f"a.jpg,{decomposed} giơ lên \u200b\u200btrời .\u200b\n"
    text += "\u200bb.jpg, \ufeff \n\ufeffc.jpg,ảnh\n"  # a second file's mark, from `cat`
    table = read_captions(write(tmp_path / "c.csv", text, "utf-8"), tmp_path)
    assert dict(table.captions) == {"a.jpg": ["Người đàn ông giơ lên trời ."], "c.jpg": ["ảnh"]}
    assert unicodedata.is_normalized("NFC", table.captions["a.jpg"][0])
    assert table.problems == [(3, "empty caption")] and table.cleaned == 1


def test_a_file_that_is_not_utf8_is_one_line(tmp_path):
    path = write(tmp_path / "c.txt", "a.jpg, Một người\n", "utf-16")
    with pytest.raises(DataError, match=r"not UTF-8 text \(it is UTF-16\).*save it as UTF-8$"):
        read_captions(path, tmp_path)


def test_names_differing_by_leading_zeros_are_reported_never_matched(tmp_path, caplog):
    images = tmp_path / "photos"
    disk = ["00000059.jpg", "0000016.jpg", "000016.jpg", "IMG_7.JPG"]
    photos(images, disk + [f"{n:07d}.jpg" for n in range(1, 9)] + ["sub/free.png"])
    rows = [f"{n:07d}.jpg, Ảnh số {n}, một bức ảnh ." for n in range(1, 9)]
    rows += ["0000059.jpg, Một người đàn ông ."] * 2 + ["0000016.jpg, Cô gái ."]
    rows += ["img_7.jpg, Chữ thường ."]
    captions = write(tmp_path / "captions.txt", "\n".join(rows) + "\n")
    with caplog.at_level(logging.INFO, logger="captioning"):
        summary = prepare_folder(
            images, captions, tmp_path / "out", val=0.25, test=0, progress=False
        )
    assert summary.format == "lines"
    missing = "image 0000059.jpg: no such file; 00000059.jpg is on disk (differs by leading zeros)"
    assert summary.skipped == [
        (9, f"{missing}, not matched"),
        (10, f"{missing}, not matched"),
        (
            12,
            "image img_7.jpg: no such file; IMG_7.JPG is on disk (differs in letter case), "
            "not matched",
        ),
    ]
    assert summary.uncaptioned == ["00000059.jpg", "000016.jpg", "IMG_7.JPG", "sub/free.png"]
    assert sum(summary.images.values()) == 9 and sum(summary.captions.values()) == 9
    written = set()
    for split in ("train", "val", "test"):
        data = json.loads((tmp_path / "out/annotations" / f"captions_{split}.json").read_text())
        written |= {image["file_name"] for image in data["images"]}
    assert "00000059.jpg" not in written and "0000059.jpg" not in written
    report = Path(summary.report).read_text(encoding="utf-8")
    assert f"{captions}:9: {missing}, not matched" in report
    assert (
        "  00000059.jpg: lines 9-10 name 0000059.jpg, which differs by leading zeros "
        "(not matched)" in report
    )
    assert "  000016.jpg: line 11 names 0000016.jpg, which differs by leading zeros\n" in report
    assert "  sub/free.png\n" in report
    assert f"4 image files in {images} have no caption and are not used:" in caplog.text
    assert f"{captions}:12: image img_7.jpg: no such file" in caplog.text


def test_many_problems_log_twenty_and_the_report_lists_all(tmp_path, caplog):
    images = tmp_path / "photos"
    photos(images, [f"p{n:02d}.jpg" for n in range(30)])
    rows = ["image,caption"] + [f"p{n:02d}.jpg,ảnh {n}" for n in range(5)]
    rows += [f"gone{n}.jpg,không có" for n in range(25)]
    captions = write(tmp_path / "c.csv", "\n".join(rows) + "\n")
    with caplog.at_level(logging.INFO, logger="captioning"):
        summary = prepare_folder(
            images, captions, tmp_path / "out", val=0.2, test=0.2, progress=False
        )
    assert len(summary.skipped) == 25 and len(summary.uncaptioned) == 25
    logged = [r.getMessage() for r in caplog.records]
    assert sum("row skipped" in m for m in logged) == 20
    assert (
        f"... and 5 more rows of {captions} skipped (25 in all, each listed in "
        f"{summary.report})" in logged
    )
    assert f"  ... and 5 more (each listed in {summary.report})" in logged
    report = Path(summary.report).read_text(encoding="utf-8")
    assert all(f"{captions}:{line}: image gone" in report for line in range(7, 32))
    assert all(f"  p{n:02d}.jpg\n" in report for n in range(5, 30))


def test_the_cli_format_option_overrides_the_guess(tmp_path, capsys):
    images = tmp_path / "photos"
    names = [f"shot{n}" for n in range(4)]  # no suffix: nothing to tell the format by
    photos(images, names)
    captions = write(tmp_path / "c.txt", "".join(f"{n}, Ảnh {n}, có dấu phẩy .\n" for n in names))
    args = [
        "prepare",
        "folder",
        "--images",
        str(images),
        "--captions",
        str(captions),
        "--out",
        str(tmp_path / "out"),
        "--val",
        "0.25",
        "--test",
        "0",
    ]
    assert main(args) == 2
    assert "name it with --format csv|tsv|jsonl|lines|flickr|coco" in capsys.readouterr().err
    assert main([*args, "--format", "lines"]) == 0
    out = capsys.readouterr().out
    assert "images train 3 (3 captions), val 1 (1 captions)" in out
    assert "as lines: 0 rows skipped, 0 images without a caption (each listed in " in out
    data = json.loads((tmp_path / "out/annotations/captions_train.json").read_text())
    assert all(a["caption"].endswith(", có dấu phẩy .") for a in data["annotations"])
    # A forced format that does not fit is one line too.
    assert main([*args[:-6], "--out", str(tmp_path / "o2"), "--format", "csv"]) == 2
    assert "header naming the columns 'image' and 'caption'" in capsys.readouterr().err


def test_a_failed_run_leaves_its_report_and_the_same_out_can_be_used_again(tmp_path):
    images = tmp_path / "photos"
    photos(images, ["a.jpg", "b.jpg", "c.jpg"])
    captions = write(tmp_path / "c.txt", "x.jpg, không có\n")
    with pytest.raises(DataError, match=r"1 rows skipped, each listed in .*prepare_report.txt"):
        prepare_folder(images, captions, tmp_path / "out", progress=False)
    assert "x.jpg: no such file" in (tmp_path / "out/prepare_report.txt").read_text()
    write(captions, "a.jpg, một\nb.jpg, hai\nc.jpg, ba\n")
    summary = prepare_folder(images, captions, tmp_path / "out", val=0.34, test=0, progress=False)
    assert sum(summary.images.values()) == 3 and summary.skipped == []


def test_the_real_vietnamese_caption_file_loses_no_caption():
    folder = SHARED / "data" / "photos_vi"
    if not (folder / "captions.txt").is_file():
        pytest.skip(f"the shared photos are not at {folder.resolve()} (see shared/data/README.md)")
    started = time.perf_counter()
    table = read_captions(folder / "captions.txt", folder / "images")
    match = match_images(table, folder / "images")
    seconds = time.perf_counter() - started
    raw = (folder / "captions.txt").read_text(encoding="utf-8").splitlines()
    assert len(raw) == 14_660 and table.format == "lines" and table.separator == ","
    kept = sum(len(table.captions[name]) for name in match.present)
    assert kept + len(table.problems) == 14_660  # every line is a caption kept or reported
    with_commas = sum("," in line.split(",", 1)[1] for line in raw)
    assert with_commas == 185
    assert sum("," in t for texts in table.captions.values() for t in texts) == with_commas
    # Only the two names that differ by leading zeros are dropped: 5 lines each.
    assert sorted(table.problems) == [
        (
            line,
            f"image {name}: no such file; {disk} is on disk (differs by leading zeros), "
            f"not matched",
        )
        for name, disk, lines in (
            ("0000046.jpg", "000046.jpg", range(226, 231)),
            ("0000059.jpg", "00000059.jpg", range(291, 296)),
        )
        for line in lines
    ]
    assert match.uncaptioned == ["00000059.jpg", "000016.jpg", "000046.jpg"]
    assert len(match.present) == 2_929 and kept == 14_650
    assert table.cleaned == 1  # the caption with two zero-width spaces
    assert not any("\u200b" in t or t != t.strip() for ts in table.captions.values() for t in ts)
    assert "Một cửa hàng bán bóng đồ chơi, ô và vợ\t ." in table.captions["0002850.jpg"]
    assert seconds < 5, f"reading and matching took {seconds:.1f} s"


def test_the_prepared_annotations_hold_the_captions_as_written(tmp_path):
    images = tmp_path / "photos"
    photos(images, ["a.jpg", "b.jpg", "c.jpg"])
    captions = write(tmp_path / "c.txt", "a.jpg, một người, đang đứng\nb.jpg, hai\nc.jpg, ba\n")
    prepare_folder(images, captions, tmp_path / "out", val=0.34, test=0, progress=False)
    texts = [
        (tmp_path / "out" / "annotations" / f"captions_{split}.json").read_text(encoding="utf-8")
        for split in ("train", "val")
    ]
    assert any("một người, đang đứng" in text for text in texts)
    assert not any("\\u" in text for text in texts)
