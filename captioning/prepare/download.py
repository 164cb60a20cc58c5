"""Downloads that resume, verify, and unpack without leaving half a file behind.

A file is written to ``NAME.part`` and renamed to ``NAME`` only once it is whole: its size
equals the server's Content-Length (and the known size, when there is one) and its SHA-256
equals the known one. A connection that drops mid-file is picked up where it stopped with an
HTTP ``Range`` request, a few times within one call, and again by the next call, which finds
the ``.part`` file. Unpacking reads every member of the zip, so each member's CRC-32 is
checked on the way; a damaged archive is removed and refused in one line.
"""

from __future__ import annotations

import contextlib
import hashlib
import http.client
import logging
import os
import shutil
import time
import urllib.error
import urllib.parse
import urllib.request
import zipfile
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from captioning.errors import DataError
from captioning.progress import format_count, progress_bar

logger = logging.getLogger("captioning")

CHUNK_BYTES = 1 << 20


@dataclass(frozen=True)
class RemoteFile:
    """A file to download.

    Args:
        name: its file name, kept whatever host serves it (``train2014.zip``).
        url: where it is fetched from.
        size: its size in bytes when known; a server that offers another size is refused.
        sha256: its SHA-256 (hex) when known; checked before the file gets its name.
        max_size: when ``size`` is not known, the most bytes taken: a server that offers
            or sends more is refused (None: no bound).
    """

    name: str
    url: str
    size: int | None = None
    sha256: str | None = None
    max_size: int | None = None


class _CutOff(Exception):
    """The connection ended before the response did; the next request resumes."""


def download(
    remote: RemoteFile,
    folder: str | Path,
    *,
    progress: bool = True,
    attempts: int = 5,
    retry_wait: float = 2.0,
    timeout: float = 60.0,
) -> Path:
    """Fetch ``remote`` into ``folder / remote.name`` and return that path.

    A whole file already there is kept as it is. A ``.part`` file from an interrupted call
    is resumed.

    Args:
        remote: what to fetch and what it must be.
        folder: where it goes (created when missing).
        progress: a bar on a terminal, one line in a log.
        attempts: requests to make before giving up on a connection that keeps dropping.
        retry_wait: seconds to wait before the third request, and one step more before each
            later one (the second goes at once).
        timeout: seconds without data after which a connection counts as dropped.

    Raises:
        DataError: the server refuses, keeps dropping the connection, offers a file of
            another size, or the file's checksum differs (the bad file is removed).
    """
    check_url(remote.url)
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    dest = folder / remote.name
    if dest.is_file() and (remote.size is None or dest.stat().st_size == remote.size):
        logger.info("%s: already downloaded", dest)
        return dest
    part = folder / f"{remote.name}.part"
    _check_free_space(remote, part)
    total = None
    for attempt in range(1, attempts + 1):
        try:
            total = _fetch(remote, part, progress, timeout)
            break
        except _CutOff as cut:
            have = part.stat().st_size if part.exists() else 0
            if attempt == attempts:
                raise DataError(
                    f"{remote.url}: failed {attempts} times (last: {cut}); "
                    f"{format_count(have, 'B')} are kept in {part}: run the same command "
                    f"again to resume"
                ) from cut
            logger.warning("%s: %s; trying again from byte %d", remote.name, cut, have)
            time.sleep(retry_wait * (attempt - 1))
    _verify(remote, part, total, progress)
    os.replace(part, dest)
    return dest


def check_url(url: str) -> None:
    """Refuse an address that is not ``http://`` or ``https://`` (urllib would also open
    ``file://``, ``ftp://`` and ``data:`` ones)."""
    parts = urllib.parse.urlsplit(url)
    if parts.scheme.lower() not in ("http", "https") or not parts.netloc:
        raise DataError(
            f"{url[:80]!r} is not an http:// or https:// address; downloads "
            f"take only those (check --base-url)"
        )


def _check_free_space(remote: RemoteFile, part: Path) -> None:
    """Refuse early when the disk cannot hold the file and what unpacking it writes."""
    if remote.size is None:
        return
    have = part.stat().st_size if part.exists() else 0
    needed = 2 * remote.size - have
    free = shutil.disk_usage(part.parent).free
    if free < needed:
        raise DataError(
            f"{part.parent}: {remote.name} needs about {format_count(needed, 'B')} free "
            f"(the download and its unpacked files), only {format_count(free, 'B')} are; "
            f"free some space or choose another --root"
        )


