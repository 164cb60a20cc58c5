"""The run folder: one training at a time holds it (a file lock), and what it holds besides
the checkpoints (``config.yaml``, the resolved config).

:func:`claim_run_dir` is how training takes a folder: the main process makes and locks it,
refuses a folder that already holds a run (unless resuming), removes what a killed
checkpoint write left, and gives a folder it made back when the start fails.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from captioning.checkpoint import remove_partial_writes
from captioning.config import Config, save_config
from captioning.distributed import World, broadcast_object
from captioning.errors import CaptioningError

logger = logging.getLogger("captioning")

CONFIG_FILE = "config.yaml"


def write_config(cfg: Config, out_dir: Path) -> Path:
    """Write the resolved ``cfg`` (every key) as ``out_dir/config.yaml``; returns the path."""
    path = Path(out_dir) / CONFIG_FILE
    save_config(cfg, path)
    return path


def lock_run_dir(out_dir: Path) -> Any:
    """An exclusive lock on ``out_dir`` for as long as the returned file stays open, so that
    two trainings never write into one run folder."""
    import fcntl

    path = out_dir / ".lock"
    try:
        handle = open(path, "a+")  # noqa: SIM115 (held open for the whole run)
    except OSError as exc:
        raise CaptioningError(f"cannot write in run folder {out_dir} ({exc.strerror}); "
                              f"choose another --out") from exc  # fmt: skip
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        handle.close()
        if exc.errno not in (errno.EAGAIN, errno.EWOULDBLOCK):  # not "held by another"
            raise CaptioningError(
                f"cannot lock run folder {out_dir} ({exc.strerror or exc}): its file system "
                f"does not take file locks (some network mounts); choose an --out on a "
                f"local disk"
            ) from exc
        holder = path.read_text(errors="replace").strip()[:80] or "another process"
        raise CaptioningError(
            f"run folder {out_dir} is in use by another training ({holder}); wait for it "
            f"to finish, or choose another --out"
        ) from exc
    if not _same_file(handle, path):  # removed by a failed start (see _remove_if_empty)
        handle.close()
        raise CaptioningError(f"run folder {out_dir} was being given up by another training; "
                              f"run the command again")  # fmt: skip
    handle.seek(0)
    handle.truncate()
    handle.write(f"pid {os.getpid()}\n")
    handle.flush()
    return handle


def _same_file(handle: Any, path: Path) -> bool:
    """Whether the open ``handle`` is still the file at ``path``: a lock on a file no
    longer there would not keep out the next training."""
    try:
        there, held = os.stat(path), os.fstat(handle.fileno())
    except FileNotFoundError:
        return False
    return (there.st_dev, there.st_ino) == (held.st_dev, held.st_ino)


@contextlib.contextmanager
def claim_run_dir(out_dir: Path, resume: str | None, world: World) -> Iterator[None]:
    """Hold ``out_dir`` for the block: the main process locks it, and only then checks that
    it holds no other run and removes what a killed checkpoint write left, so that of two
    trainings started together one is refused. A folder made here and still empty when the
    block fails is removed again."""
    lock, problem, made = None, None, False
    if world.is_main:
        try:
            try:
                out_dir.parent.mkdir(parents=True, exist_ok=True)
                with contextlib.suppress(FileExistsError):
                    out_dir.mkdir()
                    made = True
            except OSError as exc:
                raise CaptioningError(f"cannot make run folder {out_dir} ({exc.strerror}); "
                                      f"choose another --out") from exc  # fmt: skip
            lock = lock_run_dir(out_dir)
            _check_run_dir(out_dir, resume)
            for tmp in remove_partial_writes(out_dir):
                logger.warning("removed %s, a checkpoint write that never finished", tmp)
        except CaptioningError as exc:
            problem = exc
    # Every process stops when the main one cannot have the folder.
    refused = broadcast_object(world, None if problem is None else str(problem))
    succeeded = False
    try:
        if refused is not None:
            raise problem if problem is not None else CaptioningError(refused)
        yield
        succeeded = True
    finally:
        if made and not succeeded and lock is not None:
            _remove_if_empty(out_dir)
        if lock is not None:
            lock.close()  # releases the lock


def _remove_if_empty(out_dir: Path) -> None:
    """Remove ``out_dir`` when it holds nothing but its lock file (still locked by the
    caller, so that no other training takes the file just before it goes)."""
    with contextlib.suppress(OSError):
        if [p.name for p in out_dir.iterdir()] == [".lock"]:
            (out_dir / ".lock").unlink()
            out_dir.rmdir()


def _check_run_dir(out_dir: Path, resume: str | None) -> None:
    """Refuse a folder that already holds a run, unless the run is resumed."""
    if resume is None and (out_dir / "last.pt").exists():
        raise CaptioningError(
            f"run folder {out_dir} already holds a run; continue it with "
            f"--resume {out_dir / 'last.pt'}, or choose another --out"
        )
