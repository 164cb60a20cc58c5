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
        {"filepath": "val2014", "filename": "a.jpg", "split": "test", "cocoid": 5,
         "sentences": [{"raw": "A dog.", "tokens": ["a", "dog"]}]},
        {"filepath": "train2014", "filename": "b.jpg", "split": "train", "cocoid": 1,
         "sentences": [{"raw": "A cat.", "tokens": ["a", "cat"]}, {"tokens": ["a", "car"]}]},
        {"filepath": "val2014", "filename": "c.jpg", "split": "restval", "cocoid": 6,
         "sentences": [{"raw": "A car.", "tokens": ["a", "car"]}]},
        {"filepath": "val2014", "filename": "d.jpg", "split": "val", "cocoid": 2,
         "sentences": [{"raw": "Two cats.", "tokens": ["two", "cats"]}]},
    ]  # fmt: skip
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
    images = [{"filename": "1000.jpg", "split": "train", "imgid": 0,
               "sentences": [{"raw": "A child in a pink dress ."}]}]  # fmt: skip
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


def test_malformed_karpathy(tmp_path):
    path = write_json(tmp_path / "k.json", {"images": [{"split": "train"}]})
    with pytest.raises(DataError, match="entry 0 is malformed"):
        read_karpathy(path, tmp_path)
    path = write_json(tmp_path / "k2.json", {"nothing": []})
    with pytest.raises(DataError, match="not a Karpathy split file"):
        read_karpathy(path, tmp_path)


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
