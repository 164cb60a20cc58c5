import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from captioning.config import load_config
from captioning.data import (
    CaptionBatchSampler,
    CaptionDataset,
    collate,
    drop_bad_images,
    load_splits,
)
from captioning.data.vocab import Vocabulary
from captioning.errors import DataError

from .test_readers import COCO2014


def to_tensor(image):
    return torch.from_numpy(np.asarray(image).copy()).permute(2, 0, 1)  # (3, H, W) uint8


def _dataset(coco2014, **kwargs):
    cfg = load_config(None, [f"data.root={coco2014}", *COCO2014])
    splits = load_splits(cfg.data)
    vocab = Vocabulary.build(c for r in splits["train"] for c in r.captions)
    return CaptionDataset(splits["train"], vocab, to_tensor, **kwargs), splits


def test_items_and_collate(coco2014):
    dataset, _ = _dataset(coco2014)
    item = dataset[(1, 0)]
    assert item["image"].shape == (3, 30, 40) and item["index"] == 1
    assert dataset.vocab.decode(item["tokens"]) == "image 2 caption 0"
    assert dataset[2]["tokens"] is None  # decoding items carry no caption

    dataset.captions[0][1] = dataset.captions[0][1][:3] + [dataset.vocab.end_id]  # shorter
    batch = collate([dataset[(0, 1)], dataset[(1, 0)]])
    assert batch["images"].shape == (2, 3, 30, 40)
    assert batch["lengths"].tolist() == [4, 6]
    assert batch["tokens"].shape == (2, 6)
    assert batch["tokens"][0, 4:].tolist() == [Vocabulary.pad_id] * 2


def test_max_length_cuts_but_keeps_end(coco2014, caplog):
    dataset, _ = _dataset(coco2014, max_length=2)
    ids = dataset.captions[0][0]
    assert len(ids) == 4 and ids[-1] == dataset.vocab.end_id
    assert "cut 8 of 8 captions to data.max_caption_length=2 words" in caplog.text


def test_a_caption_of_ten_thousand_words_is_cut_by_default(coco2014, caplog):
    cfg = load_config(None, [f"data.root={coco2014}", *COCO2014])
    assert cfg.data.max_caption_length == 50
    splits = load_splits(cfg.data)
    record = splits["train"][0]
    splits["train"][0] = type(record)(**{**record.__dict__, "captions": ("dog " * 10_000,)})
    vocab = Vocabulary.build(c for r in splits["train"] for c in r.captions)
    dataset = CaptionDataset(
        splits["train"], vocab, to_tensor, max_length=cfg.data.max_caption_length
    )
    assert len(dataset.captions[0][0]) == 52  # <start>, 50 words, <end>
    assert "cut 1 of 7 captions to data.max_caption_length=50 words" in caplog.text


def test_sampler_is_a_function_of_seed_and_epoch():
    lengths = [[5, 9, 7]] * 10 + [[4]] * 7
    sampler = CaptionBatchSampler(lengths, batch_size=4, seed=3)
    sampler.set_epoch(0)
    first = list(sampler)
    assert list(sampler) == first
    assert sorted(i for batch in first for i, _ in batch) == list(range(17))
    assert len(first) == len(sampler) == 5
    sampler.set_epoch(1)
    assert list(sampler) != first
    other = CaptionBatchSampler(lengths, batch_size=4, seed=3)
    other.set_epoch(1)
    assert list(other) == list(sampler)
    captions_drawn = {c for batch in first for i, c in batch if i < 10}
    assert len(captions_drawn) > 1


def test_bucketing_reduces_padding():
    rng = np.random.default_rng(0)
    lengths = [[int(n)] for n in rng.integers(3, 40, size=400)]

    def padding(sampler):
        return sum(
            max(lengths[i][c] for i, c in b) * len(b) - sum(lengths[i][c] for i, c in b)
            for b in sampler
        )

    plain = CaptionBatchSampler(lengths, batch_size=16, seed=0)
    bucketed = CaptionBatchSampler(lengths, batch_size=16, seed=0, bucket=True)
    assert sorted(i for b in bucketed for i, _ in b) == list(range(400))
    assert padding(bucketed) < 0.2 * padding(plain)


def test_replicas_split_the_single_process_batches():
    lengths = [[3, 4]] * 21
    single = CaptionBatchSampler(lengths, batch_size=6, seed=1, drop_last=True)
    ranks = [
        CaptionBatchSampler(lengths, 3, seed=1, drop_last=True, num_replicas=2, rank=r)
        for r in range(2)
    ]
    for step, (a, b, c) in enumerate(zip(single, *ranks, strict=True)):
        assert a == b + c, step
    assert len(single) == len(ranks[0]) == 3


def test_replicas_take_equal_steps_on_a_ragged_last_batch():
    # 23 images, 3 replicas of batch 4: the last global batch holds 11 items, so one is
    # repeated; every replica must take as many steps, of equal size (DDP waits on each).
    lengths = [[5]] * 23
    ranks = [
        list(CaptionBatchSampler(lengths, 4, seed=2, num_replicas=3, rank=r)) for r in range(3)
    ]
    assert [len(r) for r in ranks] == [2, 2, 2]
    assert [len(batch) for r in ranks for batch in r] == [4] * 6
    seen = [i for r in ranks for batch in r for i, _ in batch]
    assert sorted(set(seen)) == list(range(23)) and len(seen) == 24


def test_loader_with_sampler_and_workers_matches(coco2014):
    dataset, _ = _dataset(coco2014)
    sampler = CaptionBatchSampler(dataset.caption_lengths(), batch_size=3, seed=0)
    plain = [b["tokens"] for b in DataLoader(dataset, batch_sampler=sampler, collate_fn=collate)]
    workers = DataLoader(dataset, batch_sampler=sampler, collate_fn=collate, num_workers=2)
    for a, b in zip(plain, (b["tokens"] for b in workers), strict=True):
        assert torch.equal(a, b)


def test_cache_returns_same_tensor(coco2014):
    dataset, _ = _dataset(coco2014, cache_images=True)
    assert dataset.image(0) is dataset.image(0)


def test_bad_images_error_or_skip(coco2014, caplog):
    dataset, splits = _dataset(coco2014)
    broken = splits["train"][2].path
    open(broken, "wb").close()  # zero bytes
    missing = splits["val"][0].path
    import os

    os.remove(missing)
    cfg = load_config(None, [f"data.root={coco2014}", *COCO2014])
    with pytest.raises(DataError, match="2 of 6 images cannot be read"):
        drop_bad_images({k: list(v) for k, v in splits.items()}, cfg.data)
    assert broken in caplog.text and missing in caplog.text

    cfg = load_config(None, [f"data.root={coco2014}", *COCO2014, "data.on_bad_image=skip"])
    kept = {k: list(v) for k, v in splits.items()}
    bad = drop_bad_images(kept, cfg.data)
    assert sorted(p for p, _ in bad) == sorted([broken, missing])
    assert len(kept["train"]) == 3 and len(kept["val"]) == 1
    assert "split train: skipped 1 unreadable images, 3 left" in caplog.text

    # an image that breaks after the check: skipped with a warning, never a crash
    with pytest.raises(DataError):
        dataset[(2, 0)]
    skipping, _ = _dataset(coco2014, skip_bad_images=True)
    assert skipping[(2, 0)] is None
    batch = collate([skipping[(1, 0)], skipping[(2, 0)]])
    assert batch["images"].shape[0] == 1
    assert collate([None]) is None
