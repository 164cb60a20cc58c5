"""Reader for Karpathy's split files (``dataset_coco.json``, ``dataset_flickr8k.json``, ...)."""

from __future__ import annotations

import os
from pathlib import Path

from captioning.data.coco import entries, field_of, image_path, load_json
from captioning.data.records import ImageRecord, ObjectAnnotation
from captioning.errors import DataError


def read_karpathy(
    path: str | Path,
    image_root: str | Path,
    restval: bool = True,
    objects: dict[int, tuple[ObjectAnnotation, ...]] | None = None,
) -> dict[str, list[ImageRecord]]:
    """Records per split (``train``, ``val``, ``test``) from a Karpathy split file.

    Args:
        path: the json file: ``{"images": [{"filepath", "filename", "split",
            "sentences": [{"raw"}], "cocoid" or "imgid"}]}``.
        image_root: images are at ``image_root/filepath/filename`` (``filepath`` may be absent,
            as in the Flickr files).
        restval: fold the ``restval`` images into train (the usual 113k COCO training set);
            without it they are left out.
        objects: optional instance annotations per image id (COCO ids), for category subsets
            and attention grounding.
    """
    path = Path(path)
    data = load_json(path, "Karpathy split file")
    images = entries(path, data, "images", "Karpathy split file")
    splits: dict[str, list[ImageRecord]] = {"train": [], "val": [], "test": []}
    for index, image in enumerate(images):
        where = f"images[{index}]"
        split = field_of(path, image, where, "split", str)
        if split == "restval":
            if not restval:
                continue
            split = "train"
        if split not in splits:
            raise DataError(
                f"{path}: {where} has unknown split {split[:40]!r} (train, val, test or restval)"
            )
        key = "cocoid" if "cocoid" in image else "imgid" if "imgid" in image else None
        image_id = field_of(path, image, where, key, int) if key else index
        folder = image.get("filepath", "")
        if not isinstance(folder, str):
            folder = field_of(path, image, where, "filepath", str)
        file_name = field_of(path, image, where, "filename", str)
        file_path = image_path(path, image_root, os.path.join(folder, file_name), where)
        captions = []
        for number, sentence in enumerate(field_of(path, image, where, "sentences", list)):
            captions.append(_sentence(path, sentence, f"{where}.sentences[{number}]"))
        captions = [c for c in captions if c]
        if captions:
            splits[split].append(
                ImageRecord(
                    image_id=image_id,
                    path=file_path,
                    split=split,
                    captions=tuple(captions),
                    objects=(objects or {}).get(image_id, ()),
                )
            )
    for records in splits.values():
        records.sort(key=lambda r: r.image_id)
    return splits


def _sentence(path: Path, sentence: object, where: str) -> str:
    """A sentence's ``raw`` text, or its ``tokens`` joined when it has no ``raw``."""
    if not isinstance(sentence, dict):
        raise DataError(f"{path}: {where} is not an object; fix or remove the entry")
    if isinstance(sentence.get("raw"), str):
        return sentence["raw"].strip()
    tokens = sentence.get("tokens")
    if isinstance(tokens, list) and all(isinstance(t, str) for t in tokens):
        return " ".join(tokens).strip()
    raise DataError(
        f"{path}: {where} has neither a 'raw' string nor a 'tokens' list of "
        f"strings; fix or remove the entry"
    )
