import json
import re

import pytest

from captioning.config import load_config
from captioning.data.build import load_splits, subsample
from captioning.data.coco import read_coco
from captioning.data.karpathy import read_karpathy
from captioning.data.records import ImageRecord
from captioning.errors import DataError

from .conftest import make_coco, write_json

COCO2014 = [
    "data.captions=annotations/captions_{split}.json",
    "data.instances=annotations/instances_{split}.json",
    "data.images={split}",
    "data.splits={train: train2014, val: val2014}",
]


def test_coco_reader_reads_captions_sizes_and_objects(coco2014):
    records = read_coco(
        coco2014 / "annotations/captions_train2014.json",
        coco2014 / "train2014",
        "train",
        coco2014 / "annotations/instances_train2014.json",
    )
    assert [r.image_id for r in records] == [1, 2, 3, 4]
    first = records[0]
    assert first.split == "train" and first.width == 40 and first.height == 30
    assert first.captions == ("Image 1 caption 0.", "Image 1 caption 1.")
    assert first.path.endswith("train2014/train2014_000000000001.jpg")
    assert [o.category for o in records[1].objects] == ["cat", "car"]
    assert records[1].objects[0].bbox == (1.0, 2.0, 10.0, 8.0)


def test_coco_2014_and_2017_layouts_through_config(tmp_path, coco2014, caplog):
    cfg = load_config(None, [f"data.root={coco2014}", *COCO2014])
    splits = load_splits(cfg.data)
    assert {k: len(v) for k, v in splits.items()} == {"train": 4, "val": 2}
    assert "split train: 4 images" in caplog.text

    root = tmp_path / "coco2017"
    make_coco(root, "train2017", [1, 2, 3], "train2017")
    make_coco(root, "val2017", [5], "val2017")
    overrides = [o.replace("2014", "2017") for o in COCO2014]
    splits = load_splits(load_config(None, [f"data.root={root}", *overrides]).data)
    assert [r.image_id for r in splits["train"]] == [1, 2, 3]
    assert splits["val"][0].path.endswith("val2017/val2017_000000000005.jpg")


def test_missing_root_and_files_say_what_to_do(tmp_path, coco2014):
    cfg = load_config(None, [f"data.root={tmp_path / 'absent'}"])
    with pytest.raises(DataError, match="captioning shapes --out"):
        load_splits(cfg.data)
    cfg = load_config(None, [f"data.root={coco2014}"])  # default shapes patterns
    with pytest.raises(DataError, match="captions file for split 'train' not found"):
        load_splits(cfg.data)
    (coco2014 / "annotations/captions_train2014.json").write_text("{not json")
    cfg = load_config(None, [f"data.root={coco2014}", *COCO2014])
    with pytest.raises(DataError, match="not valid JSON"):
        load_splits(cfg.data)


def _karpathy(tmp_path):
    images = [
        {
            "filepath": "val2014",
            "filename": "a.jpg",
            "split": "test",
            "cocoid": 5,
            "sentences": [{"raw": "A dog.", "tokens": ["a", "dog"]}],
        },
        {
            "filepath": "train2014",
            "filename": "b.jpg",
            "split": "train",
            "cocoid": 1,
            "sentences": [{"raw": "A cat.", "tokens": ["a", "cat"]}, {"tokens": ["a", "car"]}],
        },
        {
            "filepath": "val2014",
            "filename": "c.jpg",
            "split": "restval",
            "cocoid": 6,
            "sentences": [{"raw": "A car.", "tokens": ["a", "car"]}],
        },
        {
            "filepath": "val2014",
            "filename": "d.jpg",
            "split": "val",
            "cocoid": 2,
            "sentences": [{"raw": "Two cats.", "tokens": ["two", "cats"]}],
        },
    ]
    return write_json(tmp_path / "dataset_coco.json", {"images": images, "dataset": "coco"})


