"""COCO 2014 / 2017 and Karpathy's split file, downloaded into the layout the configs read.

Layout under ``root`` (that of ``configs/coco_*.yaml`` with ``data.root=ROOT``)::

    root/train2014/COCO_train2014_*.jpg        (train2017/*.jpg for 2017)
    root/val2014/COCO_val2014_*.jpg
    root/annotations/captions_{train,val}2014.json, instances_..., person_keypoints_...
    root/dataset_coco.json                      (--karpathy: Karpathy's split file)
    root/downloads/NAME.zip.unpacked            (one marker per archive unpacked)

Archives are downloaded into ``root/downloads`` and removed once unpacked (unless kept), and
the marker lets a later call skip them, so the command can be run again after any failure
and does only what is left.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from captioning.errors import CaptioningError, DataError
from captioning.files import write_atomically
from captioning.folders import Writer, claim_folder, holds_only
from captioning.prepare.download import RemoteFile, check_url, download, unpack

logger = logging.getLogger("captioning")

COCO_BASE = "http://images.cocodataset.org"
KARPATHY_URL = "https://cs.stanford.edu/people/karpathy/deepimagesent/caption_datasets.zip"
KARPATHY_ARCHIVE = "caption_datasets.zip"
KARPATHY_FILE = "dataset_coco.json"
# Karpathy's zip has no published size or checksum, so it is bounded instead: the real one
# is about 36 MB and its dataset_coco.json about 140 MB.
KARPATHY_MAX_DOWNLOAD = 200_000_000
KARPATHY_MAX_UNPACKED = 1_000_000_000
YEARS = ("2014", "2017")
# Written before folders were marked, a dataset root held only these.
WRITTEN = (
    "downloads",
    "annotations",
    "train2014",
    "val2014",
    "train2017",
    "val2017",
    KARPATHY_FILE,
)
COCO = Writer("prepare coco", holds_only(WRITTEN, "downloads/*.unpacked"))

# Sizes and SHA-256 of the official archives (as published with TensorFlow Datasets'
# download checksums). Karpathy's zip has no published checksum: its size comes from the
# server and every member's CRC-32 is checked when it is unpacked.
KNOWN: dict[str, tuple[int, str]] = {
    "train2014.zip": (
        13510573713,
        "ede4087e640bddba550e090eae701092534b554b42b05ac33f0300b984b31775",
    ),
    "val2014.zip": (6645013297, "fe9be816052049c34717e077d9e34aa60814a55679f804cd043e3cbee3b9fde0"),
    "annotations_trainval2014.zip": (
        252872794,
        "031296bbc80c45a1d1f76bf9a90ead27e94e99ec629208449507a4917a3bf009",
    ),
    "train2017.zip": (
        19336861798,
        "69a8bb58ea5f8f99d24875f21416de2e9ded3178e903f1f7603e283b9e06d929",
    ),
    "val2017.zip": (815585330, "4f7e2ccb2866ec5041993c9cf2a952bbed69647b115d0f74da7ce8f4bef82f05"),
    "annotations_trainval2017.zip": (
        252907541,
        "113a836d90195ee1f884e704da6304dfaaecff1f023f49b6ca93c4aaae470268",
    ),
}


@dataclass(frozen=True)
class Archive:
    """One archive to fetch and unpack into the dataset root.

    Args:
        remote: where it comes from and what it must be.
        keep: the member names to extract (all when empty).
        max_unpacked: the most bytes those members may unpack to (None: no bound).
    """

    remote: RemoteFile
    keep: tuple[str, ...] = ()
    max_unpacked: int | None = None


def coco_archives(year: str, karpathy: bool, base_url: str | None = None) -> list[Archive]:
    """The archives of COCO ``year`` (annotations first: they are small and tell early
    whether the host works), plus Karpathy's split file with ``karpathy``.

    With ``base_url`` every file is fetched as ``BASE_URL/NAME`` (the names stay the same);
    the known sizes and checksums still apply, since a mirror serves the same files.
    """
    if year not in YEARS:
        raise DataError(f"--year must be 2014 or 2017, got {year!r}")
    if karpathy and year != "2014":
        raise DataError(
            "Karpathy's split file names the COCO 2014 files (train2014/COCO_train2014_...); "
            "use --year 2014 with --karpathy"
        )
    if base_url is not None:
        check_url(base_url)
    paths = [
        f"annotations/annotations_trainval{year}.zip",
        f"zips/val{year}.zip",
        f"zips/train{year}.zip",
    ]
    archives = []
    for path in paths:
        name = path.rpartition("/")[2]
        url = f"{base_url.rstrip('/')}/{name}" if base_url else f"{COCO_BASE}/{path}"
        size, sha256 = KNOWN.get(name, (None, None))
        archives.append(Archive(RemoteFile(name, url, size, sha256)))
    if karpathy:
        url = f"{base_url.rstrip('/')}/{KARPATHY_ARCHIVE}" if base_url else KARPATHY_URL
        remote = RemoteFile(KARPATHY_ARCHIVE, url, max_size=KARPATHY_MAX_DOWNLOAD)
        archives.insert(
            1, Archive(remote, keep=(KARPATHY_FILE,), max_unpacked=KARPATHY_MAX_UNPACKED)
        )
    return archives


def data_overrides(root: str | Path, year: str, karpathy: bool) -> list[str]:
    """The ``--set`` overrides that point a COCO config at a prepared ``root``."""
    splits = f"{{train: train{year}, val: val{year}, test: val{year}}}"
    if karpathy:
        return [
            f"data.root={root}",
            "data.format=karpathy",
            f"data.karpathy_file={KARPATHY_FILE}",
            "data.images=",
            "data.instances=annotations/instances_{split}.json",
            f"data.splits={splits}",
        ]
    # COCO's own split has no test captions: evaluation reads val (Karpathy's split holds
    # 5000 val images out as a test set).
    return [
        f"data.root={root}",
        "data.format=coco",
        "data.captions=annotations/captions_{split}.json",
        "data.instances=annotations/instances_{split}.json",
        "data.images={split}",
        f"data.splits={{train: train{year}, val: val{year}}}",
    ]


def prepare_coco(
    root: str | Path,
    year: str = "2014",
    karpathy: bool = False,
    base_url: str | None = None,
    keep_archives: bool = False,
    progress: bool = True,
) -> list[str]:
    """Download and unpack COCO ``year`` (and Karpathy's split file) into ``root``.

    Archives already unpacked by an earlier call are skipped, and a partial download is
    resumed. ``root`` must be new, empty or an earlier call's, and it is locked meanwhile.
    Returns the config overrides that read the result (:func:`data_overrides`).

    Args:
        root: the dataset folder (``data/coco`` in the shipped configs).
        year: ``2014`` or ``2017``.
        karpathy: also fetch Karpathy's split file (``dataset_coco.json``; 2014 only).
        base_url: fetch every file from ``BASE_URL/NAME`` instead of the official hosts.
        keep_archives: keep the zip files after unpacking (by default they are removed:
            COCO 2014's take 20 GB).
        progress: bars on a terminal, one line per file in a log.

    Raises:
        DataError: a download fails, a file is not the expected one, or an archive is
            damaged (in one line that says what to do).
        CaptioningError: ``root`` holds files an earlier call did not write, or is in use.
    """
    root = Path(root)
    archives = coco_archives(year, karpathy, base_url)
    with claim_folder(root, COCO, "--root"):
        for archive in archives:
            _fetch(archive, root, keep_archives, progress)
    return data_overrides(root, year, karpathy)


def _fetch(archive: Archive, root: Path, keep_archives: bool, progress: bool) -> None:
    """Download and unpack one archive into ``root``, unless an earlier call did."""
    downloads = root / "downloads"
    name = archive.remote.name
    marker = downloads / f"{name}.unpacked"
    if marker.is_file():
        logger.info("%s: already unpacked into %s", name, root)
        return
    path = download(archive.remote, downloads, progress=progress)
    keep = set(archive.keep)
    members = unpack(
        path,
        root,
        keep=keep.__contains__ if keep else None,
        max_bytes=archive.max_unpacked,
        progress=progress,
    )
    missing = keep - set(members)
    if missing:
        raise DataError(
            f"{path}: holds no {', '.join(sorted(missing))}; this is not "
            f"Karpathy's caption_datasets.zip (check --base-url)"
        )
    try:
        write_atomically(marker, "\n".join(members) + "\n")
    except CaptioningError as exc:  # the files are unpacked; only the note of it is missing
        raise DataError(
            f"{exc}; then run the same command again (it unpacks {name} once more)"
        ) from exc
    if not keep_archives:
        path.unlink()
    logger.info("%s: %d files unpacked into %s", name, len(members), root)
