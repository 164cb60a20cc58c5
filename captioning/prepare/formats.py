"""The caption files people have, read into one table: captions per image path.

Formats, told apart by their content (``format=`` / ``--format`` names one instead):

* ``csv`` / ``tsv``: a header naming the columns ``image`` and ``caption``, one row per
  caption; quoted fields as usual. When ``caption`` is the last column, a row with more
  cells than the header is a caption holding the separator unquoted, and is kept whole.
* ``jsonl``: one object per line, ``{"image": ..., "caption": "..."}`` or
  ``{"image": ..., "captions": ["...", ...]}``.
* ``lines``: no header, ``NAME<sep>CAPTION`` with ``<sep>`` one of ``,`` TAB ``|`` (the one
  after which the first lines hold an image file name). The line is split at the FIRST
  separator, so the caption may hold more of them.
* ``flickr``: Flickr8k/30k token files, ``NAME#N<TAB>CAPTION`` (``Flickr8k.token.txt``,
  ``results_20130124.token``), and Flickr30k's ``results.csv``,
  ``image_name| comment_number| comment``.
* ``coco``: a COCO captions json, ``{"images": [{"id", "file_name"}],
  "annotations": [{"image_id", "caption"}]}``.

Files are UTF-8 (a byte-order mark is fine). Captions are NFC-normalised, lose invisible
format characters (Unicode category Cf: zero-width spaces, byte-order marks, soft hyphens)
and outer whitespace, and are otherwise kept as written (commas and tabs included). A row
that cannot be used is recorded with its line number (for ``coco``, the annotation's
position) and why; nothing is dropped without a record.
"""

from __future__ import annotations

import contextlib
import csv
import io
import json
import logging
import os
import re
import unicodedata
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from captioning.errors import DataError

logger = logging.getLogger("captioning")

FORMATS = ("csv", "tsv", "jsonl", "lines", "flickr", "coco")
IMAGE_SUFFIXES = frozenset({".jpg", ".jpeg", ".png", ".webp", ".bmp", ".gif", ".tif", ".tiff"})
# Separators of headerless lines, in the order that breaks ties.
SEPARATORS = {"\t": "TAB", ",": "','", "|": "'|'"}
# How many non-empty lines the format is guessed from.
SAMPLE_LINES = 50
# The longest CSV/TSV field read, in characters (the csv module's default is 128 KiB, past
# which it aborts the file); a row with a longer field is reported by line and skipped.
MAX_FIELD_CHARS = 1 << 24
_IMAGE_NAME = r"[^\t]*?\.(?:" + "|".join(s[1:] for s in sorted(IMAGE_SUFFIXES)) + ")"
_FLICKR_TOKEN = re.compile(r"^(?P<name>.+?)#\d+\s(?P<caption>.*)$", re.S)
_FLICKR_TOKEN_START = re.compile(r"^" + _IMAGE_NAME + r"(?:\.\d+)?#\d+\t", re.I)
_FLICKR_PIPE_START = re.compile(r"^" + _IMAGE_NAME + r"\s*\|\s*\d+\s*\|", re.I)
_FLICKR_PIPE_REST = (re.compile(r"^\s*\d+\s*\|(.*)$", re.S), re.compile(r"^\s*\d+\s+(.*)$", re.S))


def clean_caption(text: str) -> str:
    """``text`` NFC-normalised, without format characters (category Cf) or outer whitespace."""
    text = unicodedata.normalize("NFC", text)
    return "".join(c for c in text if unicodedata.category(c) != "Cf").strip()


def _clean_name(text: str) -> str:
    """``text`` without outer whitespace and outer format characters (category Cf)."""
    # A byte-order mark or zero-width space before a name (files joined with `cat`) would
    # make it a name no file has, and an invisible one in the report.
    start, end = 0, len(text)
    while start < end and (text[start].isspace() or unicodedata.category(text[start]) == "Cf"):
        start += 1
    while end > start and (text[end - 1].isspace() or unicodedata.category(text[end - 1]) == "Cf"):
        end -= 1
    return text[start:end]


