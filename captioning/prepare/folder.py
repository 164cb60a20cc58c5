"""One's own photos and captions, made into a COCO-style dataset with seeded splits.

Input: a folder of images and a caption file naming them by their path inside that folder:

* CSV or TSV (``.csv``, ``.tsv``) with a header that names the columns ``image`` and
  ``caption``, one row per caption (an image may have several rows);
* JSON Lines (``.jsonl``), one object per line: ``{"image": ..., "caption": "..."}`` or
  ``{"image": ..., "captions": ["...", ...]}``.

Output, the layout ``captioning shapes`` writes and the default ``data`` section reads, so
``--set data.root=OUT`` trains on it with any config::

    out/images/{train,val,test}/PATH            (PATH as in the caption file)
    out/annotations/captions_{train,val,test}.json

Images are split (not captions: all captions of an image stay in its split) by a seeded
shuffle of their sorted paths. Images are hard-linked into ``out`` where the file system
allows it (no extra space, and the dataset stays whole if the originals are moved or
deleted), else copied. A row that cannot be used (unknown or unreadable image, empty
caption, wrong number of columns, not JSON) is reported with its line number and skipped;
the run fails only when no usable image is left.
"""

from __future__ import annotations

import csv
import json
import logging
import os
import random
import shutil
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from captioning.data.images import check_images
from captioning.errors import DataError

logger = logging.getLogger("captioning")

SPLITS = ("train", "val", "test")
FORMATS = (".csv", ".tsv", ".jsonl")
IMAGE_SUFFIXES = frozenset({".jpg", ".jpeg", ".png", ".webp", ".bmp", ".gif", ".tif", ".tiff"})


@dataclass
class CaptionTable:
    """Captions per image path (relative to the image folder) and the rows that failed.

    Args:
        captions: image path -> its captions, in file order.
        lines: image path -> the line numbers that named it (for reports).
        problems: ``(line, problem)`` of every row that was not used.
    """

    captions: dict[str, list[str]] = field(default_factory=lambda: defaultdict(list))
    lines: dict[str, list[int]] = field(default_factory=lambda: defaultdict(list))
    problems: list[tuple[int, str]] = field(default_factory=list)

    def add(self, line: int, image: Any, captions: list[Any], images: Path) -> None:
        """Check one row and keep its captions, or record why not."""
        if not isinstance(image, str) or not image.strip():
            self.problems.append((line, "no image path"))
            return
        name = os.path.normpath(image.strip()).replace(os.sep, "/")
        if os.path.isabs(name) or name == ".." or name.startswith("../") or "\x00" in name:
            self.problems.append((line, f"image {image[:60]!r} is not a path inside {images}"))
            return
        if not all(isinstance(c, str) for c in captions):
            self.problems.append((line, "a caption that is not text"))
            return
        texts = [c.strip() for c in captions]
        if not texts or not all(texts):
            self.problems.append((line, "empty caption"))
            return
        self.captions[name].extend(texts)
        self.lines[name].append(line)


def read_caption_table(path: str | Path, images: str | Path) -> CaptionTable:
    """The rows of a CSV, TSV or JSON Lines caption file (see the module docstring).

    Raises:
        DataError: the file is missing, of an unknown kind, not UTF-8, or (CSV/TSV) its
            header does not name the ``image`` and ``caption`` columns.
    """
    path, images = Path(path), Path(images)
    if path.suffix.lower() not in FORMATS:
        raise DataError(f"{path}: unknown caption file kind; use .csv, .tsv or .jsonl")
    if not path.is_file():
        raise DataError(f"{path}: caption file not found")
    table = CaptionTable()
    try:
        with open(path, encoding="utf-8-sig", newline="") as handle:
            if path.suffix.lower() == ".jsonl":
                _read_jsonl(handle, table, images)
            else:
                _read_delimited(handle, "\t" if path.suffix.lower() == ".tsv" else ",", path,
                                table, images)  # fmt: skip
    except UnicodeDecodeError as exc:
        raise DataError(f"{path}: not UTF-8 text ({exc.reason} at byte {exc.start}); "
                        f"save it as UTF-8") from exc  # fmt: skip
    except csv.Error as exc:
        raise DataError(f"{path}: not a readable CSV/TSV file ({exc})") from exc
    return table


def _read_jsonl(handle: Any, table: CaptionTable, images: Path) -> None:
    for number, text in enumerate(handle, start=1):
        if not text.strip():
            continue
        try:
            row = json.loads(text)
        except (json.JSONDecodeError, RecursionError):
            table.problems.append((number, "not a JSON object"))
            continue
        if not isinstance(row, dict):
            table.problems.append((number, "not a JSON object"))
        elif "captions" in row:
            captions = row["captions"]
            if not isinstance(captions, list):
                table.problems.append((number, "'captions' is not a list"))
            else:
                table.add(number, row.get("image"), captions, images)
        elif "caption" in row:
            table.add(number, row.get("image"), [row["caption"]], images)
        else:
            table.problems.append((number, "neither 'caption' nor 'captions'"))


