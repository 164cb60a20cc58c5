"""The folders the commands write.

A command takes the folder it writes with :func:`claim_folder` (``evaluate --out``,
``caption --attention-dir``, ``prepare ... --out``, the feature cache, the quickstart; a
training's run folder is :mod:`captioning.training.run_folder`'s, on the same functions). A
folder that holds files is refused before anything is written into it, unless it holds an
earlier run of the same command: its marker file (:data:`MARKER`) names the command, or,
written before folders were marked, it holds what only that command writes (see
:class:`Writer`). Then the folder is locked (:data:`LOCK`), checked again under the lock, and
marked. Nothing a person put into a folder is ever removed: a start that fails removes only
the lock file and marker it made, and the folder when it made that too, and only when nothing
else was written.
"""

from __future__ import annotations

import contextlib
import errno
import fnmatch
import logging
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

from captioning.errors import CaptioningError
from captioning.files import remove_unfinished_writes, write_atomically
from captioning.signals import signals_deferred

logger = logging.getLogger("captioning")


LOCK = ".lock"


# Names the command a folder belongs to; written once the folder is locked and checked.
MARKER = ".captioning"


def holds_only(names: tuple[str, ...], sign: str) -> Callable[[Path], bool]:
    """A test of a folder without a marker: it holds ``sign`` (a ``glob`` pattern inside
    it), and nothing outside ``names`` (``fnmatch`` patterns of its entries) but a lock."""

    def test(folder: Path) -> bool:
        if not any(folder.glob(sign)):
            return False
        entries = [p.name for p in folder.iterdir() if p.name not in (LOCK, MARKER)]
        return all(any(fnmatch.fnmatchcase(e, n) for n in names) for e in entries)

    return test


def _never(folder: Path) -> bool:
    return False


@dataclass(frozen=True)
class Writer:
    """A command that writes a folder of its own.

    Args:
        verb: the command as typed after ``captioning`` (``evaluate``); the marker names it.
        earlier: whether a folder without a marker, written before folders were marked,
            holds an earlier run of the command (see :func:`holds_only`); never by default.
    """

    verb: str
    earlier: Callable[[Path], bool] = _never


class FolderWords(NamedTuple):
    """How messages name a folder (``run folder``), who holds it (``training``) and the
    option that chose it (``--out``)."""

    name: str
    who: str
    flag: str


# Folders this process holds: a command run inside another (the quickstart's training)
# writes into the folder the outer one took and checked.
_HELD: set[Path] = set()


def _an(flag: str) -> str:
    return "an" if flag.lstrip("-")[:1] in "aeiou" else "a"


def lock_folder(folder: Path, words: FolderWords) -> Any:
    """An exclusive lock on ``folder`` (its :data:`LOCK` file) for as long as the returned
    file stays open."""
    import fcntl

    path = folder / LOCK
    try:
        # never through a link: a .lock that points at a user's file would truncate it
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW, 0o666)
        handle = os.fdopen(fd, "a+")  # held open for the whole run
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise CaptioningError(
                f"{words.name} {folder} holds a {LOCK} that is a symbolic link, which this "
                f"command will not write through; remove it or choose another {words.flag}"
            ) from exc
        raise CaptioningError(
            f"cannot write in {words.name} {folder} ({exc.strerror}); choose another {words.flag}"
        ) from exc
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        handle.close()
        if exc.errno not in (errno.EAGAIN, errno.EWOULDBLOCK):  # not "held by another"
            raise CaptioningError(
                f"cannot lock {words.name} {folder} ({exc.strerror or exc}): its file system "
                f"does not take file locks (some network mounts); choose {_an(words.flag)} "
                f"{words.flag} on a local disk"
            ) from exc
        holder = path.read_text(errors="replace").strip()[:80] or "another process"
        raise CaptioningError(
            f"{words.name} {folder} is in use by another {words.who} ({holder}); wait for it "
            f"to finish, or choose another {words.flag}"
        ) from exc
    if not _same_file(handle, path):  # removed by a failed start (see HeldFolder.release)
        handle.close()
        raise CaptioningError(
            f"{words.name} {folder} was being given up by another "
            f"{words.who}; run the command again"
        )
    handle.seek(0)
    handle.truncate()
    handle.write(f"pid {os.getpid()}\n")
    handle.flush()
    return handle


def _same_file(handle: Any, path: Path) -> bool:
    """Whether the open ``handle`` is still the file at ``path``: a lock on a file no
    longer there would not keep out the next command."""
    try:
        there, held = os.stat(path), os.fstat(handle.fileno())
    except FileNotFoundError:
        return False
    return (there.st_dev, there.st_ino) == (held.st_dev, held.st_ino)


def marked_verb(folder: Path) -> str | None:
    """The command that ``folder``'s marker names, or None without a (readable) marker."""
    try:
        lines = (folder / MARKER).read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError):
        return None
    return lines[0].strip() if lines else None