@dataclass
class CaptionTable:
    """Captions per image path (relative to the image folder) and the rows that failed.

    Args:
        format: the format the file was read as (one of :data:`FORMATS`).
        separator: for ``lines``, the separator between name and caption.
        unit: what the numbers in ``lines`` and ``problems`` count: ``"line"`` of the file,
            or ``"annotation"`` (position in a COCO file's ``annotations``).
        captions: image path -> its captions, in file order.
        lines: image path -> the numbers of the rows that named it (for reports).
        problems: ``(number, problem)`` of every row that was not used.
        cleaned: captions changed by Unicode normalisation or invisible characters removed.
        joined: rows whose caption held the separator unquoted (csv/tsv), kept whole.
    """

    format: str = ""
    separator: str | None = None
    unit: str = "line"
    captions: dict[str, list[str]] = field(default_factory=lambda: defaultdict(list))
    lines: dict[str, list[int]] = field(default_factory=lambda: defaultdict(list))
    problems: list[tuple[int, str]] = field(default_factory=list)
    cleaned: int = 0
    joined: int = 0

    def add(self, line: int, image: Any, captions: list[Any], images: Path) -> None:
        """Check one row and keep its captions, or record why not."""
        if not isinstance(image, str) or not _clean_name(image):
            self.problems.append((line, "no image path"))
            return
        name = os.path.normpath(_clean_name(image)).replace(os.sep, "/")
        if os.path.isabs(name) or name == ".." or name.startswith("../") or "\x00" in name:
            self.problems.append((line, f"image {image[:60]!r} is not a path inside {images}"))
            return
        if not all(isinstance(c, str) for c in captions):
            self.problems.append((line, "a caption that is not text"))
            return
        texts = [clean_caption(c) for c in captions]
        if not texts or not all(texts):
            self.problems.append((line, "empty caption"))
            return
        self.cleaned += sum(t != c.strip() for t, c in zip(texts, captions))
        self.captions[name].extend(texts)
        self.lines[name].append(line)

    def where(self, path: str | Path, number: int) -> str:
        """``path:12`` for a line, ``path: annotation 12`` for a COCO annotation."""
        return f"{path}:{number}" if self.unit == "line" else f"{path}: {self.unit} {number}"

    def describe(self) -> str:
        """The format in words, e.g. ``lines of NAME,CAPTION, split at the first ','``."""
        if self.format == "lines" and self.separator is not None:
            shown = "<TAB>" if self.separator == "\t" else self.separator
            return f"lines of NAME{shown}CAPTION, split at the first {SEPARATORS[self.separator]}"
        return self.format


def read_captions(path: str | Path, images: str | Path, format: str = "auto") -> CaptionTable:
    """Read a caption file in any of :data:`FORMATS` (see the module docstring).

    Args:
        path: the caption file.
        images: the folder its image paths are relative to (named in reports).
        format: ``"auto"`` to tell the format from the content, or one of :data:`FORMATS`.

    Raises:
        DataError: the file is missing, not UTF-8, of a format that cannot be told (the
            message names the ``--format`` choices), or its header or structure does not
            fit the format.
    """
    path, images = Path(path), Path(images)
    if format != "auto" and format not in FORMATS:
        raise DataError(f"unknown caption format {format!r}; use auto, {', '.join(FORMATS)}")
    if not path.is_file():
        raise DataError(f"{path}: caption file not found")
    text = _read_text(path)
    how = "--format"
    if format == "auto":
        format, how = detect_format(text, path), "detected from its content; --format overrides"
    table = CaptionTable(format=format)
    if format == "lines":
        table.separator = _lines_separator(_sample(text), path)
    logger.info("%s: read as %s (%s)", path, table.describe(), how)
    if format in ("csv", "tsv"):
        _read_delimited(text, "\t" if format == "tsv" else ",", path, table, images)
    elif format == "jsonl":
        _read_jsonl(text, table, images)
    elif format == "lines":
        _read_lines(text, table, images)
    elif format == "flickr":
        _read_flickr(text, table, images)
    else:
        _read_coco(text, path, table, images)
    if table.joined:
        logger.info(
            "%s: %s the separator unquoted; each is kept whole",
            path,
            _count(table.joined, "caption holds", "captions hold"),
        )
    if table.cleaned:
        logger.info(
            "%s: %s invisible format characters removed or Unicode put in NFC form",
            path,
            _count(table.cleaned, "caption had", "captions had"),
        )
    return table


