"""The synthetic shapes dataset: COCO format, determinism, caption grounding and geometry."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from pycocotools.coco import COCO

from captioning.data.shapes import COLORS, SHAPES, SIZES, describe_objects, generate_shapes
from captioning.data.vocab import tokenize
from captioning.errors import DataError

SPLITS = ("train", "val", "test")
COUNT_WORDS = {1: "one", 2: "two", 3: "three"}


@pytest.fixture(scope="module")
def canonical(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("shapes_canonical")
    generate_shapes(root, num_train=40, num_val=8, num_test=8, seed=3)
    return root


@pytest.fixture(scope="module")
def varied(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("shapes_varied")
    generate_shapes(root, num_train=40, num_val=8, num_test=8, seed=3, captions="varied")
    return root


def load(root: Path, kind: str, split: str) -> dict:
    return json.loads((root / "annotations" / f"{kind}_{split}.json").read_text())


def objects_by_image(root: Path, split: str) -> dict[int, list[dict]]:
    """Instance annotations per image id, each with its category name added as ``shape``."""
    instances = load(root, "instances", split)
    names = {c["id"]: c["name"] for c in instances["categories"]}
    objects: dict[int, list[dict]] = {image["id"]: [] for image in instances["images"]}
    for ann in instances["annotations"]:
        objects[ann["image_id"]].append({**ann, "shape": names[ann["category_id"]]})
    return objects


def captions_by_image(root: Path, split: str) -> dict[int, list[dict]]:
    """Caption annotations per image id, in caption id order."""
    captions: dict[int, list[dict]] = {}
    for ann in sorted(load(root, "captions", split)["annotations"], key=lambda a: a["id"]):
        captions.setdefault(ann["image_id"], []).append(ann)
    return captions


def centre(obj: dict) -> tuple[float, float]:
    x, y, w, h = obj["bbox"]
    return x + w / 2, y + h / 2


def all_files(root: Path) -> dict[str, bytes]:
    files = sorted(p for p in root.rglob("*") if p.is_file())
    return {str(p.relative_to(root)): p.read_bytes() for p in files}


# ---------------------------------------------------------------------------------------------


def test_same_seed_gives_byte_identical_files(tmp_path: Path) -> None:
    generate_shapes(tmp_path / "a", num_train=6, num_val=2, num_test=2, seed=5)
    generate_shapes(tmp_path / "b", num_train=6, num_val=2, num_test=2, seed=5)
    generate_shapes(tmp_path / "c", num_train=6, num_val=2, num_test=2, seed=6)
    a, b, c = (all_files(tmp_path / name) for name in "abc")
    assert len(a) == 10 + 6
    assert a == b
    assert a.keys() == c.keys()
    assert a["images/train/train_000000.png"] != c["images/train/train_000000.png"]
    assert a["annotations/instances_train.json"] != c["annotations/instances_train.json"]


def test_image_does_not_depend_on_split_size(tmp_path: Path) -> None:
    generate_shapes(tmp_path / "small", num_train=2, num_val=1, num_test=0, seed=1)
    generate_shapes(tmp_path / "large", num_train=5, num_val=3, num_test=0, seed=1)
    for name in ("images/train/train_000001.png", "images/val/val_000000.png"):
        assert (tmp_path / "small" / name).read_bytes() == (tmp_path / "large" / name).read_bytes()


def test_summary(tmp_path: Path) -> None:
    summary = generate_shapes(tmp_path, num_train=10, num_val=3, num_test=2, seed=2)
    assert summary["out_dir"] == str(tmp_path)
    assert summary["splits"] == {"train": 10, "val": 3, "test": 2}
    assert summary["captions_per_image"] == 5
    assert set(summary["objects_histogram"]) == {1, 2, 3}
    assert sum(summary["objects_histogram"].values()) == 15
    tokens = {
        token
        for split in SPLITS
        for ann in load(tmp_path, "captions", split)["annotations"]
        for token in ann["tokens"]
    }
    assert summary["vocabulary"] == sorted(tokens)


def test_coco_format(canonical: Path) -> None:
    image_ids, caption_ids, instance_ids = [], [], []
    for split in SPLITS:
        captions = COCO(str(canonical / "annotations" / f"captions_{split}.json"))
        instances = COCO(str(canonical / "annotations" / f"instances_{split}.json"))
        assert captions.dataset["images"] == instances.dataset["images"]
        assert sorted(c["name"] for c in instances.loadCats(instances.getCatIds())) == sorted(
            SHAPES
        )
        assert {c["supercategory"] for c in instances.dataset["categories"]} == {"shape"}
        for image_id in captions.getImgIds():
            assert len(captions.getAnnIds(imgIds=[image_id])) == 5
            assert 1 <= len(instances.getAnnIds(imgIds=[image_id])) <= 3
            info = captions.loadImgs([image_id])[0]
            assert info["file_name"].startswith(f"{split}_")
            path = canonical / "images" / split / info["file_name"]
            with Image.open(path) as image:
                assert image.mode == "RGB"
                assert image.size == (info["width"], info["height"]) == (96, 96)
        for ann in instances.dataset["annotations"]:
            assert ann["iscrowd"] == 0
            assert len(ann["bbox"]) == 4 and all(isinstance(v, float) for v in ann["bbox"])
            assert ann["area"] > 0
            assert len(ann["segmentation"]) == 1 and len(ann["segmentation"][0]) >= 6
            assert ann["color"] in COLORS and ann["size"] in SIZES
        image_ids += captions.getImgIds()
        caption_ids += captions.getAnnIds()
        instance_ids += instances.getAnnIds()
    for ids in (image_ids, caption_ids, instance_ids):
        assert len(ids) == len(set(ids))
    assert len(image_ids) == 56


def test_empty_split_and_image_size(tmp_path: Path) -> None:
    generate_shapes(tmp_path, num_train=3, num_val=0, num_test=1, image_size=64)
    assert not any((tmp_path / "images" / "val").glob("*.png"))
    for kind in ("captions", "instances"):
        empty = COCO(str(tmp_path / "annotations" / f"{kind}_val.json"))
        assert empty.getImgIds() == [] and empty.getAnnIds() == []
    with Image.open(tmp_path / "images" / "train" / "train_000002.png") as image:
        assert image.size == (64, 64)
    assert not (tmp_path / "images" / "train" / "train_000003.png").exists()


def test_png_has_no_metadata(canonical: Path) -> None:
    with Image.open(canonical / "images" / "val" / "val_000000.png") as image:
        assert image.info == {}


# ---------------------------------------------------------------------------------------------


def check_alignment(caption: dict, objects: list[dict]) -> None:
    """Tokens come from the shared tokenizer, and each grounded token names its object."""
    assert caption["tokens"] == tokenize(caption["caption"])
    assert len(caption["object_ids"]) == len(caption["tokens"])
    by_id = {obj["id"]: obj for obj in objects}
    for token, object_id in zip(caption["tokens"], caption["object_ids"]):
        if object_id is not None:
            obj = by_id[object_id]
            assert token in (obj["color"], obj["size"], obj["shape"]), caption


@pytest.mark.parametrize("split", SPLITS)
def test_canonical_captions_are_grounded(canonical: Path, split: str) -> None:
    objects = objects_by_image(canonical, split)
    for image_id, captions in captions_by_image(canonical, split).items():
        for caption in captions:
            check_alignment(caption, objects[image_id])
            named = set(zip(caption["tokens"], caption["object_ids"]))
            for obj in objects[image_id]:
                for word in (obj["color"], obj["size"], obj["shape"]):
                    assert (word, obj["id"]) in named, caption["caption"]
            # Every attribute word is grounded: no colour, size or shape word points nowhere.
            vocabulary = set(COLORS) | set(SIZES) | set(SHAPES)
            for token, object_id in zip(caption["tokens"], caption["object_ids"]):
                assert (token in vocabulary) == (object_id is not None)


def test_canonical_wordings_in_order(canonical: Path) -> None:
    objects = objects_by_image(canonical, "train")
    for image_id, captions in captions_by_image(canonical, "train").items():
        texts = [c["caption"] for c in captions]
        content = texts[0]
        n = len(objects[image_id])
        assert content == describe_objects(objects[image_id])
        assert texts == [
            content,
            f"there is {content}",
            f"{COUNT_WORDS[n]} {'shape' if n == 1 else 'shapes'} : {content}",
            f"from left to right : {content}",
            f"{content} on a dark background",
        ]
        if n == 3:
            assert " , " in content and " and " in content


def test_geometry_and_relations(canonical: Path) -> None:
    checked_two = 0
    for split in SPLITS:
        objects = objects_by_image(canonical, split)
        captions = captions_by_image(canonical, split)
        for image_id, objs in objects.items():
            for obj in objs:
                x, y, w, h = obj["bbox"]
                assert x >= 0 and y >= 0 and x + w <= 96 and y + h <= 96
                assert obj["size"] == ("small" if w <= 20 else "large")
            for i, a in enumerate(objs):
                for b in objs[i + 1 :]:
                    ax, ay, aw, ah = a["bbox"]
                    bx, by, bw, bh = b["bbox"]
                    gap = max(bx - (ax + aw), ax - (bx + bw), by - (ay + ah), ay - (by + bh))
                    assert gap >= 2
                    assert abs(centre(a)[0] - centre(b)[0]) >= 6

            # The canonical content names the objects left to right.
            first = captions[image_id][0]
            mentioned = list(dict.fromkeys(i for i in first["object_ids"] if i is not None))
            by_x = sorted(objs, key=lambda o: centre(o)[0])
            assert mentioned == [o["id"] for o in by_x]

            if len(objs) == 2:
                checked_two += 1
                left, right = by_x
                dx = centre(right)[0] - centre(left)[0]
                dy = centre(right)[1] - centre(left)[1]
                assert max(abs(dx), abs(dy)) >= 1.5 * min(abs(dx), abs(dy))
                if abs(dx) >= abs(dy):
                    relation = "to the left of"
                else:
                    relation = "above" if dy > 0 else "below"
                middle = f" {left['shape']} {relation} a {right['size']} "
                assert middle in first["caption"], first["caption"]
    assert checked_two > 0


def test_pixels_match_named_colours(canonical: Path) -> None:
    palette = np.array(list(COLORS.values()), dtype=float)
    names = list(COLORS)
    for split in SPLITS:
        images = {i["id"]: i for i in load(canonical, "instances", split)["images"]}
        for image_id, objs in objects_by_image(canonical, split).items():
            path = canonical / "images" / split / images[image_id]["file_name"]
            pixels = np.asarray(Image.open(path), dtype=float)
            for obj in objs:
                cx, cy = (round(v) for v in centre(obj))
                mean = pixels[cy - 2 : cy + 2, cx - 2 : cx + 2].reshape(-1, 3).mean(axis=0)
                nearest = names[int(np.argmin(np.linalg.norm(palette - mean, axis=1)))]
                assert nearest == obj["color"], (path, obj, mean)
                assert np.linalg.norm(mean - COLORS[obj["color"]]) < 60
            # Far from every object, the background is dark.
            assert np.median(pixels) < 60


# ---------------------------------------------------------------------------------------------


def test_varied_captions(varied: Path, canonical: Path) -> None:
    openers = set()
    for split in SPLITS:
        objects = objects_by_image(varied, split)
        captions = captions_by_image(varied, split)
        assert captions.keys() == objects.keys()
        for image_id, caps in captions.items():
            assert len(caps) == 5
            colours = {o["color"] for o in objects[image_id]}
            shapes = {o["shape"] for o in objects[image_id]}
            for caption in caps:
                check_alignment(caption, objects[image_id])
                for token, object_id in zip(caption["tokens"], caption["object_ids"]):
                    if token in COLORS:
                        assert token in colours and object_id is not None
                    if token in SHAPES:
                        assert token in shapes and object_id is not None
                openers.add(" ".join(caption["tokens"][:2]))
    assert len(openers) > 5  # the templates really vary
    # Both caption modes draw the same images.
    name = "images/train/train_000007.png"
    assert (varied / name).read_bytes() == (canonical / name).read_bytes()


def test_progress_bar(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Not a terminal: one log line per split, nothing drawn.
    generate_shapes(tmp_path / "log", num_train=2, num_val=1, num_test=1, progress=True)
    err = capsys.readouterr().err  # may hold the log lines, if a handler writes to stderr
    assert "\r" not in err and "%|" not in err
    assert [r.getMessage().split(" in ")[0] for r in caplog.records] == [
        "shapes train: 2 img",
        "shapes val: 1 img",
        "shapes test: 1 img",
    ]
    monkeypatch.setattr("captioning.progress.stderr_is_terminal", lambda: True)
    generate_shapes(tmp_path / "bar", num_train=2, num_val=1, num_test=1, progress=True)
    assert "shapes train: 100%|" in capsys.readouterr().err


def test_describe_objects() -> None:
    red = {"shape": "circle", "color": "red", "size": "large", "bbox": [10, 40, 30, 30]}
    blue = {"shape": "square", "color": "blue", "size": "small", "bbox": [60, 45, 16, 16]}
    high = {"shape": "triangle", "color": "green", "size": "small", "bbox": [12, 2, 16, 16]}
    assert describe_objects([blue, red]) == "a large red circle to the left of a small blue square"
    assert describe_objects([red, high]) == "a small green triangle above a large red circle"
    assert describe_objects([blue, high, red]) == (
        "a small green triangle , a large red circle and a small blue square"
    )
    with pytest.raises(DataError):
        describe_objects([])


@pytest.mark.parametrize(
    "kwargs",
    [
        {"num_train": -1},
        {"num_val": -2},
        {"num_test": -1},
        {"image_size": 47},
        {"captions": "fancy"},
        {"seed": -1},
    ],
)
def test_bad_arguments(tmp_path: Path, kwargs: dict) -> None:
    with pytest.raises(DataError) as error:
        generate_shapes(tmp_path, **{"num_train": 1, "num_val": 1, "num_test": 1, **kwargs})
    assert "\n" not in str(error.value)
    assert not (tmp_path / "images").exists()
