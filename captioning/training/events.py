"""TensorBoard scalars of a run (``events.out.tfevents.*`` in its folder), safe to stop.

TensorBoard's writer hands every event to a thread of its own through a ``queue.Queue``. A
Ctrl-C or SIGTERM whose exception lands while the command's thread holds the queue's lock
(inside ``Condition.__enter__``, between taking the lock and entering the block) leaves the
lock taken: the writer's thread then waits on it, and ``close()``, which waits for that
thread to empty the queue, waits forever. So every call into the writer runs with both
signals held back (``signals_deferred``); a write takes microseconds, the first one and
closing a few milliseconds. A signal in the few bytecodes of a call into this class, before
it holds them back, leaves the writer open: it is closed at the interpreter's exit.
``python -m tests.interrupt_sweep events`` sweeps a Ctrl-C over every bytecode of a log's
life (in ``tests/test_runtime.py``).
"""

from __future__ import annotations

import atexit
from collections.abc import Mapping
from pathlib import Path

from captioning.signals import signals_deferred


class EventLog:
    """Scalars by tag and step into ``folder``'s TensorBoard event file, made at the first
    write (so a run stopped before it leaves no writer thread behind)."""

    def __init__(self, folder: str | Path) -> None:
        self.folder = Path(folder)
        self._writer = None

    def scalars(self, values: Mapping[str, float], step: int) -> None:
        """``values`` by tag at ``step``."""
        with signals_deferred():
            if self._writer is None:
                from torch.utils.tensorboard import SummaryWriter

                self._writer = SummaryWriter(str(self.folder))
                atexit.register(self.close)  # a signal just before close() is called
            for tag, value in values.items():
                self._writer.add_scalar(tag, float(value), step)

    def close(self) -> None:
        """Write out what is queued and end the writer's thread. A Ctrl-C or SIGTERM that
        lands before the signals are held back still lets it close, then stops the run."""
        stop: BaseException | None = None
        while self._writer is not None:
            writer = self._writer
            try:
                with signals_deferred():
                    self._writer = None
                    atexit.unregister(self.close)
                    writer.close()
            except BaseException as exc:  # noqa: BLE001  (raised once it is closed)
                if self._writer is None:  # from the close, or a signal held back during it
                    raise
                stop = stop or exc  # came before the block began: close first
        if stop is not None:
            raise stop
