"""Opening a file for writing without following a symbolic link at its place: a link left
in a folder a command writes (pointing at a user's file) is refused, never written through."""

from __future__ import annotations

import errno
import os
from pathlib import Path
from typing import Any

from captioning.errors import CaptioningError


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
