"""Flickr8k and Flickr30k as people download them: the image folder, the token file and the
published split files, into the COCO-style layout of :mod:`captioning.prepare.folder`.

Flickr8k's text release (``Flickr8k_text/``) holds ``Flickr8k.token.txt`` and the official
split, ``Flickr_8k.{train,dev,test}Images.txt`` (6,000 / 1,000 / 1,000 names, one a line);
Flickr30k's token file (``results_20130124.token`` or ``results.csv``) comes with split files
of the same shape from elsewhere (Karpathy's split, Flickr30k Entities' ``train.txt``, whose
lines are image ids without ``.jpg``). The split files' ``dev`` is this project's ``val``.

Nothing is matched by guesswork and nothing is dropped without a record: the token file's
rows that name no image on disk (Flickr8k's ``2258277193_586949ec62.jpg``, which is not in
the image archive, and its ``2258277193_586949ec62.jpg.1``) are reported by line, as are
the split files' names that are not a usable image, names listed twice, and captioned images
that no split file lists (all in ``prepare_report.txt``).
"""

from __future__ import annotations

from pathlib import Path

from captioning.errors import DataError
from captioning.prepare.folder import SPLITS, FixedSplits, FolderSummary, prepare_folder

FLICKR8K_TOKENS = "Flickr8k.token.txt"
FLICKR8K_SPLITS = {
    "train": "Flickr_8k.trainImages.txt",
    "val": "Flickr_8k.devImages.txt",
    "test": "Flickr_8k.testImages.txt",
}


def prepare_flickr(
    images: str | Path,
    captions: str | Path,
    split_files: dict[str, str | Path],
    out: str | Path,
    progress: bool = True,
    verb: str = "flickr",
) -> FolderSummary:
    """Write the COCO-style dataset of :func:`captioning.prepare.folder.prepare_folder` from a
    Flickr image folder, its token file and the published split files.

    Args:
        images: the image folder (``Flicker8k_Dataset``, ``flickr30k-images``).
        captions: the token file (``NAME#N<TAB>CAPTION``) or Flickr30k's ``results.csv``.
        split_files: ``train``, ``val`` and ``test`` -> a file of image names (or ids), one
            a line.
        out: the new dataset root (must not exist, or be empty).
        progress: a bar on a terminal while the images are checked.
        verb: the name the report gives the command.

    Raises:
        DataError: a file is missing or unreadable, ``out`` already holds files, or the
            train or val split has no usable image.
    """
    missing = [split for split in SPLITS if split not in split_files]
    if missing:
        raise DataError(f"no split file for {', '.join(missing)}")
    fixed = FixedSplits({s: Path(split_files[s]) for s in SPLITS}, verb=verb)
    return prepare_folder(
        images, captions, out, progress=progress, format="flickr", fixed_splits=fixed
    )


def prepare_flickr8k(
    images: str | Path, text: str | Path, out: str | Path, progress: bool = True
) -> FolderSummary:
    """Flickr8k as downloaded: ``images`` is ``Flicker8k_Dataset/``, ``text`` the folder of
    the text release (``Flickr8k_text/``), with the official 6,000 / 1,000 / 1,000 split.

    Raises:
        DataError: see :func:`prepare_flickr`; also when ``text`` lacks a file of the release.
    """
    text = Path(text)
    if not text.is_dir():
        raise DataError(f"{text}: Flickr8k text folder not found (the unpacked Flickr8k_text.zip)")
    splits = {split: text / name for split, name in FLICKR8K_SPLITS.items()}
    for path in [text / FLICKR8K_TOKENS, *splits.values()]:
        if not path.is_file():
            raise DataError(f"{path}: not found; --text must be the unpacked Flickr8k_text folder")
    return prepare_flickr(images, text / FLICKR8K_TOKENS, splits, out, progress, "flickr8k")
