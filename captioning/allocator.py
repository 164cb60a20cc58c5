"""The C allocator under torch's CPU tensors: memory a step frees stays for the next step.

Imports nothing but ctypes, so the command line can set it before anything is allocated.
"""

from __future__ import annotations

import ctypes

# glibc's mallopt parameters (malloc.h), and the largest mmap threshold it takes on 64 bits
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
_MMAP_THRESHOLD_MAX = 32 << 20


def keep_freed_memory() -> bool:
    """Keep the memory torch frees inside the process for its next tensors, instead of
    handing it back to the kernel (glibc, which Linux runs; elsewhere nothing changes).
    Returns whether it applied.

    glibc's malloc serves each block of more than 128 kB (raised to the largest it has
    freed, at most 32 MB) from pages of its own that go back to the kernel when freed,
    and gives back the free top of its heap above twice that. A training step allocates and
    frees the same hundreds of megabytes every step, so every step the kernel hands out and
    zeroes those pages again, one fault per 4 kB page (11,000 to 14,000 a step of the
    COCO-size decoder). Blocks up to 32 MB then come from the heap, whose free memory stays
    in the process: it holds its peak, which it needed anyway. What that buys depends on
    what a fault costs the host: 1.14 times the COCO-size step in fp32 on one, nothing
    measurable on another (``benchmarks/allocator.py``, docs/speed.md)."""
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):  # not glibc: its own allocator
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    return bool(
        mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD_MAX) and mallopt(_M_TRIM_THRESHOLD, 2**31 - 1)
    )