def _count(number: int, one: str, many: str) -> str:
    return f"{number} {one if number == 1 else many}"


def _read_text(path: Path) -> str:
    data = path.read_bytes()
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        hint = " (it is UTF-16)" if data[:2] in (b"\xff\xfe", b"\xfe\xff") else ""
        raise DataError(
            f"{path}: not UTF-8 text{hint} ({exc.reason} at byte {exc.start}); save it as UTF-8"
        ) from exc


def _sample(text: str) -> list[str]:
    """The first non-empty lines of ``text``, without line ends."""
    sample = []
    for line in io.StringIO(text, newline="\n"):  # lazily: a COCO json can be 100 MB
        if line.strip():
            sample.append(line.rstrip("\r\n"))
            if len(sample) == SAMPLE_LINES:
                break
    return sample


def _is_image_name(text: str) -> bool:
    return Path(_clean_name(text)).suffix.lower() in IMAGE_SUFFIXES


@contextlib.contextmanager
def _csv_field_limit() -> Iterator[None]:
    """Let the csv module read fields of up to :data:`MAX_FIELD_CHARS` in the block."""
    previous = csv.field_size_limit(MAX_FIELD_CHARS)
    try:
        yield
    finally:
        csv.field_size_limit(previous)


def _header_cells(line: str, delimiter: str) -> list[str]:
    try:
        with _csv_field_limit():
            cells = next(csv.reader([line], delimiter=delimiter), [])
    except csv.Error:
        return []
    return [cell.strip().lower() for cell in cells]


def detect_format(text: str, path: str | Path = "captions") -> str:
    """The format of a caption file's ``text``, told from its first non-empty lines.

    ``{`` starts ``jsonl`` (one object per line) or ``coco`` (an object with ``images``);
    a header naming ``image`` and ``caption`` is ``csv`` or ``tsv``; ``NAME#N<TAB>`` or
    ``image_name| comment_number| comment`` is ``flickr``; ``NAME<sep>CAPTION`` lines whose
    names end in an image suffix (most of the first lines) are ``lines``.

    Raises:
        DataError: the file is empty, or none of the formats fits; the message names the
            ``--format`` choices.
    """
    sample = _sample(text)
    choices = f"name it with --format {'|'.join(FORMATS)}"
    if not sample:
        raise DataError(f"{path}: the caption file is empty")
    first = sample[0].strip()
    if first.startswith(("{", "[")):
        try:
            row = json.loads(first)
        except (json.JSONDecodeError, RecursionError):
            return "coco"  # a json document over several lines; its reader checks the keys
        if isinstance(row, dict) and not {"images", "annotations"} & row.keys():
            return "jsonl"
        return "coco"
    for delimiter, name in ((",", "csv"), ("\t", "tsv")):
        cells = _header_cells(first, delimiter)
        if "image" in cells and "caption" in cells:
            return name
    if _header_cells(first, "|")[:1] == ["image_name"]:
        return "flickr"
    flickr = [
        bool(_FLICKR_TOKEN_START.match(line) or _FLICKR_PIPE_START.match(line)) for line in sample
    ]
    if flickr[0] or sum(flickr) > len(sample) / 2:
        return "flickr"
    rest = sample[1:]
    if rest and not any(_named_lines(sample[:1], sep) for sep in SEPARATORS):
        if max(_named_lines(rest, sep) for sep in SEPARATORS) >= 0.8 * len(rest):
            # The other lines are NAME<sep>CAPTION: a header without the usual names.
            raise DataError(
                f"{path}: the first line {first[:60]!r} looks like a header; a "
                f"header naming the columns 'image' and 'caption' is needed (or "
                f"delete the line, or name --format lines)"
            )
    if max(_named_lines(sample, sep) for sep in SEPARATORS) > len(sample) / 2:
        return "lines"
    raise DataError(
        f"{path}: cannot tell the caption format from its first lines ({first[:40]!r}); {choices}"
    )


