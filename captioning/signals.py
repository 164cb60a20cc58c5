"""Ctrl-C and SIGTERM: what stops a run, and the file writes they wait for.

Every verb of the command line runs inside :func:`stops_on_signals`: Ctrl-C (SIGINT) raises
``KeyboardInterrupt`` and SIGTERM raises :class:`captioning.errors.Terminated` wherever the
main thread is, so the run unwinds (temporary files go, locks are released) and the CLI
exits 130 or 143 with one line. That holds for a run a script started in the background,
which inherits SIGINT ignored: a signal sent to a run is meant for it. A file write runs
inside :func:`signals_deferred`, which holds both back until the write is done and then
delivers them, even when the write failed. docs/runs.md says what each signal does at each
point of a run; ``tests/test_signals.py`` and the slow ``tests/test_signal_stress.py`` hold it.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from captioning.errors import Terminated

DEFERRED_SIGNALS = (signal.SIGINT, signal.SIGTERM)
Handler = Callable[[int, Any], Any] | int | None


def _in_main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


def _terminate(signum: int, frame: Any) -> None:
    raise Terminated


def _install(handlers: dict[int, Handler]) -> None:
    """Set each signal's handler, every one of them even if a signal arrives meanwhile and
    a handler set a moment before raises; that exception comes out after the last one."""
    error: BaseException | None = None
    for signum, handler in handlers.items():
        while True:
            try:
                signal.signal(signum, signal.SIG_DFL if handler is None else handler)
                break
            except BaseException as exc:  # noqa: BLE001  (a signal's exception, kept)
                error = error or exc
    if error is not None:
        raise error


@contextlib.contextmanager
def _handlers(handlers: dict[int, Handler]) -> Iterator[None]:
    """The block with ``handlers`` in place, and the previous ones back after it, all of
    them whatever arrives while they are swapped."""
    previous = {signum: signal.getsignal(signum) for signum in handlers}
    try:
        _install(handlers)
        yield
    finally:
        _install(previous)


@contextlib.contextmanager
def sigterm_raises() -> Iterator[None]:
    """Within the block, SIGTERM (how a cluster preempts a job, and what ``kill`` sends)
    raises :class:`captioning.errors.Terminated`, which unwinds like Ctrl-C: a checkpoint
    write finishes, temporary files go, locks are released. Main thread only."""
    if not _in_main_thread():
        yield
        return
    with _handlers({signal.SIGTERM: _terminate}):
        yield


@contextlib.contextmanager
def stops_on_signals() -> Iterator[None]:
    """A command's whole run: Ctrl-C raises ``KeyboardInterrupt`` (even where the process
    inherited it ignored, as a script's ``command &`` does) and SIGTERM raises
    ``Terminated``, from the first line of the command to its last. Both are held back
    while the handlers are swapped in and out, and unblocked for the run even where the
    process inherited them blocked; the inherited mask is back after it. Main thread only
    (a mask is a thread's)."""
    if not _in_main_thread():
        yield
        return
    with (
        _held(),
        _handlers({signal.SIGINT: signal.default_int_handler, signal.SIGTERM: _terminate}),
    ):
        _mask(signal.SIG_UNBLOCK)
        try:
            yield
        finally:
            _mask(signal.SIG_BLOCK)


@contextlib.contextmanager
def _held() -> Iterator[None]:
    """SIGINT and SIGTERM blocked (left pending, not lost) from the block's start, and the
    previous mask back at its end; a signal that was pending then goes to the handler
    in place at that moment."""
    previous = _mask(signal.SIG_BLOCK)
    try:
        yield
    finally:
        if previous is not None:
            _mask(signal.SIG_SETMASK, previous)


def _mask(how: int, signals: Iterable[int] = DEFERRED_SIGNALS) -> set[int] | None:
    """``signal.pthread_sigmask`` where the platform has one (not Windows): the mask before."""
    if not hasattr(signal, "pthread_sigmask"):
        return None
    return signal.pthread_sigmask(how, signals)


@contextlib.contextmanager
def signals_deferred() -> Iterator[None]:
    """Hold back Ctrl-C (SIGINT) and SIGTERM until the block is done, then deliver them to
    the handlers that were in place, also when the block raised (the signal's exception
    then carries the block's as its context): a file write is never cut in the middle, and
    a signal that came during one is never dropped. Only the main thread can do this;
    elsewhere the block runs as it is."""
    if not _in_main_thread():
        yield
        return
    received: list[int] = []

    def defer(signum: int, frame: Any) -> None:
        received.append(signum)

    try:
        with _handlers(dict.fromkeys(DEFERRED_SIGNALS, defer)):
            yield
    finally:
        for signum in dict.fromkeys(received):
            signal.raise_signal(signum)  # Ctrl-C: KeyboardInterrupt; SIGTERM: its handler's
