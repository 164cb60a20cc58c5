"""Dataset, collate and batch sampler.

All randomness of an epoch (image order, which reference caption each image gets, length
buckets) lives in :class:`CaptionBatchSampler` and is a pure function of (seed, epoch): a
resumed run and a run with DataLoader workers see exactly the same batches.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Protocol

import torch
from PIL import Image
from torch.utils.data import Dataset, Sampler

from captioning.data.images import DEFAULT_LIMITS, ImageLimits, load_image
from captioning.data.records import ImageRecord
from captioning.data.vocab import Vocabulary
from captioning.errors import DataError

logger = logging.getLogger("captioning")

Transform = Callable[[Image.Image], torch.Tensor]


class GridSource(Protocol):
    """Cached backbone grids by image id (what :class:`captioning.data.feature_cache.FeatureCache`
    provides)."""

    def check(self, records: list[ImageRecord]) -> None: ...

    def grid(self, image_id: int) -> torch.Tensor: ...


class CaptionDataset(Dataset):
    """Images with their encoded reference captions.

    An item is asked for by ``index`` (image only, for decoding) or ``(index, caption)``
    (image and that reference caption, for training).

    Args:
        records: the images of one split.
        vocab: the vocabulary that encodes the captions.
        transform: turns a PIL image into the encoder's input tensor.
        max_length: captions longer than this many words are cut (the ``<end>`` is kept).
        skip_bad_images: an image that fails to load yields ``None`` (dropped by
            :func:`collate`, with a warning) instead of raising.
        cache_images: keep each transformed image in memory after its first load
            (for small datasets such as shapes; one copy per DataLoader worker).
        feature_cache: cached backbone grids (a
            :class:`captioning.data.feature_cache.FeatureCache`); items then carry ``grid`` (L, D)
            instead of ``image`` and no image is opened.
    """

    def __init__(
        self,
        records: Sequence[ImageRecord],
        vocab: Vocabulary,
        transform: Transform,
        max_length: int | None = None,
        skip_bad_images: bool = False,
        cache_images: bool = False,
        feature_cache: GridSource | None = None,
        limits: ImageLimits = DEFAULT_LIMITS,
    ) -> None:
        self.records = list(records)
        self.limits = limits
        self.feature_cache = feature_cache
        if feature_cache is not None:
            feature_cache.check(self.records)
        self.vocab = vocab
        self.transform = transform
        self.skip_bad_images = skip_bad_images
        self.captions: list[list[list[int]]] = []
        cut = 0
        for record in self.records:
            encoded = []
            for caption in record.captions:
                ids = vocab.encode(caption)
                if max_length is not None and len(ids) > max_length + 2:
                    ids = ids[: max_length + 1] + [vocab.end_id]
                    cut += 1
                encoded.append(ids)
            self.captions.append(encoded)
        if cut:
            total = sum(len(c) for c in self.captions)
            logger.warning(
                "cut %d of %d captions to data.max_caption_length=%d words", cut, total, max_length
            )
        self._cache: dict[int, torch.Tensor] | None = {} if cache_images else None

    def __len__(self) -> int:
        return len(self.records)

    def caption_lengths(self) -> list[list[int]]:
        """Token counts (specials included) of every reference caption, per image."""
        return [[len(ids) for ids in captions] for captions in self.captions]

    def image(self, index: int) -> torch.Tensor:
        """The transformed image at ``index``."""
        if self._cache is not None and index in self._cache:
            return self._cache[index]
        tensor = self.transform(load_image(self.records[index].path, self.limits))
        if self._cache is not None:
            self._cache[index] = tensor
        return tensor

    def __getitem__(self, item: int | tuple[int, int]) -> dict[str, Any] | None:
        index, caption = item if isinstance(item, tuple) else (item, None)
        tokens = None if caption is None else torch.tensor(self.captions[index][caption])
        if self.feature_cache is not None:
            grid = self.feature_cache.grid(self.records[index].image_id)  # (L, D)
            return {"grid": grid, "tokens": tokens, "index": index}
        try:
            image = self.image(index)
        except DataError as exc:
            if not self.skip_bad_images:
                raise
            logger.warning("skipping image: %s", exc)
            return None
        return {"image": image, "tokens": tokens, "index": index}


def collate(samples: Sequence[dict[str, Any] | None]) -> dict[str, torch.Tensor] | None:
    """Stack images (or cached grids) and right-pad captions with ``<pad>`` (id 0).

    Returns ``images (B, 3, H, W)`` (or ``grid (B, L, D)``), ``indices (B,)`` and, for
    training items,
    ``tokens (B, T)`` and ``lengths (B,)`` (tokens per caption, ``<start>``/``<end>``
    included). Items that failed to load (``None``) are dropped; an empty batch is ``None``.
    """
    samples = [s for s in samples if s is not None]
    if not samples:
        return None
    batch = {"indices": torch.tensor([s["index"] for s in samples])}  # (B,)
    if "grid" in samples[0]:
        batch["grid"] = torch.stack([s["grid"] for s in samples])  # (B, L, D)
    else:
        batch["images"] = torch.stack([s["image"] for s in samples])  # (B, 3, H, W)
    if samples[0]["tokens"] is not None:
        lengths = torch.tensor([len(s["tokens"]) for s in samples])
        tokens = torch.full((len(samples), int(lengths.max())), Vocabulary.pad_id)
        for row, sample in enumerate(samples):
            tokens[row, : len(sample["tokens"])] = sample["tokens"]
        batch["tokens"] = tokens  # (B, T)
        batch["lengths"] = lengths  # (B,)
    return batch


class CaptionBatchSampler(Sampler[list[tuple[int, int]]]):
    """Batches of ``(image index, caption index)`` for training.

    Each epoch every image appears once, with one of its reference captions drawn at random.
    With ``bucket`` the batches group captions of similar length (less padding), and the
    order of the batches is still random. With several replicas (DDP) the global batch of
    ``batch_size * num_replicas`` items is cut into one slice per replica, so N processes
    with batch B see the same items per step as one process with batch N * B.

    Args:
        caption_lengths: per image, the length of each reference caption.
        batch_size: items per batch and replica.
        seed: with the epoch (see :meth:`set_epoch`), fixes everything random.
        shuffle: randomise the image order.
        bucket: group similar lengths (within windows of 50 batches).
        drop_last: drop the last, smaller global batch.
        num_replicas, rank: the DDP world size and this process's rank.
    """

    def __init__(
        self,
        caption_lengths: Sequence[Sequence[int]],
        batch_size: int,
        seed: int = 0,
        shuffle: bool = True,
        bucket: bool = False,
        drop_last: bool = False,
        num_replicas: int = 1,
        rank: int = 0,
    ) -> None:
        if any(len(lengths) == 0 for lengths in caption_lengths):
            raise DataError("every image needs at least one caption")
        self.caption_lengths = [list(lengths) for lengths in caption_lengths]
        self.batch_size = batch_size
        self.seed = seed
        self.shuffle = shuffle
        self.bucket = bucket
        self.drop_last = drop_last
        self.num_replicas = num_replicas
        self.rank = rank
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def _global_batches(self) -> list[list[tuple[int, int]]]:
        rng = random.Random(self.seed * 1_000_003 + self.epoch)
        order = list(range(len(self.caption_lengths)))
        if self.shuffle:
            rng.shuffle(order)
        items = [(i, rng.randrange(len(self.caption_lengths[i]))) for i in order]
        size = self.batch_size * self.num_replicas
        if self.bucket:
            window = size * 50
            bucketed = []
            for start in range(0, len(items), window):
                chunk = items[start : start + window]
                bucketed += sorted(chunk, key=lambda it: self.caption_lengths[it[0]][it[1]])
            items = bucketed
        batches = [items[i : i + size] for i in range(0, len(items), size)]
        if self.drop_last and batches and len(batches[-1]) < size:
            batches.pop()
        short = -len(batches[-1]) % self.num_replicas if batches else 0
        if short:
            # Every replica must take the same number of steps (DDP synchronises on each);
            # like DistributedSampler, repeat a few items to split the last batch evenly.
            batches[-1] = batches[-1] + items[:short]
        if self.bucket and self.shuffle:
            rng.shuffle(batches)
        return batches

    def __iter__(self) -> Iterator[list[tuple[int, int]]]:
        for batch in self._global_batches():
            # Contiguous slices keep the union over ranks equal to the one-process batch.
            per_rank = len(batch) // self.num_replicas
            yield batch[self.rank * per_rank : (self.rank + 1) * per_rank]

    def __len__(self) -> int:
        n, size = len(self.caption_lengths), self.batch_size * self.num_replicas
        return n // size if self.drop_last else -(-n // size)