def test_karpathy_reader_and_restval(tmp_path):
    path = _karpathy(tmp_path)
    splits = read_karpathy(path, tmp_path / "images")
    assert [r.image_id for r in splits["train"]] == [1, 6]  # restval folded into train
    assert splits["train"][0].captions == ("A cat.", "a car")
    assert splits["train"][0].path == str(tmp_path / "images/train2014/b.jpg")
    assert [r.image_id for r in splits["test"]] == [5]
    assert [r.image_id for r in splits["val"]] == [2]
    without = read_karpathy(path, tmp_path / "images", restval=False)
    assert [r.image_id for r in without["train"]] == [1]


def test_karpathy_flickr_layout_has_no_filepath(tmp_path):
    images = [
        {
            "filename": "1000.jpg",
            "split": "train",
            "imgid": 0,
            "sentences": [{"raw": "A child in a pink dress ."}],
        }
    ]
    path = write_json(tmp_path / "dataset_flickr8k.json", {"images": images})
    splits = read_karpathy(path, tmp_path / "Flicker8k_Dataset")
    assert splits["train"][0].path == str(tmp_path / "Flicker8k_Dataset/1000.jpg")
    assert splits["train"][0].image_id == 0


def test_karpathy_through_config_with_categories(tmp_path, coco2014):
    _karpathy(coco2014)
    cfg = load_config(
        None,
        [
            f"data.root={coco2014}",
            "data.format=karpathy",
            "data.images=",
            "data.splits={train: train2014, val: val2014, test: val2014}",
            "data.categories=[car]",
        ],
    )
    splits = load_splits(cfg.data)
    assert [r.image_id for r in splits["train"]] == [6]  # image 1 is a dog, 6 has a car
    assert [r.image_id for r in splits["val"]] == [2]
    assert splits["test"] == []  # image 5: dog and cat


def _karpathy_image(**changes):
    image = {
        "split": "train",
        "cocoid": 1,
        "filepath": "f",
        "filename": "a.jpg",
        "sentences": [{"raw": "A dog."}],
    }
    image.update(changes)
    return {k: v for k, v in image.items() if v is not _ABSENT}


_ABSENT = object()


@pytest.mark.parametrize(
    "image, message",
    [
        (_karpathy_image(filename=_ABSENT), "images[0] needs 'filename' as a string, got nothing"),
        (
            _karpathy_image(sentences=[{"raw": None}]),
            "images[0].sentences[0] has neither a 'raw' string nor a 'tokens' list",
        ),
        (_karpathy_image(sentences=[{}]), "images[0].sentences[0] has neither a 'raw'"),
        (_karpathy_image(sentences=["A dog."]), "images[0].sentences[0] is not an object"),
        (_karpathy_image(cocoid="7"), "images[0] needs 'cocoid' as an integer, got a string (7)"),
        (_karpathy_image(split="dev"), "images[0] has unknown split 'dev'"),
        (_karpathy_image(filepath="../.."), "is not a path inside the image folder"),
        (_karpathy_image(filename="/etc/passwd"), "is not a path inside the image folder"),
        (_karpathy_image(filename="a\x00.jpg"), "is not a path inside the image folder"),
    ],
)
def test_malformed_karpathy_entries_are_named(tmp_path, image, message):
    path = write_json(tmp_path / "k.json", {"images": [image]})
    with pytest.raises(DataError, match=re.escape(message)) as caught:
        read_karpathy(path, tmp_path)
    assert "\n" not in str(caught.value) and str(caught.value).startswith(str(path))


def test_karpathy_sentence_tokens_stand_in_for_raw(tmp_path):
    image = _karpathy_image(sentences=[{"tokens": ["a", "dog"]}, {"raw": "  "}])
    splits = read_karpathy(write_json(tmp_path / "k.json", {"images": [image]}), tmp_path)
    assert splits["train"][0].captions == ("a dog",)
    assert splits["train"][0].path == str(tmp_path / "f" / "a.jpg")