def _named_lines(sample: list[str], separator: str) -> int:
    """How many lines of ``sample`` hold an image file name before their first separator."""
    return sum(separator in line and _is_image_name(line.split(separator, 1)[0]) for line in sample)


def _lines_separator(sample: list[str], path: Path) -> str:
    """The separator after which most lines name an image (ties: the order of SEPARATORS),
    else the one most lines hold."""
    best = max(
        SEPARATORS, key=lambda sep: (_named_lines(sample, sep), sum(sep in line for line in sample))
    )
    if not any(best in line for line in sample):
        raise DataError(
            f"{path}: no line holds ',', TAB or '|' between an image name and its "
            f"caption; write NAME,CAPTION lines or name another --format"
        )
    return best


def _read_lines(text: str, table: CaptionTable, images: Path) -> None:
    separator = table.separator or ","
    for number, raw in enumerate(text.split("\n"), start=1):
        line = raw.rstrip("\r")
        if not line.strip():
            continue
        name, found, caption = line.partition(separator)
        if not found:
            table.problems.append(
                (number, f"no {SEPARATORS[separator]} between an image name and a caption")
            )
            continue
        table.add(number, name, [caption], images)


def _read_flickr(text: str, table: CaptionTable, images: Path) -> None:
    sample = _sample(text)
    pipes = bool(sample) and (
        _header_cells(sample[0], "|")[:1] == ["image_name"]
        or bool(_FLICKR_PIPE_START.match(sample[0]))
    )
    for number, raw in enumerate(text.split("\n"), start=1):
        line = raw.rstrip("\r")
        if not line.strip():
            continue
        if pipes:
            name, found, rest = line.partition("|")
            if name.strip().lower() == "image_name":
                continue  # the header
            # Flickr30k's results.csv has a row that lost its second '|' ("NAME| 4 A dog ...").
            match = found and (_FLICKR_PIPE_REST[0].match(rest) or _FLICKR_PIPE_REST[1].match(rest))
            if not match:
                table.problems.append((number, "not NAME| NUMBER| CAPTION"))
                continue
            table.add(number, name, [match.group(1)], images)
        else:
            match = _FLICKR_TOKEN.match(line)
            if not match:
                table.problems.append((number, "not NAME#N<TAB>CAPTION"))
                continue
            table.add(number, match.group("name"), [match.group("caption")], images)


