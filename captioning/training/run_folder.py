"""The run folder: one training at a time holds it (a file lock), and what it holds besides
the checkpoints (``config.yaml``, the resolved config).

:func:`claim_run_dir` is how training takes a folder, the way every command takes the folder
it writes (:func:`captioning.folders.claim_folder`): the main process refuses a folder that
holds files other than an earlier training's, makes and locks it, refuses a folder that
already holds a run (unless resuming), removes what a killed checkpoint write left, and
gives back what it made when the start fails.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from captioning.config import Config, config_to_dict
from captioning.errors import CaptioningError, ConfigError
from captioning.files import write_atomically
from captioning.folders import LOCK, FolderWords, Writer, hold_folder, holds_only, lock_folder

if TYPE_CHECKING:
    from captioning.distributed import World

logger = logging.getLogger("captioning")

CONFIG_FILE = "config.yaml"
RUN_FOLDER = FolderWords("run folder", "training", "--out")


# What training writes into its folder; an unmarked folder that holds anything else is not
# an earlier run, whatever else it holds (a user's own config.yaml beside their notes).
TRAINING_WRITES = (
    CONFIG_FILE,
    "last.pt",
    "best.pt",
    ".*.pt.*.tmp",
    ".*.tmp",
    "summary.json",
    "failed.json",
    "events.out.tfevents.*",
    "figures",
)


def _earlier_training(folder: Path) -> bool:
    """A run folder from before folders were marked: training always locked it, wrote its
    config or a checkpoint there, and nothing but what training writes is in it."""
    written = (CONFIG_FILE, "last.pt", "best.pt", ".*.pt.*.tmp")
    if not (folder / LOCK).is_file() or not any(any(folder.glob(n)) for n in written):
        return False
    return holds_only(TRAINING_WRITES, "*")(folder)


TRAIN = Writer("train", _earlier_training)
# Written before folders were marked, a shapes dataset held only its two folders.
SHAPES = Writer("shapes", holds_only(("images", "annotations"), "images/*/*_000000.png"))


def write_config(cfg: Config, out_dir: Path) -> Path:
    """Write the resolved ``cfg`` (every key) as ``out_dir/config.yaml``, atomically;
    returns the path.

    Raises:
        ConfigError: in one line, when it cannot be written (a full disk, no permission).
    """
    path = Path(out_dir) / CONFIG_FILE
    try:
        write_atomically(path, yaml.safe_dump(config_to_dict(cfg), sort_keys=False))
    except CaptioningError as exc:
        raise ConfigError(str(exc)) from exc
    return path


def lock_run_dir(out_dir: Path) -> Any:
    """An exclusive lock on the run folder ``out_dir`` for as long as the returned file
    stays open, so that two trainings never write into one run folder."""
    return lock_folder(Path(out_dir), RUN_FOLDER)


@contextlib.contextmanager
def claim_run_dir(out_dir: Path, resume: str | None, world: World) -> Iterator[None]:
    """Hold the run folder ``out_dir`` for the block: the main process takes it as
    :func:`captioning.folders.claim_folder` does, and only under the lock checks that it
    holds no other run and removes what a killed checkpoint write left, so that of two
    trainings started together one is refused. Every process stops when the main one cannot
    have it."""
    from captioning.distributed import broadcast_object

    held, problem = None, None
    if world.is_main:
        try:
            held = hold_folder(Path(out_dir), TRAIN, RUN_FOLDER, lambda f: _start_run(f, resume))
        except CaptioningError as exc:
            problem = exc
    refused = broadcast_object(world, None if problem is None else str(problem))
    succeeded = False
    try:
        if refused is not None:
            raise problem if problem is not None else CaptioningError(refused)
        yield
        succeeded = True
    finally:
        if held is not None:
            held.release(succeeded)


def _start_run(out_dir: Path, resume: str | None) -> None:
    """Refuse a folder that already holds a run, unless the run is resumed; remove the
    temporary files of checkpoint writes that a killed run left."""
    from captioning.checkpoint import remove_partial_writes

    if resume is None and (out_dir / "last.pt").exists():
        raise CaptioningError(
            f"run folder {out_dir} already holds a run; continue it with "
            f"--resume {out_dir / 'last.pt'}, or choose another --out"
        )
    for tmp in remove_partial_writes(out_dir):
        logger.warning("removed %s, a checkpoint write that never finished", tmp)
