"""COCO-format readers: captions json (2014 and 2017 layouts) and instances json.

Shapes is written in exactly this format, so it is read here with no special case.
"""

from __future__ import annotations

import contextlib
import io
import json
from collections import defaultdict
from pathlib import Path

from pycocotools.coco import COCO

from captioning.data.records import ImageRecord, ObjectAnnotation
from captioning.errors import DataError


def load_coco_json(path: str | Path) -> COCO:
    """A pycocotools ``COCO`` index of ``path``, with one-line errors and no chatter."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"{path}: annotation file not found")
    try:
        with contextlib.redirect_stdout(io.StringIO()):  # pycocotools prints progress
            return COCO(str(path))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise DataError(f"{path}: not valid JSON ({exc})") from exc
    except (KeyError, TypeError, AssertionError) as exc:
        raise DataError(f"{path}: not a COCO annotation file (missing {exc})") from exc


def read_instances(path: str | Path) -> dict[int, tuple[ObjectAnnotation, ...]]:
    """Objects per image id from a COCO instances file (extra fields become attributes)."""
    coco = load_coco_json(path)
    names = {c["id"]: c["name"] for c in coco.loadCats(coco.getCatIds())}
    standard = {"id", "image_id", "category_id", "bbox", "area", "iscrowd", "segmentation"}
    objects: dict[int, list[ObjectAnnotation]] = defaultdict(list)
    for ann in sorted(coco.anns.values(), key=lambda a: a["id"]):
        if ann.get("iscrowd", 0):
            continue
        attributes = {k: str(v) for k, v in ann.items() if k not in standard}
        objects[ann["image_id"]].append(
            ObjectAnnotation(
                id=int(ann["id"]),
                bbox=tuple(float(v) for v in ann["bbox"]),
                category=names.get(ann["category_id"], str(ann["category_id"])),
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
        image_dir: folder that holds the images' ``file_name``.
        split: the split name to give the records.
        instances_file: optional instances file; its boxes become ``ImageRecord.objects``.
    """
    coco = load_coco_json(captions_file)
    objects = read_instances(instances_file) if instances_file is not None else {}
    records = []
    for image_id in sorted(coco.imgs):
        image = coco.imgs[image_id]
        captions = [a["caption"] for a in coco.imgToAnns.get(image_id, [])]
        if not captions:
            continue
        records.append(
            ImageRecord(
                image_id=int(image_id),
                path=str(Path(image_dir) / image["file_name"]),
                split=split,
                captions=tuple(c.strip() for c in captions),
                width=image.get("width"),
                height=image.get("height"),
                objects=objects.get(image_id, ()),
            )
        )
    return records
