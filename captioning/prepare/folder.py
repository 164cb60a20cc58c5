"""One's own photos and captions, made into a COCO-style dataset with seeded splits.

Input: a folder of images and a caption file naming them by their path inside that folder,
in any format :mod:`captioning.prepare.formats` reads (CSV/TSV with a header, JSON Lines,
headerless ``NAME,CAPTION`` lines, Flickr token files, a COCO captions json), told apart by
content or named with ``format=``.

Output, the layout ``captioning shapes`` writes and the default ``data`` section reads, so
``--set data.root=OUT`` trains on it with any config::

    out/images/{train,val,test}/PATH            (PATH as in the caption file)
    out/annotations/captions_{train,val,test}.json
    out/prepare_report.txt                      (every row skipped, every image not used)

Images are split (not captions: all captions of an image stay in its split) by a seeded
shuffle of their sorted paths. Images are hard-linked into ``out`` where the file system
allows it (no extra space, and the dataset stays whole if the originals are moved or
deleted), else copied. A row that cannot be used (missing or unreadable image, empty
caption, too few columns, not JSON) is reported with its line number and skipped, and every
image file in the folder that no caption names is reported by path. A name that differs from
a file on disk only by leading zeros (``0059.jpg`` and ``00059.jpg``) or letter case is
reported as such and never matched. The run fails only when no usable image is left.
"""

from __future__ import annotations

import json
import logging
import os
import random
import re
import shutil
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

from captioning.data.images import check_images
from captioning.errors import DataError
from captioning.files import write_atomically
from captioning.folders import LOCK, MARKER, Writer, claim_folder, holds_only
from captioning.prepare.formats import IMAGE_SUFFIXES, CaptionTable, read_captions

logger = logging.getLogger("captioning")

SPLITS = ("train", "val", "test")
REPORT = "prepare_report.txt"
# Written before folders were marked, a failed run's folder held only its report.
PREPARE = Writer("prepare", holds_only((REPORT,), REPORT))
# Problems logged one by one; the rest are counted, and all are in the report.
LOGGED = 20


