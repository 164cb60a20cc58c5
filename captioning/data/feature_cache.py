"""Cached encoder grids for frozen encoders.

When the encoder does not train (``model.fine_tune: none``), its grid for an image never
changes, so training can read it from disk instead of running the CNN at every step.
``captioning extract-features --config C --split train`` writes, per split:

- ``{split}.npy``: float16 array (N, L, D) of backbone grids (position codes are added at
  training time, so learned positions still train), read back memory-mapped;
- ``{split}.json``: the image ids of the rows, the shape, and the encoder's fingerprint.

Both live in ``{data.root}/{data.feature_cache}/{encoder}-{size}px-{fingerprint}``. The
fingerprint hashes the backbone weights, buffers and input settings, so a cache made by a
different encoder is never read by mistake: training looks up its own encoder's folder.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader

from captioning.config import Config
from captioning.data import CaptionDataset, collate, drop_bad_images, load_splits
from captioning.data.images import ImageLimits
from captioning.data.records import ImageRecord
from captioning.data.vocab import SPECIALS, Vocabulary
from captioning.errors import ConfigError, DataError
from captioning.files import replace_synced, write_atomically
from captioning.folders import Writer, claim_folder, holds_only
from captioning.models import build_encoder
from captioning.models.encoder import Encoder
from captioning.progress import progress_bar
from captioning.runtime import autocast, batches, resolve_device, seed_everything
from captioning.signals import sigterm_raises

logger = logging.getLogger("captioning")

FORMAT_VERSION = 1
# Written before folders were marked, a cache folder held only these.
CACHE = Writer("extract-features", holds_only(("*.npy", "*.json", "*.json.tmp"), "*.json"))


def encoder_fingerprint(encoder: Encoder) -> str:
    """A hex digest of everything that decides the backbone grid of an image."""
    digest = hashlib.sha256()
    shape = (encoder.image_size, encoder.grid_shape, encoder.out_channels)
    if encoder.summary_rows:  # the caches of encoders without a summary keep their names
        shape = (*shape, encoder.summary_dim)
    if encoder.tiles:
        shape = (*shape, "tiles", encoder.tiles, encoder.tile_size)
    if encoder.hypercolumn:
        shape = (*shape, "hypercolumn")
    digest.update(repr(shape).encode())
    for name, tensor in sorted(encoder.state_dict().items()):
        if name == "positions":  # added after the cache, and may train
            continue
        digest.update(name.encode())
        digest.update(tensor.detach().cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()


def cache_folder(cfg: Config, encoder: Encoder) -> Path:
    """Where this config's encoder keeps its cached grids."""
    if not cfg.data.feature_cache:
        raise ConfigError("data.feature_cache is null; set it to a folder name to cache grids")
    base = Path(cfg.data.feature_cache)
    if not base.is_absolute():
        base = Path(cfg.data.root) / base
    tag = f"{cfg.model.encoder}-{encoder.image_size}px-{encoder_fingerprint(encoder)[:16]}"
    return base / tag