def _open(remote: RemoteFile, have: int, timeout: float) -> http.client.HTTPResponse:
    request = urllib.request.Request(remote.url, headers={"User-Agent": "captioning"})
    if have:
        request.add_header("Range", f"bytes={have}-")
    try:
        return urllib.request.urlopen(request, timeout=timeout)  # noqa: S310 (http and https only)
    except urllib.error.HTTPError as exc:
        if exc.code == 416 and have:
            return exc  # type: ignore[return-value]  # the part may already be whole
        raise DataError(
            f"{remote.url}: the server answered {exc.code} {exc.reason}; "
            f"check the address (--base-url) and try again"
        ) from exc
    except (urllib.error.URLError, OSError) as exc:
        reason = getattr(exc, "reason", exc)
        raise DataError(
            f"{remote.url}: cannot connect ({reason}); check the address "
            f"(--base-url) and your connection, then try again"
        ) from exc


def _fetch(remote: RemoteFile, part: Path, progress: bool, timeout: float) -> int:
    """One request, appended to ``part``; returns the whole file's size per the server."""
    have = part.stat().st_size if part.exists() else 0
    if remote.size is not None and have > remote.size:
        part.unlink()  # longer than the real file: it cannot be resumed
        have = 0
    if remote.size is not None and have == remote.size:
        return have
    response = _open(remote, have, timeout)
    with response:
        status = response.status
        if status == 416:  # Range Not Satisfiable: the part holds every byte, or too many
            total = _content_range_total(response.headers.get("Content-Range", ""))
            if total == have:
                return have
            part.unlink()
            raise _CutOff("the server cannot resume this partial file, so it starts over")
        if status == 206 and not response.headers.get("Content-Range", "").startswith(
            f"bytes {have}-"
        ):
            raise DataError(
                f"{remote.url}: the server resumed at another byte than asked "
                f"({response.headers.get('Content-Range')}); try again"
            )
        if status != 206:
            have = 0  # the server ignored the Range header and sends the whole file
        length = response.headers.get("Content-Length")
        total = have + int(length) if length is not None else None
        if remote.size is not None and total is not None and total != remote.size:
            raise DataError(
                f"{remote.url}: the server offers {total} bytes, but {remote.name} has "
                f"{remote.size}; this is not the expected file (check --base-url)"
            )
        if total is not None and remote.max_size is not None and total > remote.max_size:
            part.unlink(missing_ok=True)
            raise _too_large(remote)
        _stream(response, part, have, total, remote, progress)
    written = part.stat().st_size
    if total is not None and written < total:
        raise _CutOff(f"the connection dropped after {written} of {total} bytes")
    return written


def _too_large(remote: RemoteFile) -> DataError:
    return DataError(
        f"{remote.url}: more than {format_count(remote.max_size or 0, 'B')}, the "
        f"most {remote.name} can be; this is not the expected file (check "
        f"--base-url)"
    )


def _stream(
    response: http.client.HTTPResponse,
    part: Path,
    have: int,
    total: int | None,
    remote: RemoteFile,
    progress: bool,
) -> None:
    """Append the response body to ``part`` (from byte ``have``)."""
    bar = progress_bar(
        desc=remote.name,
        total=total,
        unit="B",
        initial=have,
        enabled=progress,
        unit_scale=True,
        unit_divisor=1000,
    )
    written = have
    with open(part, "r+b" if have else "wb") as out:
        out.seek(have)
        out.truncate()
        while True:
            try:
                chunk = response.read(CHUNK_BYTES)
            except (http.client.HTTPException, OSError) as exc:  # reset, timeout, cut off
                bar.close()
                raise _CutOff(f"the connection dropped ({exc or type(exc).__name__})") from exc
            if not chunk:
                break
            written += len(chunk)
            if remote.max_size is not None and written > remote.max_size:
                bar.close()
                out.close()
                part.unlink()
                raise _too_large(remote)
            try:
                out.write(chunk)
            except OSError as exc:
                raise DataError(
                    f"{part}: cannot write ({exc.strerror}); free some space or choose another "
                    f"--root, then run again to resume"
                ) from exc
            bar.update(len(chunk))
    bar.close()


def _content_range_total(header: str) -> int | None:
    """The total of a ``Content-Range: bytes */TOTAL`` header, or None."""
    total = header.rpartition("/")[2]
    return int(total) if total.isdigit() else None


