"""Where and how code runs: device choice, seeding, mixed precision, and threads.

Every layer may import this module; it imports nothing from the rest of the package but its
errors.
"""

from __future__ import annotations

import contextlib
import logging
import random
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import torch

from captioning.errors import CaptioningError

T = TypeVar("T")
logger = logging.getLogger("captioning")


def resolve_device(name: str) -> torch.device:
    """``auto`` picks CUDA when present, else CPU; any other name is used as given."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except (RuntimeError, TypeError):
        device = None
    if device is None or device.type not in ("cpu", "cuda", "mps"):
        raise CaptioningError(f"unknown device {name[:40]!r}; use auto, cpu, cuda or cuda:N")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise CaptioningError(f"device {name} asked for but CUDA is not available; use cpu or auto")
    if device.type == "cuda" and (device.index or 0) >= torch.cuda.device_count():
        count = torch.cuda.device_count()
        raise CaptioningError(
            f"device {name}: this machine has {count} CUDA devices (cuda:0 to cuda:{count - 1})"
        )
    if device.type == "mps" and not torch.backends.mps.is_available():
        raise CaptioningError(f"device {name} asked for but MPS is not available; use cpu or auto")
    return device


def seed_everything(seed: int) -> None:
    """Seed Python's, NumPy's and torch's global generators."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def native_bf16(device: torch.device) -> bool:
    """Whether ``device`` computes in bf16 natively: a CUDA GPU that supports it, or a CPU
    with AVX-512 BF16 or AMX. Elsewhere bf16 autocast is emulated and several times slower
    than fp32."""
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    if device.type != "cpu":
        return False
    return bool({"avx512_bf16", "amx_bf16"} & cpu_flags())


def cpu_flags() -> set[str]:
    """The CPU's feature flags from /proc/cpuinfo (empty where there is none)."""
    try:
        cpuinfo = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    line = next((line for line in cpuinfo.splitlines() if line.startswith("flags")), "")
    return set(line.split(":", 1)[-1].split())


def resolve_precision(precision: str, device: torch.device) -> str:
    """``auto`` becomes ``bf16`` where ``device`` runs it natively, else ``fp32``; any other
    precision is kept."""
    if precision != "auto":
        return precision
    return "bf16" if native_bf16(device) else "fp32"


def autocast(device: torch.device, precision: str) -> contextlib.AbstractContextManager:
    """Mixed precision (``bf16`` or ``fp16``; ``auto``: see :func:`resolve_precision`) for a
    forward pass; ``fp32`` is a no-op."""
    precision = resolve_precision(precision, device)
    if precision == "fp32":
        return contextlib.nullcontext()
    dtype = torch.bfloat16 if precision == "bf16" else torch.float16
    return torch.autocast(device_type=device.type, dtype=dtype)


def in_passing_thread(function: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """``function(*args, **kwargs)`` run on a thread of its own that ends with it; its
    result, or its exception raised here.

    For a process whose model runs on another thread (the web demo's batcher): OpenMP gives
    every thread that runs a parallel operation a team of its own, which lives as long as
    that thread. Once a process holds more OpenMP threads than there are cores, libgomp
    stops spinning between parallel regions, and a beam search's many small operations then
    take about twice as long (17 against 33 ms a photo caption on 2 cores). Loading the model
    on a passing thread leaves the calling thread without a team."""
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="passing") as pool:
        return pool.submit(function, *args, **kwargs).result()  # the thread ends on exit
