"""Peak memory of one measurement, and a description of the machine a benchmark ran on.

Peak memory is the high-water mark during a measurement minus the memory in use just before
it. On CUDA it comes from ``torch.cuda.max_memory_allocated``. On CPU it is the process's
resident set (``VmHWM`` of /proc/self/status, reset through /proc/self/clear_refs, after
``malloc_trim`` has handed freed heap pages back); it counts everything the process touches,
allocator caches included, so read it as an approximation. Where /proc is missing it falls
back to the growth of ``ru_maxrss``, which stays at zero until a measurement exceeds every
earlier peak.
"""

from __future__ import annotations

import ctypes
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

import torch

from lab.provenance import cpu_model

CPU_MEMORY_METHODS = {
    "vmhwm": "peak resident set (VmHWM, reset by /proc/self/clear_refs after malloc_trim) "
    "minus VmRSS before",
    "ru_maxrss": "growth of ru_maxrss (the process's lifetime peak): a lower bound, often 0",
}


def _proc_status_mb(key: str) -> float | None:
    """A kB field of /proc/self/status (VmRSS, VmHWM) in MiB, or None without /proc."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def _reset_rss_peak() -> bool:
    """Reset VmHWM to the current resident set (Linux: ``echo 5 > /proc/self/clear_refs``)."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return False
    return True


def _release_free_memory() -> None:
    """Hand freed heap pages back to the system (glibc ``malloc_trim``), so that the next
    measurement's peak is not hidden in pages an earlier one left resident."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _ru_maxrss_mb() -> float:
    import resource

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / 2**20 if sys.platform == "darwin" else peak / 1024  # bytes there, kB here


def cpu_memory_method() -> str:
    """How CPU peaks are measured here: ``vmhwm`` where /proc allows it, else ``ru_maxrss``
    (the keys of ``CPU_MEMORY_METHODS``)."""
    return "vmhwm" if _proc_status_mb("VmHWM") is not None and _reset_rss_peak() else "ru_maxrss"


class PeakMemory:
    """Peak memory above the memory in use when :meth:`start` ran, in MiB.

    Args:
        device: CUDA counts tensors (``max_memory_allocated``); CPU counts the resident set
            of the whole process (see the module notes).
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.method = "cuda" if device.type == "cuda" else cpu_memory_method()
        self.before = 0.0

    def start(self) -> None:
        """Note the memory in use now and reset the high-water mark."""
        if self.method == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self.before = torch.cuda.memory_allocated(self.device) / 2**20
        elif self.method == "vmhwm":
            _release_free_memory()
            _reset_rss_peak()
            self.before = _proc_status_mb("VmRSS") or 0.0
        else:
            self.before = _ru_maxrss_mb()

    def stop(self) -> tuple[float, float]:
        """(peak above the start, absolute peak) in MiB."""
        if self.method == "cuda":
            torch.cuda.synchronize(self.device)
            peak = torch.cuda.max_memory_allocated(self.device) / 2**20
        elif self.method == "vmhwm":
            peak = _proc_status_mb("VmHWM") or 0.0
        else:
            peak = _ru_maxrss_mb()
        return max(peak - self.before, 0.0), peak


def environment(devices: list[torch.device]) -> dict[str, Any]:
    """Versions, hardware and threads of this run.

    Args:
        devices: the devices benchmarked (the GPU is named when CUDA is among them).
    """
    cuda = any(d.type == "cuda" for d in devices)
    return {
        "torch": torch.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu": cpu_model(),
        "cpu_count": os.cpu_count(),
        "threads": torch.get_num_threads(),
        "cuda": torch.version.cuda,
        "gpu": torch.cuda.get_device_name(0) if cuda else None,
        "devices": [d.type for d in devices],
        "cpu_memory": CPU_MEMORY_METHODS[cpu_memory_method()],
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
