"""Writing files safely. :func:`open_unlinked` opens a file for writing without following a
symbolic link at its place: a link left in a folder a command writes (pointing at a user's
file) is refused, never written through. :func:`write_atomically` writes a file by way of a
synced temporary file in the same folder and a rename, so that a crash or a full disk leaves
the previous file (or none), never a half-written one."""

from __future__ import annotations

import errno
import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

from captioning.errors import CaptioningError
from captioning.signals import signals_deferred


def open_unlinked(path: str | Path, text: bool = False) -> Any:
    """``open(path, "w" or "wb")`` that never follows a symbolic link at ``path``: a link
    left in a folder a command writes (pointing at a user's file) is refused in one line
    instead of written through.

    Raises:
        CaptioningError: ``path`` is a symbolic link, or cannot be opened for writing.
    """
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o666)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise CaptioningError(
                f"{path} is a symbolic link, which this command will not write through; "
                f"remove it or choose another folder"
            ) from exc
        raise CaptioningError(
            f"{path}: cannot write ({exc.strerror or exc}); free some space or choose another "
            f"folder"
        ) from exc
    return os.fdopen(fd, "w", encoding="utf-8") if text else os.fdopen(fd, "wb")


# The temporary file of a write_atomically call: .NAME.<12 hex digits>.tmp
UNFINISHED = re.compile(r"\..+\.[0-9a-f]{12}\.tmp")


def write_atomically(path: str | Path, content: str | bytes) -> Path:
    """Write ``content`` (text as UTF-8) to ``path`` through a temporary file in the same
    folder, flushed, synced and then renamed over ``path``: a crash, a kill or a full disk
    leaves the previous file (or none), never a half-written one, and Ctrl-C or SIGTERM wait
    until the write is done.

    Raises:
        CaptioningError: in one line, when the file cannot be written; the previous one is
            kept.
    """
    path = Path(path)
    data = content.encode("utf-8") if isinstance(content, str) else content
    tmp = path.parent / f".{path.name}.{os.urandom(6).hex()}.tmp"
    with signals_deferred():  # Ctrl-C and SIGTERM wait for the rename (or the clean-up)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            # os.open, not mkstemp: the file gets the permissions the umask gives, as open()
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
        except OSError as exc:
            raise _cannot_write(path, exc) from exc
        try:
            with os.fdopen(fd, "wb") as handle:
                handle.write(data)
                handle.flush()
                os.fsync(handle.fileno())
            os.replace(tmp, path)
        except BaseException as exc:
            tmp.unlink(missing_ok=True)
            if isinstance(exc, OSError):
                raise _cannot_write(path, exc) from exc
            raise
    return path


def remove_unfinished_writes(folder: Path) -> list[Path]:
    """Delete the temporary files of :func:`write_atomically` calls that a killed process
    left in ``folder``; call it only while holding the folder's lock."""
    removed = [p for p in folder.glob(".*.tmp") if UNFINISHED.fullmatch(p.name)]
    for tmp in removed:
        tmp.unlink(missing_ok=True)
    return removed


def replace_synced(
    tmp: str | Path, path: str | Path, with_it: Callable[[], object] | None = None
) -> None:
    """Sync the finished file ``tmp`` to disk and rename it over ``path`` (same folder): the
    last step of a write made through a temporary file, such as a memory-mapped array.
    ``with_it`` runs right after the rename, and Ctrl-C and SIGTERM wait for both: a file
    that must appear with this one (its index) is never missing because a signal came
    between them.

    Raises:
        CaptioningError: in one line, when it cannot be synced or renamed; ``path`` is kept.
    """
    try:
        with open(tmp, "rb+") as handle:
            os.fsync(handle.fileno())
    except OSError as exc:
        raise _cannot_write(Path(path), exc) from exc
    with signals_deferred():
        try:
            os.replace(tmp, path)
        except OSError as exc:
            raise _cannot_write(Path(path), exc) from exc
        if with_it is not None:
            with_it()


def _cannot_write(path: Path, exc: OSError) -> CaptioningError:
    kept = "the previous one is kept; " if path.is_file() else ""
    return CaptioningError(
        f"{path}: cannot write ({exc.strerror or exc}); {kept}free some "
        f"space or choose another folder"
    )