def _read_delimited(
    handle: Any, delimiter: str, path: Path, table: CaptionTable, images: Path
) -> None:
    reader = csv.reader(handle, delimiter=delimiter)
    header = [h.strip().lower() for h in next(reader, [])]
    if "image" not in header or "caption" not in header:
        raise DataError(f"{path}: the first line must be a header naming the columns 'image' "
                        f"and 'caption', got {header[:6]}")  # fmt: skip
    image_at, caption_at = header.index("image"), header.index("caption")
    for row in reader:
        number = reader.line_num
        if not row or not any(cell.strip() for cell in row):
            continue
        if len(row) != len(header):
            table.problems.append((number, f"{len(row)} columns, the header has {len(header)}"))
            continue
        table.add(number, row[image_at], [row[caption_at]], images)


def split_images(names: list[str], val: float, test: float, seed: int) -> dict[str, list[str]]:
    """A seeded split of ``names``: ``round(fraction * N)`` images each for val and test, at
    least one when the fraction is above zero; train keeps the rest and must keep one."""
    # Training picks its checkpoint on val, so val cannot be empty; test may be.
    if not 0 < val < 1:
        raise DataError(f"--val must be a fraction above 0 and below 1, got {val}")
    if not 0 <= test < 1:
        raise DataError(f"--test must be a fraction from 0 to below 1, got {test}")
    counts = {s: max(round(f * len(names)), 1 if f > 0 else 0)
              for s, f in (("val", val), ("test", test))}  # fmt: skip
    if counts["val"] + counts["test"] >= len(names):
        raise DataError(f"{len(names)} usable images cannot be split into train, "
                        f"{counts['val']} val and {counts['test']} test; add images or lower "
                        f"--val and --test")  # fmt: skip
    order = sorted(names)
    random.Random(seed).shuffle(order)
    test_names = order[: counts["test"]]
    val_names = order[counts["test"] : counts["test"] + counts["val"]]
    train_names = order[counts["test"] + counts["val"] :]
    return {"train": sorted(train_names), "val": sorted(val_names), "test": sorted(test_names)}


def _place(source: Path, target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.link(source, target)
    except OSError:  # another file system, or links not allowed: copy
        shutil.copy2(source, target)


@dataclass
class FolderSummary:
    """What :func:`prepare_folder` wrote and what it skipped.

    Args:
        out_dir: the dataset root.
        images: images per split.
        captions: captions per split.
        skipped: ``(line, problem)`` of every caption-file row not used, by line number.
    """

    out_dir: str
    images: dict[str, int]
    captions: dict[str, int]
    skipped: list[tuple[int, str]]


def _usable_images(table: CaptionTable, images: Path, progress: bool) -> list[str]:
    """The images of the table that load; rows naming the others become problems."""
    paths = {name: str(images / name) for name in table.captions}
    bad = dict(check_images(list(paths.values()), progress=progress))
    for name, path in paths.items():
        if path in bad:
            for line in table.lines[name]:
                table.problems.append((line, f"image {name}: {bad[path]}"))
    unnamed = sum(
        1
        for path in images.rglob("*")
        if path.suffix.lower() in IMAGE_SUFFIXES
        and path.relative_to(images).as_posix() not in table.captions
    )
    if unnamed:
        logger.info("%d image files in %s have no caption row and are not used", unnamed, images)
    return [name for name, path in paths.items() if path not in bad]


def prepare_folder(
    images: str | Path,
    captions: str | Path,
    out: str | Path,
    val: float = 0.1,
    test: float = 0.1,
    seed: int = 0,
    progress: bool = True,
) -> FolderSummary:
    """Write a COCO-style dataset (see the module docstring) from an image folder and a
    caption file.

    Args:
        images: the folder the caption file's image paths are relative to.
        captions: the ``.csv``, ``.tsv`` or ``.jsonl`` caption file.
        out: the new dataset root; it must not exist or be empty.
        val: the share of images for validation.
        test: the share of images for testing.
        seed: the seed of the split; the same files and seed give the same split.
        progress: a bar on a terminal while the images are checked.

    Raises:
        DataError: the inputs cannot be read, ``out`` already holds files, or no usable
            image is left (each bad row is also logged with its line number).
    """
    images, out = Path(images), Path(out)
    if not images.is_dir():
        raise DataError(f"{images}: image folder not found")
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise DataError(f"{out}: already exists and is not empty; choose a new --out")
    table = read_caption_table(captions, images)
    usable = _usable_images(table, images, progress)
    for line, problem in sorted(table.problems):
        logger.warning("%s:%d: %s; row skipped", captions, line, problem)
    if not usable:
        raise DataError(f"{captions}: no row names a readable image with a caption "
                        f"({len(table.problems)} rows skipped, see above)")  # fmt: skip
    splits = split_images(usable, val, test, seed)
    ids = {name: number for number, name in enumerate(sorted(usable), start=1)}
    next_caption = 1
    for split in SPLITS:
        entries, annotations = [], []
        for name in splits[split]:
            _place(images / name, out / "images" / split / name)
            entries.append({"id": ids[name], "file_name": name})
            for text in table.captions[name]:
                annotations.append({"id": next_caption, "image_id": ids[name], "caption": text})
                next_caption += 1
        path = out / "annotations" / f"captions_{split}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        info = {"description": f"prepared from {captions}", "split": split, "seed": seed}
        path.write_text(json.dumps({"info": info, "licenses": [], "images": entries,
                                    "annotations": annotations}) + "\n")  # fmt: skip
    return FolderSummary(
        out_dir=str(out),
        images={s: len(splits[s]) for s in SPLITS},
        captions={s: sum(len(table.captions[n]) for n in splits[s]) for s in SPLITS},
        skipped=sorted(table.problems),
    )