def test_malformed_karpathy_files(tmp_path):
    for data in ({"nothing": []}, [1, 2], {"images": 3}):
        path = write_json(tmp_path / "k.json", data)
        with pytest.raises(DataError, match="not a Karpathy split file"):
            read_karpathy(path, tmp_path)
    path = write_json(tmp_path / "k.json", {"images": [5]})
    with pytest.raises(DataError, match=r"images\[0\] is an integer \(5\), not an object"):
        read_karpathy(path, tmp_path)


def _coco(tmp_path, images=None, annotations=None):
    images = (
        [{"id": 1, "file_name": "a.jpg"}, {"id": 2, "file_name": "sub/b.jpg"}]
        if (images is None)
        else images
    )
    if annotations is None:
        annotations = [
            {"id": 1, "image_id": 1, "caption": "A dog."},
            {"id": 2, "image_id": 2, "caption": "A cat."},
        ]
    return write_json(tmp_path / "c.json", {"images": images, "annotations": annotations})


@pytest.mark.parametrize(
    "images, annotations, message",
    [
        ([{"id": 1}], [], "images[0] needs 'file_name' as a string, got nothing"),
        (
            [{"id": 1, "file_name": 5}],
            [],
            "images[0] needs 'file_name' as a string, got an integer (5)",
        ),
        (
            [{"id": "x", "file_name": "a.jpg"}],
            [],
            "images[0] needs 'id' as an integer, got a string (x)",
        ),
        (
            [{"id": 1, "file_name": "a.jpg"}, {"id": "2", "file_name": "b.jpg"}],
            [],
            "images[1] needs 'id' as an integer",
        ),
        ([{"id": True, "file_name": "a.jpg"}], [], "got a boolean"),
        (
            [{"id": 1, "file_name": "../../../outside/x.png"}],
            [],
            "images[0] has file name '../../../outside/x.png', which is not a path inside",
        ),
        ([{"id": 1, "file_name": "/abs/x.png"}], [], "not a path inside the image folder"),
        ([{"id": 1, "file_name": "a\x00.png"}], [], "not a path inside the image folder"),
        ([{"id": 1, "file_name": ""}], [], "not a path inside the image folder"),
        (None, [{"image_id": 1}], "annotations[0] needs 'caption' as a string, got nothing"),
        (None, [{"image_id": 1, "caption": None}], "needs 'caption' as a string, got null"),
        (None, [{"image_id": 1, "caption": 7}], "got an integer (7)"),
        (None, [{"caption": "A dog."}], "annotations[0] needs 'image_id' as an integer"),
        (None, ["A dog."], "annotations[0] is a string (A dog.), not an object"),
    ],
)
def test_malformed_coco_entries_are_named(tmp_path, images, annotations, message):
    path = _coco(tmp_path, images, annotations)
    with pytest.raises(DataError, match=re.escape(message)) as caught:
        read_coco(path, tmp_path / "images", "train")
    assert "\n" not in str(caught.value) and str(caught.value).startswith(str(path))


def test_malformed_coco_files(tmp_path):
    for data in ({"images": []}, [], {"images": {}, "annotations": []}):
        path = write_json(tmp_path / "c.json", data)
        with pytest.raises(DataError, match="not a COCO captions file"):
            read_coco(path, tmp_path, "train")
    path = tmp_path / "deep.json"
    path.write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(DataError, match="nested too deeply"):
        read_coco(path, tmp_path, "train")
    path = tmp_path / "utf16.json"  # JSON may come in UTF-16
    path.write_text(
        json.dumps(
            {
                "images": [{"id": 1, "file_name": "é.jpg"}],
                "annotations": [{"image_id": 1, "caption": "Été."}],
            }
        ),
        encoding="utf-16",
    )
    assert read_coco(path, tmp_path, "train")[0].captions == ("Été.",)
    path.write_bytes(b"\xff\xfe\x00garbage")
    with pytest.raises(DataError, match="not valid JSON"):
        read_coco(path, tmp_path, "train")


