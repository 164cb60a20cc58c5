"""From a :class:`DataConfig` to records per split: reader choice, subsets, logging."""

from __future__ import annotations

import difflib
import logging
import random
from collections.abc import Sequence
from pathlib import Path

from captioning.config import DataConfig
from captioning.data.coco import read_coco, read_instances
from captioning.data.karpathy import read_karpathy
from captioning.data.records import ImageRecord, ObjectAnnotation
from captioning.data.vocab import Vocabulary
from captioning.errors import DataError

logger = logging.getLogger("captioning")

SPLITS = ("train", "val", "test")


def resolve(root: str | Path, path: str) -> Path:
    """``path`` if absolute, else relative to the data root."""
    return Path(path) if Path(path).is_absolute() else Path(root) / path


# The instances file a COCO layout has where it has one; another pattern is one a user named.
DEFAULT_INSTANCES = DataConfig.instances


def _read_coco_splits(cfg: DataConfig) -> dict[str, list[ImageRecord]]:
    need_instances = bool(cfg.categories)
    splits = {}
    for split, name in cfg.splits.items():
        captions = resolve(cfg.root, cfg.captions.format(split=name))
        if not captions.is_file():
            raise DataError(
                f"{captions}: captions file for split {split!r} not found "
                f"(check data.root={cfg.root!r} and data.captions)"
            )
        instances = None
        if cfg.instances:
            instances = resolve(cfg.root, cfg.instances.format(split=name))
            if not instances.is_file():
                if need_instances:
                    raise DataError(
                        f"{instances}: data.categories needs the instances file of split "
                        f"{split!r}; set data.instances to its path pattern"
                    )
                if cfg.instances != DEFAULT_INSTANCES:  # a file the user named: never ignored
                    raise DataError(
                        f"{instances}: data.instances={cfg.instances} names no file for split "
                        f"{split!r}; fix the pattern, or set data.instances=null"
                    )
                instances = None
        elif need_instances:
            raise DataError("data.categories needs instance annotations; set data.instances")
        image_dir = resolve(cfg.root, cfg.images.format(split=name))
        splits[split] = read_coco(captions, image_dir, split, instances)
    return splits


def _read_karpathy_splits(cfg: DataConfig) -> dict[str, list[ImageRecord]]:
    objects: dict[int, tuple[ObjectAnnotation, ...]] = {}
    if cfg.categories:
        if not cfg.instances:
            raise DataError("data.categories needs instance annotations; set data.instances")
        # Karpathy's COCO file keeps the original folders (train2014, val2014) in `filepath`;
        # `{split}` in data.instances stands for those names here.
        for name in sorted(set(cfg.splits.values())):
            path = resolve(cfg.root, cfg.instances.format(split=name))
            if not path.is_file():
                raise DataError(f"{path}: instances file not found (data.categories needs it)")
            objects.update(read_instances(path))
    image_root = resolve(cfg.root, cfg.images.replace("{split}", ""))
    splits = read_karpathy(
        resolve(cfg.root, cfg.karpathy_file), image_root, restval=cfg.restval, objects=objects
    )
    return {split: records for split, records in splits.items() if split in cfg.splits}


READERS = {"coco": _read_coco_splits, "karpathy": _read_karpathy_splits}


def filter_categories(
    records: Sequence[ImageRecord], categories: Sequence[str]
) -> list[ImageRecord]:
    """The records that hold at least one object of any of ``categories``."""
    wanted = set(categories)
    return [r for r in records if any(o.category in wanted for o in r.objects)]


def subsample(records: Sequence[ImageRecord], max_images: int, seed: int) -> list[ImageRecord]:
    """A seeded random subset of at most ``max_images`` records, in image-id order.

    The choice is a prefix of one seeded permutation, so it is stable across runs and a
    larger subset contains every smaller one.
    """
    if max_images >= len(records):
        return list(records)
    ordered = sorted(records, key=lambda r: r.image_id)
    random.Random(seed).shuffle(ordered)
    return sorted(ordered[:max_images], key=lambda r: r.image_id)


def _max_images_for(cfg: DataConfig, split: str) -> int | None:
    if isinstance(cfg.max_images, dict):
        unknown = set(cfg.max_images) - set(SPLITS)
        if unknown:
            raise DataError(f"data.max_images has unknown splits {sorted(unknown)}")
        return cfg.max_images.get(split)
    return cfg.max_images


def _check_categories(splits: dict[str, list[ImageRecord]], categories: Sequence[str]) -> None:
    known = {o.category for records in splits.values() for r in records for o in r.objects}
    for name in categories:
        if name not in known:
            close = difflib.get_close_matches(name, sorted(known), n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise DataError(f"data.categories: no object of category {name!r}{hint}")


def load_splits(cfg: DataConfig) -> dict[str, list[ImageRecord]]:
    """Records for each configured split after category and size subsets.

    Logs how many images each split kept.
    """
    if not Path(cfg.root).is_dir():
        raise DataError(
            f"data root {cfg.root} does not exist; for the shapes data run "
            f"`captioning shapes --out {cfg.root}`, or set data.root"
        )
    splits = READERS[cfg.format](cfg)
    if cfg.categories:
        _check_categories(splits, cfg.categories)
    for split, records in splits.items():
        total = len(records)
        notes = []
        if cfg.categories:
            records = filter_categories(records, cfg.categories)
            notes.append(f"{len(records)} with categories {', '.join(cfg.categories)}")
        limit = _max_images_for(cfg, split)
        if limit is not None and limit < len(records):
            records = subsample(records, limit, cfg.subset_seed)
            notes.append(f"{len(records)} by data.max_images")
        splits[split] = records
        detail = f" of {total} ({'; '.join(notes)})" if notes else ""
        logger.info("split %s: %d images%s", split, len(records), detail)
    return splits


def drop_bad_images(
    splits: dict[str, list[ImageRecord]], cfg: DataConfig, progress: bool = False
) -> list[tuple[str, str]]:
    """Open every image once; report each bad one by path, then fail or skip.

    With ``data.on_bad_image: error`` any bad image raises :class:`DataError` (after every
    problem was logged); with ``skip`` the records are removed in place and counted.
    Returns the ``(path, problem)`` pairs.
    """
    from captioning.data.images import ImageLimits, check_images

    paths = [r.path for records in splits.values() for r in records]
    bad = check_images(paths, progress=progress, limits=ImageLimits.from_config(cfg))
    for path, problem in bad:
        logger.warning("bad image: %s: %s", path, problem)
    if not bad:
        return bad
    if cfg.on_bad_image == "error":
        raise DataError(
            f"{len(bad)} of {len(paths)} images cannot be read (first: {bad[0][0]}: {bad[0][1]}); "
            f"fix or remove them, or set data.on_bad_image=skip"
        )
    bad_paths = {path for path, _ in bad}
    for split, records in splits.items():
        kept = [r for r in records if r.path not in bad_paths]
        if len(kept) != len(records):
            logger.warning(
                "split %s: skipped %d unreadable images, %d left",
                split,
                len(records) - len(kept),
                len(kept),
            )
        splits[split] = kept
    return bad


def build_vocabulary(splits: dict[str, list[ImageRecord]], cfg: DataConfig) -> Vocabulary:
    """The vocabulary of the training split's captions only (``data.min_count``,
    ``data.max_vocab``): words seen only in val or test stay ``<unk>``."""
    if not splits.get("train"):
        raise DataError("the train split has no images, so no vocabulary can be built")
    captions = (c for record in splits["train"] for c in record.captions)
    return Vocabulary.build(captions, cfg.min_count, cfg.max_vocab)
