"""Where and how code runs: device choice, seeding, mixed precision, and threads.

Every layer may import this module; it imports nothing from the rest of the package but its
errors and signals.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import random
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import torch

from captioning.errors import CaptioningError
from captioning.signals import signals_deferred

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
    return set(cpuinfo_field("flags").split())


@functools.cache
def cpu_vendor() -> str:
    """The CPU maker's name as the CPU gives it (``GenuineIntel``, ``AuthenticAMD``), from
    /proc/cpuinfo; empty where there is none."""
    return cpuinfo_field("vendor_id")


def cpuinfo_field(name: str) -> str:
    """The first CPU's ``name`` field in /proc/cpuinfo, or ''."""
    try:
        cpuinfo = Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""
    line = next((line for line in cpuinfo.splitlines() if line.startswith(name)), "")
    return line.partition(":")[2].strip()


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


_PENDING = object()  # a slot of map_in_threads not filled yet
_END = object()  # a loader with no batch left
_POLL = 0.002  # seconds between the caller's looks at a result not there yet
_FINISH = 10.0  # seconds a stopped map waits for its workers' items in hand, at most


def map_in_threads(function: Callable[[Any], T], items: Sequence[Any], workers: int) -> Iterator[T]:
    """``function(item)`` for every item on ``workers`` threads of its own, yielded in the
    order of ``items`` (an exception raised on the caller's thread when its item's turn
    comes), as ``ThreadPoolExecutor.map`` does, but safe to stop with Ctrl-C or SIGTERM.

    A signal's exception lands between any two bytecodes of the main thread. One that lands
    while ``ThreadPoolExecutor`` takes a lock of its own (in ``submit``, or inside a
    ``Condition`` on the way to a wait) leaves the lock taken: the workers block on it, and
    the executor's exit waits for them forever. Here the caller shares no lock with the
    workers: they start with both signals held back (``Thread.start`` waits on a lock the new
    thread takes), each writes its own slots of a list, and the caller reads the list between
    short sleeps. When the caller stops (an exception, or the iterator closed), every worker
    finishes the item in hand and takes no other; the caller waits for that, at most
    ``_FINISH`` seconds (the workers are daemons, so a process can always end)."""
    if workers < 1:
        raise ValueError(f"workers must be at least 1, got {workers}")
    items = list(items)
    slots: list[Any] = [_PENDING] * len(items)
    stop = threading.Event()
    stride = min(workers, len(items))

    def work(first: int) -> None:
        for index in range(first, len(items), stride):
            if stop.is_set():
                return
            try:
                slots[index] = (True, function(items[index]))
            except BaseException as exc:  # noqa: BLE001  (raised on the caller's thread)
                slots[index] = (False, exc)

    threads = [threading.Thread(target=work, args=(k,), daemon=True) for k in range(stride)]
    try:
        with signals_deferred():
            for thread in threads:
                thread.start()
        for index in range(len(items)):
            while (slot := slots[index]) is _PENDING:
                if not threads[index % stride].is_alive() and slots[index] is _PENDING:
                    raise RuntimeError(f"the worker for item {index} ended without a result")
                time.sleep(_POLL)
            ok, value = slot
            slots[index] = None  # the caller holds it now
            if not ok:
                raise value
            yield value
    finally:
        stop.set()  # the workers never take this lock: they only read the flag
        deadline = time.monotonic() + _FINISH
        for thread in threads:
            if thread.ident is not None:  # started
                thread.join(max(0.0, deadline - time.monotonic()))


def batches(loader: Iterable[Any]) -> Iterator[Any]:
    """The batches of ``loader`` (a ``DataLoader``); with worker processes, each one fetched,
    and the workers started and shut down, with Ctrl-C and SIGTERM held back.

    A loader with workers hands them indices through ``multiprocessing`` queues, whose
    ``put`` takes a ``threading.Condition``: a signal's exception that lands there leaves its
    lock taken, and the loader's shutdown, which puts to the same queue, then waits forever
    (``python -m tests.interrupt_sweep loader``). Held back, a signal stops the run once the
    batch in hand has come: at once from a loader whose workers the signal stopped too (it
    notices within seconds), as long as a batch takes from one that works on."""
    if not getattr(loader, "num_workers", 0):  # no worker, no queue: nothing to hold
        yield from loader
        return
    iterator: Any = None
    try:
        with signals_deferred():
            iterator = iter(loader)
        while True:
            with signals_deferred():
                batch = next(iterator, _END)
            if batch is _END:
                return
            yield batch
    finally:
        with signals_deferred():
            iterator = None  # its workers shut down here (a persistent one's stay the loader's)


def in_passing_thread(function: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """``function(*args, **kwargs)`` run on a thread of its own that ends with it; its
    result, or its exception raised here. Safe to stop with Ctrl-C (see
    :func:`map_in_threads`).

    For a process whose model runs on another thread (the web demo's batcher): OpenMP gives
    every thread that runs a parallel operation a team of its own, which lives as long as
    that thread. Once a process holds more OpenMP threads than there are cores, libgomp
    stops spinning between parallel regions, and a beam search's many small operations then
    take about twice as long (17 against 33 ms a photo caption on 2 cores). Loading the model
    on a passing thread leaves the calling thread without a team."""
    (result,) = map_in_threads(lambda _: function(*args, **kwargs), [None], 1)
    return result  # the thread has ended: the map waits for its workers
