"""Ctrl-C at every bytecode of code that hands work to threads, as data.

    python -m tests.interrupt_sweep ours            # captioning.runtime.map_in_threads
    python -m tests.interrupt_sweep executor        # concurrent.futures.ThreadPoolExecutor.map
    python -m tests.interrupt_sweep events          # captioning.training.events.EventLog
    python -m tests.interrupt_sweep summary-writer  # TensorBoard's SummaryWriter as it is
    python -m tests.interrupt_sweep loader          # a DataLoader's workers, through batches
    python -m tests.interrupt_sweep plain-loader threading.py:__enter__

A second argument sweeps only the bytecodes of one file (and function): the one above
lands only where a ``threading.Condition`` has taken its lock.

A trace function raises ``KeyboardInterrupt`` at the caller's n-th bytecode (or at the first
one after it where Ctrl-C is not held back, as a signal that ``signals_deferred`` holds
lands once the block ends), for n = 1, 2, ... until a run ends before its n-th bytecode. A
signal's handler can raise only where a bytecode starts, so this reaches every place a real
Ctrl-C can. A run that has not returned, or whose threads that are no daemons have not
ended, five seconds in has hung: the sweep prints where, with every thread's stack, and
exits 3; a run that fails without an interrupt (an earlier one broke what it shares with
the next) exits 4. A daemon thread still running half a second after its run is counted (it cannot
hold the process, but it never ended). Exit 0 says how many points it swept.
"""

from __future__ import annotations

import argparse
import faulthandler
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from captioning.runtime import batches, map_in_threads
from captioning.training.events import EventLog

HUNG = 5.0  # seconds: a run of six tiny items takes milliseconds


ITEMS = range(6)


def square(x: int) -> int:
    time.sleep(0.0005)  # long enough for the caller to wait on a worker
    return x * x


def ours() -> list[int]:
    return list(map_in_threads(square, ITEMS, 3))


def executor() -> list[int]:
    with ThreadPoolExecutor(3) as pool:
        return list(pool.map(square, ITEMS))


def events() -> list[int]:
    """A training's TensorBoard log: made, a scalar per item, closed."""
    log = EventLog(FOLDER)
    try:
        for x in ITEMS[:2]:  # every trial makes a writer: a few milliseconds
            log.scalars({"square": square(x)}, x)
    finally:
        log.close()
    return [x * x for x in ITEMS]  # what every run returns


def summary_writer() -> list[int]:
    """The same with TensorBoard's writer as it is."""
    from torch.utils.tensorboard import SummaryWriter

    writer = SummaryWriter(FOLDER)
    try:
        for x in ITEMS[:2]:
            writer.add_scalar("square", square(x), x)
    finally:
        writer.close()
    return [x * x for x in ITEMS]


def _loader():
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    return DataLoader(TensorDataset(torch.arange(24.0)), batch_size=4, num_workers=2)


def loader() -> list[int]:
    """A DataLoader with two worker processes, read through ``batches``."""
    return [int(x) ** 2 for (batch,) in batches(_loader()) for x in batch]


def plain_loader() -> list[int]:
    """The same read as it is."""
    return [int(x) ** 2 for (batch,) in _loader() for x in batch]


RUNS = {
    "ours": ours,
    "executor": executor,
    "events": events,
    "summary-writer": summary_writer,
    "loader": loader,
    "plain-loader": plain_loader,
}
FOLDER = tempfile.mkdtemp(prefix="interrupt_sweep_")


class Interrupt:
    """A trace (``sys.settrace``) that raises ``KeyboardInterrupt`` at the n-th bytecode."""

    def __init__(self, n: int, only: str = "") -> None:
        self.n, self.count, self.fired, self.where = n, 0, False, ""
        # count only the bytecodes of the files whose path ends so (and of the function
        # named after a colon): "threading.py:__enter__", where a Condition takes its lock
        self.only, _, self.function = only.partition(":")

    def __call__(self, frame, event, arg):
        frame.f_trace_opcodes = True
        return self.local

    def local(self, frame, event, arg):
        code = frame.f_code
        counted = code.co_filename.endswith(self.only) and self.function in ("", code.co_name)
        if event == "opcode" and not self.fired and counted:
            self.count += 1
            if self.count >= self.n and not _held():
                self.fired = True
                self.where = f"{frame.f_code.co_filename}:{frame.f_lineno} {frame.f_code.co_name}"
                raise KeyboardInterrupt
        return self.local


def _held() -> bool:
    """Whether Ctrl-C is held back now (``captioning.signals.signals_deferred``)."""
    return signal.getsignal(signal.SIGINT) is not signal.default_int_handler


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("run", choices=RUNS, help="what the sweep interrupts")
    parser.add_argument("only", nargs="?", default="", help="FILE or FILE:FUNCTION to sweep")
    args = parser.parse_args()
    run, only = RUNS[args.run], args.only
    began, point, current = [time.monotonic()], [1], [Interrupt(0)]
    seen: set[int | None] = set()  # daemon threads earlier runs left, waiting forever

    def watchdog() -> None:
        while True:
            time.sleep(0.5)
            if time.monotonic() - began[0] > HUNG:
                print(f"hung at bytecode {point[0]} ({current[0].where})", flush=True)
                faulthandler.dump_traceback(all_threads=True)  # to stderr: where each waits
                os._exit(3)

    watching = threading.Thread(target=watchdog, daemon=True)
    watching.start()
    signal.signal(signal.SIGINT, signal.default_int_handler)
    expected = run()  # once untraced: what it imports is imported whole, as in a run that
    # got this far
    strays, points = 0, 0
    while True:
        began[0] = time.monotonic()
        trace = current[0] = Interrupt(point[0], only)
        sys.settrace(trace)
        error: BaseException | None = None
        try:
            results = run()
        except BaseException as exc:  # noqa: BLE001  (the interrupt, or what it broke on its way)
            results, error = None, exc
        finally:
            sys.settrace(None)
        ours = (threading.main_thread(), watching)
        started = [t for t in threading.enumerate() if t not in ours and t.ident not in seen]
        # a thread that is no daemon holds the process at its end: it must end
        while any(t.is_alive() and not t.daemon for t in started):
            time.sleep(0.001)
        settle = time.monotonic() + 0.5  # a daemon finishing the item in hand
        while any(t.is_alive() for t in started) and time.monotonic() < settle:
            time.sleep(0.001)
        left = [t for t in started if t.is_alive()]
        strays += bool(left)
        if left:  # which thread, and where the interrupt landed: what a failing test shows
            names = ", ".join(t.name for t in left)
            print(f"bytecode {point[0]} ({trace.where}): {names} still running", flush=True)
        seen.update(t.ident for t in left)
        if not trace.fired and results != expected:  # what an earlier interrupt broke
            print(f"broken after bytecode {point[0] - 1}: {error!r}"[:300], flush=True)
            return 4
        if not trace.fired:
            print(f"{points} points, none hung, {strays} left a daemon thread", flush=True)
            return 0
        points += 1
        point[0] = trace.count + 1  # the bytecodes up to where it landed all land there


if __name__ == "__main__":
    try:
        code = main()
    finally:
        shutil.rmtree(FOLDER, ignore_errors=True)
    sys.exit(code)
