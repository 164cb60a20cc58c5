"""The C allocator keeps what a step frees (captioning.allocator): once a step's blocks have
been allocated, the next step's come from the same pages and fault none in, where glibc's
default hands the freed heap back to the kernel and faults it in again every step."""

import subprocess
import sys
from pathlib import Path

import pytest

from captioning.allocator import keep_freed_memory

ROOT = Path(__file__).resolve().parents[1]

STEPS = """
import ctypes, resource, sys
from captioning.allocator import keep_freed_memory
if sys.argv[1] == "keep":
    assert keep_freed_memory()
libc = ctypes.CDLL(None)
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
SIZE = 20 << 20

def step():  # ten blocks of 20 MB written and freed, as a step's tensors are
    blocks = [libc.malloc(SIZE) for _ in range(10)]
    for block in blocks:
        ctypes.memset(block, 1, SIZE)
    for block in reversed(blocks):
        libc.free(block)

for _ in range(3):  # the heap settles in the first steps
    step()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(3):
    step()
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def page_faults(mode: str) -> int:
    """Pages faulted in over three steps after three, with the allocator as ``mode`` says."""
    result = subprocess.run(
        [sys.executable, "-c", STEPS, mode],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
        env={"PYTHONPATH": str(ROOT)},
    )
    return int(result.stdout.split()[-1])


def test_a_step_reuses_the_pages_the_last_one_freed():
    if not keep_freed_memory():
        pytest.skip("not glibc: the platform's allocator is left as it is")
    default, kept = page_faults("default"), page_faults("keep")
    assert default > 100_000, default  # 3 x 200 MB in 4 kB pages: 153,600
    assert kept < 1_000, kept