class FeatureCache:
    """The cached grids of one split, memory-mapped.

    Args:
        folder: the encoder's cache folder (see :func:`cache_folder`).
        split: the split name, e.g. ``train``.
    """

    def __init__(self, folder: str | Path, split: str) -> None:
        self.folder = Path(folder)
        self.split = split
        meta_path = self.folder / f"{split}.json"
        try:
            self.meta = json.loads(meta_path.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise DataError(
                f"feature cache {meta_path} is unreadable ({exc}); re-run extract-features"
            ) from exc
        if self.meta.get("format_version") != FORMAT_VERSION:
            raise DataError(f"feature cache {meta_path} has an unknown format; re-run it")
        array_path = self.folder / f"{split}.npy"
        try:
            self.array = np.load(array_path, mmap_mode="r")  # (N, L, D) float16
        except (OSError, ValueError) as exc:
            raise DataError(f"feature cache {array_path} is unreadable ({exc})") from exc
        if list(self.array.shape) != self.meta["shape"]:
            raise DataError(f"feature cache {array_path} does not match its {meta_path}")
        self.rows = {int(image_id): row for row, image_id in enumerate(self.meta["image_ids"])}

    @staticmethod
    def exists(folder: str | Path, split: str) -> bool:
        return (Path(folder) / f"{split}.json").is_file()

    def check(self, records: list[ImageRecord]) -> None:
        """Raise when an image of ``records`` has no cached grid."""
        missing = [r.image_id for r in records if r.image_id not in self.rows]
        if missing:
            raise DataError(
                f"feature cache {self.folder} lacks {len(missing)} of the {len(records)} "
                f"{self.split} images (e.g. id {missing[0]}); re-run extract-features for "
                f"--split {self.split} with this config"
            )

    def grid(self, image_id: int) -> torch.Tensor:
        """The cached grid (L, D), float16."""
        return torch.from_numpy(np.array(self.array[self.rows[image_id]]))


def find_caches(cfg: Config, encoder: Encoder, splits: list[str]) -> dict[str, FeatureCache | None]:
    """Per split, the cache for this encoder when it is frozen and one was extracted
    (the encoder's weights are hashed once for all splits)."""
    if not cfg.data.feature_cache or not encoder.frozen:
        return dict.fromkeys(splits)
    folder = cache_folder(cfg, encoder)
    caches: dict[str, FeatureCache | None] = {}
    for split in splits:
        if FeatureCache.exists(folder, split):
            caches[split] = FeatureCache(folder, split)
            logger.info("reading cached %s grids from %s", split, folder)
        else:
            caches[split] = None
            logger.info(
                "no cached %s grids at %s; the encoder is frozen, so "
                "`captioning extract-features --split %s` would save its forward passes",
                split,
                folder,
                split,
            )
    return caches


def find_cache(cfg: Config, encoder: Encoder, split: str) -> FeatureCache | None:
    """The cache of ``split`` for this encoder when it is frozen and one was extracted."""
    return find_caches(cfg, encoder, [split])[split]


def extract_features(
    cfg: Config,
    split: str,
    batch_size: int | None = None,
    progress: bool = True,
    overwrite: bool = False,
) -> dict[str, Any]:
    """Run the frozen encoder over every image of ``split`` and write its cache.

    The encoder is built exactly as :func:`captioning.training.train.fit` builds it (same seed), so
    a randomly initialised frozen encoder gets the same weights, and the same fingerprint.
    The cache folder is locked while it is written (see
    :func:`captioning.folders.claim_folder`), and the grids go to a partial file that is
    renamed into place once complete: SIGTERM or Ctrl-C removes the partial file, and the
    command exits as a killed one would.
    """
    if cfg.model.fine_tune != "none":
        raise ConfigError(
            f"model.fine_tune={cfg.model.fine_tune} trains the encoder, so its grid changes "
            f"every step and cannot be cached; set model.fine_tune=none"
        )
    device = resolve_device(cfg.train.device)
    seed_everything(cfg.train.seed)
    encoder = build_encoder(cfg.model, cfg.runtime)
    folder = cache_folder(cfg, encoder)
    fingerprint = encoder_fingerprint(encoder)  # of the weights as training builds them
    check = partial(_check_new, split=split, overwrite=overwrite)
    with sigterm_raises(), claim_folder(folder, CACHE, "data.feature_cache", check):
        encoder = encoder.to(device).eval()
        encoder.fold_batch_norms()  # the same grid, one pass per convolution
        records = _split_records(cfg, split, progress)
        loader = _loader(cfg, records, encoder, batch_size, device)
        path = folder / f"{split}.npy"

        def write_index(kept: list[int]) -> None:
            meta = {
                "format_version": FORMAT_VERSION,
                "split": split,
                "shape": [len(kept), encoder.num_rows, encoder.out_channels],
                "dtype": "float16",
                "image_ids": kept,
                "encoder": cfg.model.encoder,
                "weights": cfg.model.weights,
                "image_size": cfg.model.image_size,
                "grid": list(encoder.grid_shape),
                "fingerprint": fingerprint,
            }
            write_atomically(folder / f"{split}.json", json.dumps(meta))

        # The index is written last, right after the grids, a signal waiting for both: a
        # cache without it is never read, and a stopped run leaves both or neither.
        kept = _write_grids(encoder, loader, records, path, device, cfg, progress, write_index)
    shape = [len(kept), encoder.num_rows, encoder.out_channels]
    size = path.stat().st_size
    return {"folder": str(folder), "images": len(kept), "shape": shape, "bytes": size}


def _check_new(folder: Path, split: str, overwrite: bool) -> None:
    """Refuse to replace the cache of ``split`` unless ``overwrite``; remove the partial
    files of an extraction that was killed (the folder is locked: none is being written)."""
    if FeatureCache.exists(folder, split) and not overwrite:
        raise DataError(f"{folder / split}.npy already exists; pass --overwrite to redo it")
    for name in (f"{split}.partial.npy", f"{split}.compact.npy"):
        (folder / name).unlink(missing_ok=True)


def _split_records(cfg: Config, split: str, progress: bool) -> list[ImageRecord]:
    splits = load_splits(cfg.data)
    if not splits.get(split):
        raise DataError(f"the {split} split has no images (check data.splits)")
    if cfg.data.check_images:
        drop_bad_images({split: splits[split]}, cfg.data, progress=progress)
    return splits[split]


def _loader(
    cfg: Config,
    records: list[ImageRecord],
    encoder: Encoder,
    batch_size: int | None,
    device: torch.device,
) -> DataLoader:
    dataset = CaptionDataset(
        records,
        Vocabulary(list(SPECIALS)),  # captions are not needed here
        encoder.transform,
        skip_bad_images=cfg.data.on_bad_image == "skip",
        limits=ImageLimits.from_config(cfg.data),
    )
    return DataLoader(
        dataset,
        batch_size=batch_size or cfg.train.batch_size,
        collate_fn=collate,
        num_workers=cfg.data.num_workers,
        pin_memory=device.type == "cuda",
    )


def _write_grids(
    encoder: Encoder,
    loader: DataLoader,
    records: list[ImageRecord],
    path: Path,
    device: torch.device,
    cfg: Config,
    progress: bool,
    index: Callable[[list[int]], object],
) -> list[int]:
    """Write the backbone grid of every image in ``loader`` to ``path`` (N, L, D) float16,
    by way of a partial file, synced and renamed into place once complete, and then call
    ``index`` with the image ids of the rows (with Ctrl-C and SIGTERM held back from the
    rename to its end); returns those ids. Rows of images that failed to load
    (``on_bad_image: skip``) are dropped. The partial files are removed when the write
    stops early (an error, Ctrl-C, SIGTERM)."""
    folder, split = path.parent, path.stem
    partial_path = folder / f"{split}.partial.npy"
    compact = folder / f"{split}.compact.npy"
    try:
        written = _fill(encoder, loader, len(records), partial_path, device, cfg, progress)
        kept = [r.image_id for r, ok in zip(records, written) if ok]
        if not written.all():
            _compact(partial_path, compact, written)
            os.replace(compact, partial_path)
        replace_synced(partial_path, path, with_it=partial(index, kept))
    except BaseException as exc:
        partial_path.unlink(missing_ok=True)
        compact.unlink(missing_ok=True)
        if isinstance(exc, OSError):
            raise DataError(
                f"{path}: cannot write ({exc.strerror or exc}); free some space, "
                f"or set data.feature_cache to a folder on another disk"
            ) from exc
        raise
    return kept


def _fill(
    encoder: Encoder,
    loader: DataLoader,
    count: int,
    partial_path: Path,
    device: torch.device,
    cfg: Config,
    progress: bool,
) -> np.ndarray:
    """Write each batch's grids into their rows of a new (count, L, D) float16 array at
    ``partial_path``; returns which rows were written."""
    shape = (count, encoder.num_rows, encoder.out_channels)
    split = partial_path.name.removesuffix(".partial.npy")
    array = np.lib.format.open_memmap(partial_path, mode="w+", dtype=np.float16, shape=shape)
    written = np.zeros(count, dtype=bool)
    with torch.no_grad(), autocast(device, cfg.train.precision):
        for batch in progress_bar(
            batches(loader),
            total=len(loader),
            desc=f"extracting {split}",
            unit="batch",
            enabled=progress,
        ):
            if batch is None:
                continue
            grid = encoder.backbone(batch["images"].to(device))  # (B, L, D)
            indices = batch["indices"].numpy()
            array[indices] = grid.float().cpu().numpy().astype(np.float16)
            written[indices] = True
    array.flush()
    del array
    return written


def _compact(partial_path: Path, compact: Path, written: np.ndarray) -> None:
    """Copy the written rows of ``partial_path`` into a new array at ``compact``."""
    full = np.load(partial_path, mmap_mode="r")
    out = np.lib.format.open_memmap(
        compact, mode="w+", dtype=np.float16, shape=(int(written.sum()), *full.shape[1:])
    )
    out[:] = full[written]
    out.flush()
    del out, full