def check_owner(
    folder: Path, writer: Writer, words: FolderWords, ours: frozenset[str] = frozenset()
) -> None:
    """Refuse ``folder`` unless it is missing, empty (but for ``ours``), marked as
    ``writer``'s, or an earlier unmarked run of it (``writer.earlier``)."""
    if not folder.exists():
        return
    if not folder.is_dir():
        raise CaptioningError(
            f"{words.flag} {folder} is a file, not a folder; name a folder "
            f"(it is made when missing)"
        )
    marked = marked_verb(folder)
    if marked == writer.verb:
        return
    what = f"{words.name} {folder}"
    if marked is not None:
        raise CaptioningError(
            f"{what} holds the output of `captioning {marked}`; nothing was "
            f"changed: choose another {words.flag}"
        )
    try:
        others = sorted(p.name for p in folder.iterdir() if p.name not in ours)
        earlier = bool(others) and writer.earlier(folder)
    except OSError as exc:
        raise CaptioningError(
            f"cannot read {what} ({exc.strerror or exc}); choose another {words.flag}"
        ) from exc
    if others and not earlier:
        raise CaptioningError(
            f"{what} already holds files that `captioning {writer.verb}` did not write (such "
            f"as {others[0]}); nothing was changed: choose a new or empty folder for "
            f"{words.flag}"
        )


def _make_folder(folder: Path, words: FolderWords) -> bool:
    """Make ``folder`` (and its parents) when missing; whether it was made here."""
    try:
        folder.parent.mkdir(parents=True, exist_ok=True)
        folder.mkdir()
    except FileExistsError:
        if folder.is_dir():
            return False
        raise CaptioningError(
            f"cannot make {words.name} {folder} (a file is in the way); choose another {words.flag}"
        ) from None
    except OSError as exc:
        raise CaptioningError(
            f"cannot make {words.name} {folder} ({exc.strerror}); choose another {words.flag}"
        ) from exc
    return True


@dataclass
class HeldFolder:
    """A folder this process holds: its lock (None inside a command that holds it already),
    whether it was made here, and which of the lock file and marker this start made."""

    folder: Path
    lock: Any = None
    made: bool = False
    created: set[str] = field(default_factory=set)

    def release(self, succeeded: bool) -> None:
        """Let the folder go; after a failed start, remove what this start made (the folder
        too when it was made here), only when nothing else was written into it, and while
        the lock is still held, so that no other command takes the lock file just before it
        goes."""
        if self.lock is None:
            return
        with signals_deferred():  # all of it, or a lone marker or lock file stays
            _HELD.discard(self.folder.resolve())
            if not succeeded:
                with contextlib.suppress(OSError):
                    if {p.name for p in self.folder.iterdir()} <= self.created:
                        for name in (LOCK, MARKER):  # the lock first: a waiter sees it go
                            if name in self.created:
                                (self.folder / name).unlink(missing_ok=True)
                        if self.made:
                            self.folder.rmdir()
            self.lock.close()  # releases the lock


def hold_folder(
    folder: Path, writer: Writer, words: FolderWords, check: Callable[[Path], None] | None
) -> HeldFolder:
    """Check, make, lock, check again and mark ``folder`` for ``writer`` (see the module
    docstring); ``check`` runs under the lock, before the marker is written."""
    if folder.resolve() in _HELD:  # the command that runs this one took and checked it
        if check is not None:
            check(folder)
        return HeldFolder(folder)
    check_owner(folder, writer, words)
    held = HeldFolder(folder)
    try:
        # Ctrl-C and SIGTERM wait until the folder is made and locked and ``held`` knows
        # what this start made: one that came between the lock file's creation and here
        # would leave a .lock that the next run takes for someone else's file.
        with signals_deferred():
            held.made = _make_folder(folder, words)
            held.created = {LOCK, MARKER} - {p.name for p in folder.iterdir()}
            held.lock = lock_folder(folder, words)
            _HELD.add(folder.resolve())
        check_owner(folder, writer, words, ours=frozenset({LOCK}))
        for tmp in remove_unfinished_writes(folder):
            logger.warning("removed %s, a write that never finished", tmp)
        if check is not None:
            check(folder)
        if marked_verb(folder) != writer.verb:
            _mark(folder, writer.verb)
    except BaseException:
        held.release(succeeded=False)
        raise
    return held


def _mark(folder: Path, verb: str) -> None:
    """Write ``folder``'s marker: the command's name, then a line for a person who finds it."""
    note = f"written by `captioning {verb}`, which may write into this folder again"
    write_atomically(folder / MARKER, f"{verb}\n{note}\n")


@contextlib.contextmanager
def claim_folder(
    folder: str | Path,
    writer: Writer,
    flag: str = "--out",
    check: Callable[[Path], None] | None = None,
) -> Iterator[Path]:
    """Hold ``folder`` for ``writer``'s command during the block: refused when it holds
    files that are not the command's, made when missing, locked, checked again under the
    lock (and by ``check``, when given), marked. Yields the folder.

    Raises:
        CaptioningError: in one line, naming ``flag``: the folder is another's, is in use,
            or cannot be made or locked.
    """
    words = FolderWords(flag, f"`captioning {writer.verb}`", flag)
    held = hold_folder(Path(folder), writer, words, check)
    succeeded = False
    try:
        yield held.folder
        succeeded = True
    finally:
        held.release(succeeded)
