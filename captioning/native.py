"""Small C kernels, built on first use with the machine's C compiler and kept in a cache.

A kernel is one C file in the package. :func:`load` compiles it for this CPU
(``-march=native``, OpenMP) into ``$XDG_CACHE_HOME/captioning/native`` (``~/.cache`` by
default; ``CAPTIONING_NATIVE_CACHE`` overrides it) under a name that hashes the source, the
compiler, its flags and the CPU, and loads it with ctypes. Where it cannot be built (no
compiler, a compiler without OpenMP, not Linux, ``CAPTIONING_NATIVE=0``), :func:`load`
returns None and the caller runs its torch form: a kernel only ever buys time.

The kernels' OpenMP must be torch's: on Linux the library's ``libgomp.so.1`` resolves to the
one torch has already loaded, so its parallel loops run on torch's threads, as many as
``torch.set_num_threads`` says. Where torch is not on libgomp, no kernel loads.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import sysconfig
import tempfile
from pathlib import Path

import torch

from captioning.runtime import cpuinfo_field

log = logging.getLogger(__name__)

FLAGS = ("-O3", "-march=native", "-fno-math-errno", "-fopenmp", "-shared", "-fPIC")


def compiler() -> str | None:
    """The C compiler: ``$CC``, Python's own, or the first of cc, gcc and clang found."""
    names = [os.environ.get("CC", ""), (sysconfig.get_config_var("CC") or "").split(" ")[0]]
    return next(
        (
            found
            for name in [*names, "cc", "gcc", "clang"]
            if name and (found := shutil.which(name))
        ),
        None,
    )


def cache_dir() -> Path:
    if os.environ.get("CAPTIONING_NATIVE_CACHE"):
        return Path(os.environ["CAPTIONING_NATIVE_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "captioning" / "native"


def _torch_openmp() -> bool:
    """Whether torch's parallel loops run on a libgomp this process has loaded."""
    if platform.system() != "Linux" or "OpenMP" not in torch.__config__.parallel_info():
        return False
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return False
    return "libgomp" in maps


@functools.cache
def load(source: Path) -> ctypes.CDLL | None:
    """The kernel of C file ``source``, compiled for this machine, or None where it cannot be
    (the reason is logged)."""
    if os.environ.get("CAPTIONING_NATIVE", "1") == "0":
        return None
    if not _torch_openmp():
        log.info("%s: torch does not run on libgomp here; using the torch form", source.name)
        return None
    cc = compiler()
    if cc is None:
        log.info("%s: no C compiler found (set CC); using the torch form", source.name)
        return None
    try:
        return ctypes.CDLL(str(_build(source, cc)))
    except (OSError, subprocess.SubprocessError) as error:
        stderr = getattr(error, "stderr", None) or b""
        reason = stderr.decode(errors="replace").strip().splitlines()[-1:] or [str(error)]
        log.warning("%s could not be built (%s); using the torch form", source.name, reason[0])
        return None


def _build(source: Path, cc: str) -> Path:
    """The shared library of ``source``: from the cache, else compiled into it."""
    code = source.read_bytes()
    version = subprocess.run([cc, "--version"], capture_output=True, check=True, timeout=60)
    key = hashlib.sha256()
    for part in (code, version.stdout, " ".join(FLAGS).encode(), platform.machine().encode()):
        key.update(part)
    key.update(cpuinfo_field("model name").encode() + cpuinfo_field("flags").encode())
    folder = cache_dir()
    target = folder / f"{source.stem}-{key.hexdigest()[:16]}.so"
    if target.exists():
        return target
    folder.mkdir(parents=True, exist_ok=True)
    # Written under a name of its own and renamed: processes that build at once (torchrun)
    # each finish a whole file, and none loads a half-written one.
    handle, partial = tempfile.mkstemp(suffix=".so", dir=folder)
    os.close(handle)
    try:
        subprocess.run(
            [cc, *FLAGS, str(source), "-o", partial, "-lm"],
            capture_output=True,
            check=True,
            timeout=300,
        )
        os.replace(partial, target)
    finally:
        if os.path.exists(partial):
            os.unlink(partial)
    return target