def _verify(remote: RemoteFile, part: Path, total: int | None, progress: bool) -> None:
    """Size and checksum of a finished ``part``; a bad one is removed, then refused."""
    size = part.stat().st_size
    expected = remote.size if remote.size is not None else total
    if expected is not None and size != expected:
        part.unlink()
        raise DataError(
            f"{remote.name}: downloaded {size} bytes, expected {expected}; the file "
            f"was removed, run the command again to fetch it anew"
        )
    if remote.sha256 is None:
        return
    digest = hashlib.sha256()
    bar = progress_bar(
        desc=f"checking {remote.name}",
        total=size,
        unit="B",
        enabled=progress,
        unit_scale=True,
        unit_divisor=1000,
    )
    with open(part, "rb") as handle:
        while chunk := handle.read(CHUNK_BYTES):
            digest.update(chunk)
            bar.update(len(chunk))
    bar.close()
    if digest.hexdigest() != remote.sha256.lower():
        part.unlink()
        raise DataError(
            f"{remote.name}: SHA-256 {digest.hexdigest()[:16]}... differs from the published "
            f"{remote.sha256[:16]}...; the damaged download was removed, run the command "
            f"again to fetch it anew"
        )


def unpack(
    archive: str | Path,
    dest: str | Path,
    *,
    keep: Callable[[str], bool] | None = None,
    max_bytes: int | None = None,
    progress: bool = True,
) -> list[str]:
    """Extract the members of a zip archive into ``dest``; returns their names.

    Every member is read in full, so its CRC-32 is checked. A damaged archive (not a zip, a
    truncated directory, a member whose CRC differs) is removed and refused; a member whose
    name is absolute or climbs out of ``dest``, members that unpack to more than
    ``max_bytes`` or to more than the disk has free, are refused before anything is written.
    A write that fails (a full disk) removes the member it was writing and keeps the
    archive, so that the same command starts over.

    Args:
        archive: the zip file.
        dest: the folder the members' paths are relative to.
        keep: which member names to extract (all when None).
        max_bytes: the most bytes the extracted members may hold together (None: no bound;
            a zip member never unpacks to more than the size its entry states).
        progress: a bar on a terminal, one line in a log.

    Raises:
        DataError: a damaged or oversized archive, a member outside ``dest``, too little
            space, or a write that fails (in one line that says what to do).
    """
    archive, dest = Path(archive), Path(dest)
    try:
        with zipfile.ZipFile(archive) as zf:
            members = [m for m in zf.infolist() if keep is None or keep(m.filename)]
            for member in members:
                _check_member_name(archive, member.filename)
            _check_unpacked_size(archive, dest, members, max_bytes)
            # No summary line: the caller logs what was unpacked.
            bar = progress_bar(
                desc=f"unpacking {archive.name}",
                total=len(members),
                unit="file",
                enabled=progress,
                summary=False,
            )
            for member in members:
                _extract(zf, member, archive, dest)
                bar.update()
            bar.close()
    except (zipfile.BadZipFile, zipfile.LargeZipFile, zlib.error, EOFError, ValueError) as exc:
        archive.unlink(missing_ok=True)
        raise DataError(
            f"{archive}: the archive is damaged ({exc}); it was removed, run the "
            f"command again to download it anew"
        ) from exc
    return [m.filename for m in members]


def _check_unpacked_size(
    archive: Path, dest: Path, members: list[zipfile.ZipInfo], max_bytes: int | None
) -> None:
    """Refuse members that unpack to more than ``max_bytes`` (a zip bomb, or not the
    expected archive: it is removed), or to more than ``dest``'s disk has free."""
    total = sum(m.file_size for m in members)
    if max_bytes is not None and total > max_bytes:
        archive.unlink(missing_ok=True)
        raise DataError(
            f"{archive}: unpacks to {format_count(total, 'B')}, more than the "
            f"{format_count(max_bytes, 'B')} this archive can hold; it is not the expected "
            f"file and was removed (check --base-url)"
        )
    dest.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(dest).free
    if total > free:
        raise DataError(
            f"{dest}: {archive.name} unpacks to {format_count(total, 'B')}, only "
            f"{format_count(free, 'B')} are free; free some space or choose "
            f"another --root, then run the same command again"
        )


def _extract(zf: zipfile.ZipFile, member: zipfile.ZipInfo, archive: Path, dest: Path) -> None:
    """Extract one member; a failed write (a full disk) removes what it wrote."""
    try:
        zf.extract(member, dest)
    except OSError as exc:
        if not member.is_dir():
            with contextlib.suppress(OSError):
                (dest / member.filename).unlink(missing_ok=True)
        raise DataError(
            f"{dest}: cannot write {member.filename[:60]} from {archive.name} "
            f"({exc.strerror or exc}); free some space or choose another --root, then run "
            f"the same command again (the archive is kept)"
        ) from exc


def _check_member_name(archive: Path, name: str) -> None:
    path = PurePosixPath(name.replace("\\", "/"))
    if path.is_absolute() or ".." in path.parts or "\x00" in name:
        raise DataError(
            f"{archive}: member {name[:60]!r} would be written outside the "
            f"target folder; the archive is not a dataset archive"
        )
