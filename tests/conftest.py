import json
import logging
from pathlib import Path

import pytest
from PIL import Image


def write_json(path: Path, data) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data))
    return path


CATEGORIES = [{"id": 1, "name": "dog"}, {"id": 2, "name": "cat"}, {"id": 3, "name": "car"}]
# image id -> categories of its objects
OBJECTS = {1: ["dog"], 2: ["cat", "car"], 3: ["car"], 4: [], 5: ["dog", "cat"], 6: ["car"]}


def make_coco(root: Path, split_name: str, image_ids, image_dir: str, with_files=True) -> None:
    """A tiny COCO captions + instances pair for ``split_name`` (e.g. train2014)."""
    images = [
        {"id": i, "file_name": f"{image_dir}_{i:012d}.jpg", "width": 40, "height": 30}
        for i in image_ids
    ]
    captions = [
        {"id": i * 10 + k, "image_id": i, "caption": f"Image {i} caption {k}."}
        for i in image_ids
        for k in range(2)
    ]
    cat_ids = {c["name"]: c["id"] for c in CATEGORIES}
    instances = [
        {
            "id": i * 100 + k,
            "image_id": i,
            "category_id": cat_ids[name],
            "bbox": [1.0, 2.0, 10.0, 8.0],
            "area": 80.0,
            "iscrowd": 0,
        }
        for i in image_ids
        for k, name in enumerate(OBJECTS[i])
    ]
    info = {"description": "test"}
    write_json(
        root / "annotations" / f"captions_{split_name}.json",
        {"info": info, "images": images, "annotations": captions, "licenses": []},
    )
    write_json(
        root / "annotations" / f"instances_{split_name}.json",
        {
            "info": info,
            "images": images,
            "annotations": instances,
            "categories": CATEGORIES,
            "licenses": [],
        },
    )
    if with_files:
        (root / image_dir).mkdir(parents=True, exist_ok=True)
        for image in images:
            Image.new("RGB", (40, 30), (i := image["id"] * 20, 0, 0)).save(
                root / image_dir / image["file_name"]
            )
            del i


@pytest.fixture
def coco2014(tmp_path) -> Path:
    root = tmp_path / "coco"
    make_coco(root, "train2014", [1, 2, 3, 4], "train2014")
    make_coco(root, "val2014", [5, 6], "val2014")
    return root


@pytest.fixture(autouse=True)
def _captioning_logs(caplog):
    caplog.set_level(logging.INFO, logger="captioning")
