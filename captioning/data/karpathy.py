"""Reader for Karpathy's split files (``dataset_coco.json``, ``dataset_flickr8k.json``, ...)."""

from __future__ import annotations

import json
from pathlib import Path

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
    if not path.is_file():
        raise DataError(f"{path}: Karpathy split file not found")
    try:
        data = json.loads(path.read_text())
        images = data["images"]
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise DataError(f"{path}: not valid JSON ({exc})") from exc
    except (KeyError, TypeError) as exc:
        raise DataError(f"{path}: not a Karpathy split file (no 'images' list)") from exc

    splits: dict[str, list[ImageRecord]] = {"train": [], "val": [], "test": []}
    for index, image in enumerate(images):
        try:
            split = image["split"]
            if split == "restval":
                if not restval:
                    continue
                split = "train"
            image_id = int(image.get("cocoid", image.get("imgid", index)))
            captions = tuple(
                s["raw"].strip() if "raw" in s else " ".join(s["tokens"])
                for s in image["sentences"]
            )
            file_path = Path(image_root) / image.get("filepath", "") / image["filename"]
        except (KeyError, TypeError, ValueError) as exc:
            raise DataError(f"{path}: image entry {index} is malformed (missing {exc})") from exc
        if split not in splits:
            raise DataError(f"{path}: image entry {index} has unknown split {split!r}")
        if captions:
            splits[split].append(
                ImageRecord(
                    image_id=image_id,
                    path=str(file_path),
                    split=split,
                    captions=captions,
                    objects=(objects or {}).get(image_id, ()),
                )
            )
    for records in splits.values():
        records.sort(key=lambda r: r.image_id)
    return splits
