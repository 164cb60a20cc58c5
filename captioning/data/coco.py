"""COCO-format readers: captions json (2014 and 2017 layouts) and instances json.

Shapes is written in exactly this format, so it is read here with no special case. Every
entry is checked before it is used: a malformed one is refused in one line that names the
file, the entry and what is wrong; entries that are merely unusable (a caption whose image is
not listed, an image without captions, a repeated image id) are dropped and counted in a
warning.
"""

from __future__ import annotations

import json
import logging
import os
from collections import defaultdict
from pathlib import Path
from typing import Any

from captioning.data.records import ImageRecord, ObjectAnnotation
from captioning.errors import DataError

logger = logging.getLogger("captioning")


def load_json(path: str | Path, what: str) -> Any:
    """The parsed JSON of ``path`` (UTF-8, -16 or -32), or a one-line :class:`DataError`."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"{path}: {what} not found")
    try:
        return json.loads(path.read_bytes())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise DataError(f"{path}: not valid JSON ({_short(exc)})") from exc
    except RecursionError as exc:
        raise DataError(f"{path}: not valid {what} (JSON nested too deeply)") from exc


def entries(path: Path, data: Any, key: str, what: str) -> list[dict[str, Any]]:
    """``data[key]``, checked to be a list of objects."""
    if not isinstance(data, dict) or not isinstance(data.get(key), list):
        raise DataError(f"{path}: not a {what} (no {key!r} list at the top level)")
    for index, entry in enumerate(data[key]):
        if not isinstance(entry, dict):
            raise DataError(f"{path}: {key}[{index}] is {_kind(entry)}, not an object")
    return data[key]


def field_of(path: Path, entry: dict[str, Any], where: str, name: str, kind: type) -> Any:
    """``entry[name]``, checked to be of ``kind`` (an int is never a bool)."""
    value = entry.get(name)
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        got = "nothing" if name not in entry else _kind(value)
        raise DataError(
            f"{path}: {where} needs {name!r} as {_KIND_NAMES[kind]}, got {got}; "
            f"fix or remove the entry"
        )
    return value


def image_path(path: Path, image_dir: str | Path, file_name: str, where: str) -> str:
    """``image_dir / file_name``, refusing names that are empty, absolute, hold a NUL byte or
    climb out of ``image_dir``: an annotation file decides which file is read only inside the
    image folder."""
    normal = os.path.normpath(file_name) if file_name and "\x00" not in file_name else ""
    if not normal or os.path.isabs(normal) or normal == ".." or normal.startswith("../"):
        raise DataError(
            f"{path}: {where} has file name {_short(file_name)!r}, which is not a path inside "
            f"the image folder {image_dir}; use a relative path below it"
        )
    return str(Path(image_dir) / normal)


def read_instances(path: str | Path) -> dict[int, tuple[ObjectAnnotation, ...]]:
    """Objects per image id from a COCO instances file (extra fields become attributes)."""
    path = Path(path)
    return _objects(path, load_json(path, "instances file"))


# An image of an instances file: its size (width, height) and its objects.
InstanceImage = tuple[tuple[int, int], tuple[ObjectAnnotation, ...]]


def read_instance_images(path: str | Path) -> dict[str, InstanceImage]:
    """Per image file name (its last part) in a COCO instances file: the image's size
    (width, height) as the file declares it, and its objects (crowd regions left out).

    Raises:
        DataError: the file is missing, not JSON, or an entry is malformed (the message
            names the entry).
    """
    path = Path(path)
    data = load_json(path, "instances file")
    objects = _objects(path, data)
    found = {}
    for index, image in enumerate(entries(path, data, "images", "COCO instances file")):
        where = f"images[{index}]"
        image_id = field_of(path, image, where, "id", int)
        name = Path(field_of(path, image, where, "file_name", str)).name
        size = (
            field_of(path, image, where, "width", int),
            field_of(path, image, where, "height", int),
        )
        found[name] = (size, objects.get(image_id, ()))
    return found


def _objects(path: Path, data: Any) -> dict[int, tuple[ObjectAnnotation, ...]]:
    """Objects per image id of a parsed instances file ``data`` read from ``path``."""
    what = "COCO instances file"
    names = {}
    categories = entries(path, data, "categories", what) if "categories" in data else []
    for index, category in enumerate(categories):
        where = f"categories[{index}]"
        names[field_of(path, category, where, "id", int)] = str(
            field_of(path, category, where, "name", str)
        )
    standard = {"id", "image_id", "category_id", "bbox", "area", "iscrowd", "segmentation"}
    objects: dict[int, list[ObjectAnnotation]] = defaultdict(list)
    annotations = entries(path, data, "annotations", what)
    for index, ann in sorted(enumerate(annotations), key=lambda item: _sort_key(item[1])):
        if ann.get("iscrowd", 0):
            continue
        where = f"annotations[{index}]"
        box = field_of(path, ann, where, "bbox", list)
        if len(box) != 4 or not all(_is_number(v) for v in box):
            raise DataError(
                f"{path}: {where} needs 'bbox' as 4 numbers [x, y, w, h], got "
                f"{_short(box)}; fix or remove the entry"
            )
        category = field_of(path, ann, where, "category_id", int)
        attributes = {k: str(v) for k, v in ann.items() if k not in standard}
        objects[field_of(path, ann, where, "image_id", int)].append(
            ObjectAnnotation(
                id=int(field_of(path, ann, where, "id", int)),
                bbox=tuple(float(v) for v in box),
                category=names.get(category, str(category)),
                attributes=attributes,
            )
        )
    return {image_id: tuple(objs) for image_id, objs in objects.items()}


def read_coco(
    captions_file: str | Path,
    image_dir: str | Path,
    split: str,
    instances_file: str | Path | None = None,
) -> list[ImageRecord]:
    """Records of every captioned image in a COCO captions file, sorted by image id.

    Args:
        captions_file: ``captions_train2014.json``, ``captions_val2017.json``, or shapes'
            ``captions_train.json``.
        image_dir: folder that holds the images' ``file_name`` (which must stay inside it).
        split: the split name to give the records.
        instances_file: optional instances file; its boxes become ``ImageRecord.objects``.

    Raises:
        DataError: the file is missing, not JSON, or an entry is malformed (the message
            names the entry).
    """
    path = Path(captions_file)
    data = load_json(path, "captions file")
    what = "COCO captions file"
    images: dict[int, dict[str, Any]] = {}
    duplicates = 0
    for index, image in enumerate(entries(path, data, "images", what)):
        where = f"images[{index}]"
        image_id = field_of(path, image, where, "id", int)
        file_name = field_of(path, image, where, "file_name", str)
        if image_id in images:
            duplicates += 1
            continue
        images[image_id] = {
            "path": image_path(path, image_dir, file_name, where),
            "width": image.get("width") if _is_number(image.get("width")) else None,
            "height": image.get("height") if _is_number(image.get("height")) else None,
        }
    captions: dict[int, list[str]] = defaultdict(list)
    orphans = empty = 0
    for index, ann in enumerate(entries(path, data, "annotations", what)):
        where = f"annotations[{index}]"
        image_id = field_of(path, ann, where, "image_id", int)
        caption = field_of(path, ann, where, "caption", str).strip()
        if image_id not in images:
            orphans += 1
        elif not caption:
            empty += 1
        else:
            captions[image_id].append(caption)
    uncaptioned = sum(1 for image_id in images if not captions.get(image_id))
    dropped = [
        f"{orphans} captions of image ids not in 'images'" if orphans else "",
        f"{empty} empty captions" if empty else "",
        f"{uncaptioned} images without captions" if uncaptioned else "",
        f"{duplicates} repeated image ids (the first entry kept)" if duplicates else "",
    ]
    if any(dropped):
        logger.warning("%s: dropped %s", path, ", ".join(d for d in dropped if d))
    objects = read_instances(instances_file) if instances_file is not None else {}
    return [
        ImageRecord(
            image_id=image_id,
            path=images[image_id]["path"],
            split=split,
            captions=tuple(captions[image_id]),
            width=images[image_id]["width"],
            height=images[image_id]["height"],
            objects=objects.get(image_id, ()),
        )
        for image_id in sorted(images)
        if captions.get(image_id)
    ]


_KIND_NAMES = {int: "an integer", str: "a string", list: "a list"}


def _kind(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    for kind, name in (
        (int, "an integer"),
        (float, "a number"),
        (str, "a string"),
        (list, "a list"),
        (dict, "an object"),
    ):
        if isinstance(value, kind):
            return f"{name} ({_short(value)})" if kind in (int, float, str) else name
    return type(value).__name__


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _sort_key(ann: dict[str, Any]) -> tuple[int, Any]:
    value = ann.get("id")
    return (0, value) if _is_number(value) else (1, 0)


def _short(value: Any, limit: int = 80) -> str:
    """``value`` as text on one line, cut to ``limit`` characters (a message may quote
    anything a file holds)."""
    text = " ".join(str(value).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."