def _read_jsonl(text: str, table: CaptionTable, images: Path) -> None:
    for number, line in enumerate(text.split("\n"), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
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


def _looks_like_row(line: str, delimiter: str) -> bool:
    return delimiter in line and _is_image_name(line.split(delimiter, 1)[0])


def _read_delimited(
    text: str, delimiter: str, path: Path, table: CaptionTable, images: Path
) -> None:
    with _csv_field_limit():
        _read_rows(
            csv.reader(io.StringIO(text, newline=""), delimiter=delimiter),
            delimiter,
            path,
            table,
            images,
        )


def _next_row(reader: Any, table: CaptionTable) -> tuple[int, list[str]] | None:
    """The reader's next row and the line it starts on (None at the end); a row it cannot
    read (a field longer than :data:`MAX_FIELD_CHARS`) is recorded by line and skipped."""
    while True:
        first = reader.line_num + 1
        try:
            return first, next(reader)
        except StopIteration:
            return None
        except csv.Error as exc:
            table.problems.append((first, f"not readable as CSV/TSV ({exc}); a quote not closed?"))


def _read_rows(reader: Any, delimiter: str, path: Path, table: CaptionTable, images: Path) -> None:
    try:
        header = [h.strip().lower() for h in next(reader, [])]
        if "image" not in header or "caption" not in header:
            raise DataError(
                f"{path}: the first line must be a header naming the columns 'image' "
                f"and 'caption', got {header[:6]}"
            )
        image_at, caption_at = header.index("image"), header.index("caption")
        caption_last = caption_at == len(header) - 1
        while (numbered := _next_row(reader, table)) is not None:
            (first, row), number = numbered, reader.line_num
            if not row or not any(cell.strip() for cell in row):
                continue
            if number > first:  # a quoted field over several lines
                inner = [line for cell in row for line in cell.splitlines()[1:]]
                if any(_looks_like_row(line, delimiter) for line in inner):
                    table.problems.append(
                        (
                            first,
                            f"a quote opened here is closed only on line "
                            f"{number}, so lines {first}-{number} are one "
                            f"field; close or remove it",
                        )
                    )
                    continue
                row = [re.sub(r"\s*[\r\n]+\s*", " ", cell) for cell in row]
            if len(row) < len(header):
                columns = "column" if len(row) == 1 else "columns"
                table.problems.append(
                    (first, f"{len(row)} {columns}, the header has {len(header)}")
                )
                continue
            if len(row) > len(header):
                if not caption_last:
                    table.problems.append(
                        (first, f"{len(row)} columns, the header has {len(header)}")
                    )
                    continue
                row = row[:caption_at] + [delimiter.join(row[caption_at:])]
                table.joined += 1
            table.add(first, row[image_at], [row[caption_at]], images)
    except csv.Error as exc:
        raise DataError(f"{path}: not a readable CSV/TSV file ({exc})") from exc


def _read_coco(text: str, path: Path, table: CaptionTable, images: Path) -> None:
    table.unit = "annotation"
    try:
        data = json.loads(text)
    except (json.JSONDecodeError, RecursionError) as exc:
        where = f" ({exc.msg}, line {exc.lineno})" if isinstance(exc, json.JSONDecodeError) else ""
        raise DataError(
            f"{path}: not a JSON document{where}; fix it, or name another --format"
        ) from exc
    entries = data.get("images") if isinstance(data, dict) else None
    annotations = data.get("annotations") if isinstance(data, dict) else None
    if not isinstance(entries, list) or not isinstance(annotations, list):
        karpathy = isinstance(entries, list) and any(
            isinstance(e, dict) and "sentences" in e for e in entries[:5]
        )
        hint = (
            " (this is a Karpathy split file: train on it with data.format: karpathy)"
            if karpathy
            else ""
        )
        raise DataError(
            f"{path}: a COCO captions file needs 'images' [{{id, file_name}}] and "
            f"'annotations' [{{image_id, caption}}]{hint}"
        )
    names: dict[int | str, Any] = {}
    for entry in entries:
        if isinstance(entry, dict) and isinstance(entry.get("id"), (int, str)):
            names[entry["id"]] = entry.get("file_name")
    for number, annotation in enumerate(annotations, start=1):
        if not isinstance(annotation, dict):
            table.problems.append((number, "not a JSON object"))
            continue
        image_id = annotation.get("image_id")
        if not isinstance(image_id, (int, str)) or image_id not in names:
            table.problems.append((number, f"image_id {image_id!r} is not in 'images'"))
        elif "caption" not in annotation:
            table.problems.append((number, "no 'caption'"))
        elif not isinstance(names[image_id], str):
            table.problems.append((number, f"image {image_id!r} has no 'file_name' in 'images'"))
        else:
            table.add(number, names[image_id], [annotation["caption"]], images)