def test_unusable_coco_entries_are_dropped_and_counted(tmp_path, caplog):
    images = [
        {"id": 1, "file_name": "a.jpg"},
        {"id": 2, "file_name": "b.jpg"},
        {"id": 2, "file_name": "c.jpg"},
        {"id": 3, "file_name": "d.jpg"},
    ]
    annotations = [
        {"image_id": 1, "caption": " A dog. "},
        {"image_id": 9, "caption": "Lost."},
        {"image_id": 2, "caption": "A cat."},
        {"image_id": 2, "caption": "  "},
    ]
    records = read_coco(_coco(tmp_path, images, annotations), tmp_path / "im", "train")
    assert [(r.image_id, r.captions) for r in records] == [(1, ("A dog.",)), (2, ("A cat.",))]
    assert records[1].path == str(tmp_path / "im" / "b.jpg")  # the first entry of id 2
    assert (
        "dropped 1 captions of image ids not in 'images', 1 empty captions, 1 images "
        "without captions, 1 repeated image ids (the first entry kept)"
    ) in caplog.text


def test_malformed_instances_are_named(tmp_path):
    from captioning.data.coco import read_instances

    base = {"categories": [{"id": 1, "name": "dog"}]}
    good = {"id": 1, "image_id": 1, "category_id": 1, "bbox": [0, 0, 2, 2]}
    assert read_instances(write_json(tmp_path / "i.json", {**base, "annotations": [good]}))
    nameless = read_instances(write_json(tmp_path / "i.json", {"annotations": [good]}))
    assert nameless[1][0].category == "1"  # no categories list: the id stands for the name
    for change, message in (
        ({"bbox": [0, 0, 2]}, "annotations[0] needs 'bbox' as 4 numbers"),
        ({"bbox": None}, "annotations[0] needs 'bbox' as a list, got null"),
        ({"category_id": "dog"}, "needs 'category_id' as an integer"),
    ):
        path = write_json(tmp_path / "i.json", {**base, "annotations": [{**good, **change}]})
        with pytest.raises(DataError, match=re.escape(message)):
            read_instances(path)


def test_category_subset_from_instances(coco2014, caplog):
    cfg = load_config(None, [f"data.root={coco2014}", *COCO2014, "data.categories=[dog, cat]"])
    splits = load_splits(cfg.data)
    assert [r.image_id for r in splits["train"]] == [1, 2]
    assert [r.image_id for r in splits["val"]] == [5]
    assert "split train: 2 images of 4" in caplog.text
    cfg = load_config(None, [f"data.root={coco2014}", *COCO2014, "data.categories=[dgo]"])
    with pytest.raises(DataError, match="did you mean 'dog'"):
        load_splits(cfg.data)


def test_max_images_is_seeded_stable_and_nested(coco2014):
    records = [ImageRecord(i, f"{i}.jpg", "train", ("c",)) for i in range(100)]
    small = subsample(records, 10, seed=0)
    assert small == subsample(records, 10, seed=0)
    assert [r.image_id for r in small] == sorted(r.image_id for r in small)
    assert set(r.image_id for r in small) <= set(r.image_id for r in subsample(records, 30, 0))
    assert small != subsample(records, 10, seed=1)
    assert subsample(records, 500, seed=0) == records

    cfg = load_config(None, [f"data.root={coco2014}", *COCO2014, "data.max_images={train: 2}"])
    splits = load_splits(cfg.data)
    assert len(splits["train"]) == 2 and len(splits["val"]) == 2
    cfg = load_config(None, [f"data.root={coco2014}", *COCO2014, "data.max_images=1"])
    splits = load_splits(cfg.data)
    assert len(splits["train"]) == 1 and len(splits["val"]) == 1