def split_images(names: list[str], val: float, test: float, seed: int) -> dict[str, list[str]]:
    """A seeded split of ``names``: ``round(fraction * N)`` images each for val and test, at
    least one when the fraction is above zero; train keeps the rest and must keep one."""
    # Training picks its checkpoint on val, so val cannot be empty; test may be.
    if not 0 < val < 1:
        raise DataError(f"--val must be a fraction above 0 and below 1, got {val}")
    if not 0 <= test < 1:
        raise DataError(f"--test must be a fraction from 0 to below 1, got {test}")
    counts = {
        s: max(round(f * len(names)), 1 if f > 0 else 0) for s, f in (("val", val), ("test", test))
    }
    if counts["val"] + counts["test"] >= len(names):
        raise DataError(
            f"{len(names)} usable images cannot be split into train, "
            f"{counts['val']} val and {counts['test']} test; add images or lower "
            f"--val and --test"
        )
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
        skipped: ``(number, problem)`` of every caption-file row dropped, by number (a line,
            or for ``coco`` an annotation's position).
        format: the format the caption file was read as.
        uncaptioned: image files in the folder (paths inside it) that no caption names.
        report: the file that lists every skipped row and every uncaptioned image.
        split_problems: with published split files, each of their names that is not a
            usable image and each usable image in none of them, in words.
    """

    out_dir: str
    images: dict[str, int]
    captions: dict[str, int]
    skipped: list[tuple[int, str]]
    format: str
    uncaptioned: list[str]
    report: str
    split_problems: list[str] = field(default_factory=list)


def _digits_key(name: str) -> str:
    """``name`` with the leading zeros of each run of digits removed."""
    return re.sub(r"\d+", lambda m: m.group().lstrip("0") or "0", name)


def _how_near(name: str, other: str) -> str:
    """How two names that share a :func:`_near_key` differ."""
    if _digits_key(name) == _digits_key(other):
        return "differs by leading zeros"
    if name.casefold() == other.casefold():
        return "differs in letter case"
    return "differs by leading zeros and letter case"


def _near_key(name: str) -> str:
    return _digits_key(name.casefold())


def _near_index(names: list[str]) -> dict[str, list[str]]:
    index = defaultdict(list)
    for name in names:
        index[_near_key(name)].append(name)
    return index


def _near(name: str, index: dict[str, list[str]]) -> list[str]:
    """The names of ``index`` that differ from ``name`` only by leading zeros or case."""
    return sorted(other for other in index.get(_near_key(name), []) if other != name)


def _line_ranges(numbers: list[int]) -> str:
    """``[3, 4, 5, 9]`` -> ``"3-5, 9"``."""
    ranges: list[list[int]] = []
    for number in sorted(numbers):
        if ranges and number == ranges[-1][1] + 1:
            ranges[-1][1] = number
        else:
            ranges.append([number, number])
    return ", ".join(f"{a}-{b}" if b > a else f"{a}" for a, b in ranges)


def _rows_name(table: CaptionTable, name: str) -> str:
    """``"line 7 names"`` or ``"lines 3-5, 9 name"``: the rows of ``table`` that name ``name``."""
    numbers = table.lines[name]
    if len(numbers) == 1:
        return f"{table.unit} {numbers[0]} names"
    return f"{table.unit}s {_line_ranges(numbers)} name"


def _disk_images(images: Path) -> list[str]:
    """Image files under ``images``, as sorted paths inside it."""
    return sorted(
        path.relative_to(images).as_posix()
        for path in images.rglob("*")
        if path.suffix.lower() in IMAGE_SUFFIXES and path.is_file()
    )


@dataclass
class FolderMatch:
    """The caption file's names matched to the image folder's files.

    Args:
        present: names that are files on disk -> their paths.
        uncaptioned: image files in the folder (paths inside it) that no caption names.
        notes: for some of ``uncaptioned``, a caption name that differs from it only by
            leading zeros or letter case, in words.
    """

    present: dict[str, Path]
    uncaptioned: list[str]
    notes: dict[str, str]


def match_images(table: CaptionTable, images: str | Path) -> FolderMatch:
    """Match the caption table's names to the files in ``images``, without decoding any.

    A row that names a file not on disk becomes a problem of ``table``, which says so when a
    file on disk differs from the name only by leading zeros or letter case (such names are
    never matched).

    Args:
        table: the caption file's rows; its ``problems`` grow.
        images: the image folder.
    """
    images = Path(images)
    disk = _disk_images(images)
    disk_index = _near_index(disk)
    present = {}
    for name in table.captions:
        path = images / name
        if path.is_file():
            present[name] = path
            continue
        problem = f"image {name}: no such file"
        near = _near(name, disk_index)
        if near:
            verb = "is" if len(near) == 1 else "are"
            problem += (
                f"; {' and '.join(near)} {verb} on disk ({_how_near(name, near[0])}), not matched"
            )
        for line in table.lines[name]:
            table.problems.append((line, problem))
    named_index = _near_index(list(table.captions))
    uncaptioned = [name for name in disk if name not in table.captions]
    notes = {}
    for name in uncaptioned:
        notes[name] = "; ".join(
            f"{_rows_name(table, other)} {other}, which {_how_near(name, other)}"
            f"{'' if other in present else ' (not matched)'}"
            for other in _near(name, named_index)
        )
    return FolderMatch(present, uncaptioned, {name: note for name, note in notes.items() if note})


def _usable_images(table: CaptionTable, present: dict[str, Path], progress: bool) -> list[str]:
    """The images of ``present`` that load; rows naming the others become problems."""
    bad = dict(check_images([str(p) for p in present.values()], progress=progress))
    for name, path in present.items():
        if str(path) in bad:
            for line in table.lines[name]:
                table.problems.append((line, f"image {name}: {bad[str(path)]}"))
    return [name for name, path in present.items() if str(path) not in bad]


def _uncaptioned_lines(match: FolderMatch) -> list[str]:
    return [
        f"{name}: {match.notes[name]}" if name in match.notes else name
        for name in match.uncaptioned
    ]


def _log_problems(
    table: CaptionTable, captions: Path, images: Path, match: FolderMatch, report: Path
) -> None:
    problems = sorted(table.problems)
    for line, problem in problems[:LOGGED]:
        logger.warning("%s: %s; row skipped", table.where(captions, line), problem)
    if len(problems) > LOGGED:
        logger.warning(
            "... and %d more rows of %s skipped (%d in all, each listed in %s)",
            len(problems) - LOGGED,
            captions,
            len(problems),
            report,
        )
    uncaptioned = _uncaptioned_lines(match)
    if uncaptioned:
        logger.warning(
            "%d image files in %s have no caption and are not used:", len(uncaptioned), images
        )
        for name in uncaptioned[:LOGGED]:
            logger.warning("  %s", name)
        if len(uncaptioned) > LOGGED:
            logger.warning(
                "  ... and %d more (each listed in %s)", len(uncaptioned) - LOGGED, report
            )


def _write_report(
    report: Path,
    table: CaptionTable,
    captions: Path,
    images: Path,
    match: FolderMatch,
    kept: str,
    split_notes: list[str] | None = None,
    verb: str = "folder",
) -> None:
    problems = sorted(table.problems)
    uncaptioned = _uncaptioned_lines(match)
    lines = [
        f"captioning prepare {verb}",
        f"images:   {images}",
        f"captions: {captions} (read as {table.describe()})",
        f"kept:     {kept}",
        "",
        f"{len(problems)} rows skipped:",
        *(f"  {table.where(captions, line)}: {problem}" for line, problem in problems),
        "",
        f"{len(uncaptioned)} image files without a caption (not used):",
        *(f"  {name}" for name in uncaptioned),
    ]
    if split_notes is not None:
        lines += [
            "",
            f"{len(split_notes)} split-file problems (images not used):",
            *(f"  {note}" for note in split_notes),
        ]
    write_atomically(report, "\n".join(lines) + "\n")


@dataclass
class FixedSplits:
    """The images of each split as published: one file per split, one image name a line.

    Args:
        files: ``train``, ``val`` and ``test`` -> the split file.
        verb: the ``captioning prepare`` verb that reads them (named in the report).
    """

    files: dict[str, Path]
    verb: str = "flickr"

    def __post_init__(self) -> None:
        self.files = {split: Path(self.files[split]) for split in SPLITS}
        for split, path in self.files.items():
            if not path.is_file():
                raise DataError(f"{path}: {split} split file not found")

    def describe(self) -> str:
        return ", ".join(str(self.files[s]) for s in SPLITS)

    def read(self) -> dict[str, list[tuple[int, str]]]:
        """Each split's ``(line number, name)`` pairs, blank lines left out."""
        listed: dict[str, list[tuple[int, str]]] = {}
        for split, path in self.files.items():
            try:
                text = path.read_text(encoding="utf-8-sig")
            except UnicodeDecodeError as exc:
                raise DataError(f"{path}: split file is not UTF-8 text") from exc
            listed[split] = [
                (number, line.strip())
                for number, line in enumerate(text.splitlines(), start=1)
                if line.strip()
            ]
        return listed

    def assign(
        self, usable: list[str], table: CaptionTable
    ) -> tuple[dict[str, list[str]], list[str]]:
        """The usable images of each split and, in words, every problem: a listed name that
        is not a usable image (no caption, or its image missing or unreadable), a name
        listed twice, and a usable image that no split file lists.

        A listed name without an image suffix (an image id) stands for ``NAME.jpg``.
        """
        usable_set = set(usable)
        splits: dict[str, list[str]] = {split: [] for split in SPLITS}
        placed: dict[str, str] = {}
        notes = []
        for split, entries in self.read().items():
            path = self.files[split]
            for number, listed in entries:
                name = listed if Path(listed).suffix.lower() in IMAGE_SUFFIXES else listed + ".jpg"
                where = f"{path}:{number}: {listed}"
                if name in placed:
                    notes.append(f"{where}: already listed in {placed[name]}; kept there")
                elif name in usable_set:
                    placed[name] = f"{self.files[split].name} ({split})"
                    splits[split].append(name)
                elif name in table.captions:
                    notes.append(
                        f"{where}: its image is missing or unreadable (see the rows "
                        f"skipped); not used"
                    )
                else:
                    notes.append(f"{where}: no caption names it; not used")
        for name in sorted(usable_set - set(placed)):
            notes.append(f"{name}: captioned, but no split file lists it; not used")
        return {split: sorted(names) for split, names in splits.items()}, notes


def _log_split_notes(notes: list[str], report: Path) -> None:
    for note in notes[:LOGGED]:
        logger.warning("%s", note)
    if len(notes) > LOGGED:
        logger.warning(
            "... and %d more split-file problems (each listed in %s)", len(notes) - LOGGED, report
        )


def _write_splits(
    out: Path,
    images: Path,
    table: CaptionTable,
    splits: dict[str, list[str]],
    infos: dict[str, dict[str, object]],
) -> None:
    """Each split's images placed under ``out/images/SPLIT`` and its captions file, with
    image ids numbered over the sorted names of all splits."""
    used = sorted(name for split in SPLITS for name in splits[split])
    ids = {name: number for number, name in enumerate(used, start=1)}
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
        dataset = {
            "info": infos[split],
            "licenses": [],
            "images": entries,
            "annotations": annotations,
        }
        # the captions as written (readable in an editor), not as \u escapes
        write_atomically(path, json.dumps(dataset, ensure_ascii=False) + "\n")


def prepare_folder(
    images: str | Path,
    captions: str | Path,
    out: str | Path,
    val: float = 0.1,
    test: float = 0.1,
    seed: int = 0,
    progress: bool = True,
    format: str = "auto",
    fixed_splits: FixedSplits | None = None,
) -> FolderSummary:
    """Write a COCO-style dataset (see the module docstring) from an image folder and a
    caption file.

    Args:
        images: the folder the caption file's image paths are relative to.
        captions: the caption file (see :mod:`captioning.prepare.formats`).
        out: the new dataset root; it must not exist or be empty (a ``prepare_report.txt``
            left by a run that failed is replaced). It is locked while it is written.
        val: the share of images for validation.
        test: the share of images for testing.
        seed: the seed of the split; the same files and seed give the same split.
        progress: a bar on a terminal while the images are checked.
        format: ``"auto"`` to tell the caption format from the content, or one of
            :data:`captioning.prepare.formats.FORMATS`.
        fixed_splits: the images of each split as published (Flickr's split files) instead
            of a seeded split; ``val``, ``test`` and ``seed`` are then unused, and every
            name of a split file that is not a usable image, or usable image in no split
            file, is reported.

    Raises:
        DataError: the inputs cannot be read, ``out`` already holds a dataset, or no usable
            image is left (each bad row is also logged with its line number, and all are
            listed in ``out/prepare_report.txt``).
        CaptioningError: ``out`` holds files that ``captioning prepare`` did not write, or
            is in use; nothing in it is changed.
    """
    images, captions, out = Path(images), Path(captions), Path(out)
    if not images.is_dir():
        raise DataError(f"{images}: image folder not found")
    with claim_folder(out, PREPARE, check=_check_new):
        return _prepare(images, captions, out, val, test, seed, progress, format, fixed_splits)


def _check_new(out: Path) -> None:
    """Refuse a dataset folder that holds more than a failed run's report."""
    held = sorted(p.name for p in out.iterdir() if p.name not in (REPORT, MARKER, LOCK))
    if held:
        raise DataError(
            f"{out} already holds a prepared dataset (such as {held[0]}); nothing "
            f"was changed: choose a new --out, or remove that one first"
        )


def _prepare(
    images: Path,
    captions: Path,
    out: Path,
    val: float,
    test: float,
    seed: int,
    progress: bool,
    format: str,
    fixed_splits: FixedSplits | None,
) -> FolderSummary:
    """:func:`prepare_folder` into the folder ``out``, held."""
    report = out / REPORT
    table = read_captions(captions, images, format=format)
    match = match_images(table, images)
    usable = _usable_images(table, match.present, progress)
    _log_problems(table, captions, images, match, report)
    if not usable:
        _write_report(report, table, captions, images, match, "nothing")
        raise DataError(
            f"{captions}: no row names a readable image with a caption "
            f"({len(table.problems)} rows skipped, each listed in "
            f"{report})"
        )
    split_notes = None
    if fixed_splits is None:
        splits = split_images(usable, val, test, seed)
    else:
        splits, split_notes = fixed_splits.assign(usable, table)
        _log_split_notes(split_notes, report)
        if not splits["train"] or not splits["val"]:
            _write_report(
                report, table, captions, images, match, "nothing", split_notes, fixed_splits.verb
            )
            raise DataError(
                f"{fixed_splits.describe()}: no usable image in the "
                f"{'train' if not splits['train'] else 'val'} split "
                f"(each problem listed in {report})"
            )
    how = {
        s: {"seed": seed} if fixed_splits is None else {"split_file": fixed_splits.files[s].name}
        for s in SPLITS
    }
    infos = {s: {"description": f"prepared from {captions}", "split": s, **how[s]} for s in SPLITS}
    _write_splits(out, images, table, splits, infos)
    counts = {s: sum(len(table.captions[n]) for n in splits[s]) for s in SPLITS}
    kept = ", ".join(f"{s} {len(splits[s])} images ({counts[s]} captions)" for s in SPLITS)
    verb = "folder" if fixed_splits is None else fixed_splits.verb
    _write_report(report, table, captions, images, match, kept, split_notes, verb)
    return FolderSummary(
        out_dir=str(out),
        images={s: len(splits[s]) for s in SPLITS},
        captions=counts,
        skipped=sorted(table.problems),
        format=table.format,
        uncaptioned=match.uncaptioned,
        report=str(report),
        split_problems=split_notes or [],
    )
