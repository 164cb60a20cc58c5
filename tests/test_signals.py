"""Ctrl-C and SIGTERM (captioning.signals): a write finishes and the signal is then delivered,
even when the write fails; the handlers come back whatever lands while they are swapped; a
command stops on either signal from its first line, also where a script started it with
Ctrl-C ignored. The slow tests/test_signal_stress.py signals whole runs at many points."""

import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from captioning import signals
from captioning.errors import Terminated
from captioning.signals import signals_deferred, sigterm_raises, stops_on_signals

ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "configs" / "test_tiny.yaml")


@pytest.fixture
def ctrl_c_raises():
    """Python's own Ctrl-C handler for the test (pytest may run with it ignored)."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


def test_a_signal_during_the_block_comes_after_it(ctrl_c_raises):
    done = []
    with pytest.raises(KeyboardInterrupt):
        with signals_deferred():
            os.kill(os.getpid(), signal.SIGINT)
            done.append("the rest of the write")
    assert done == ["the rest of the write"]


def test_a_signal_during_a_write_that_fails_is_still_delivered(ctrl_c_raises):
    with pytest.raises(KeyboardInterrupt) as stopped:
        with signals_deferred():
            os.kill(os.getpid(), signal.SIGINT)
            raise OSError(28, "No space left on device")
    assert isinstance(stopped.value.__context__, OSError)  # the failure, kept as context


def test_sigterm_during_the_block_raises_terminated_after_it():
    done = []
    with pytest.raises(Terminated), sigterm_raises():
        with signals_deferred():
            os.kill(os.getpid(), signal.SIGTERM)
            done.append("written")
    assert done == ["written"]


def test_every_handler_comes_back_when_a_signal_lands_while_they_are_restored(
    ctrl_c_raises, monkeypatch
):
    """Ctrl-C's handler is back first; a Ctrl-C arriving while SIGTERM's is restored raises
    from that restore. SIGTERM's handler must still be restored, not left deferring."""
    real = signal.signal
    calls = []

    def restoring(signum, handler):
        calls.append(signum)
        result = real(signum, handler)
        # the third call restores SIGINT's handler; the signal lands just after it
        if len(calls) == 3:
            os.kill(os.getpid(), signal.SIGINT)
        return result

    before = signal.getsignal(signal.SIGTERM)
    monkeypatch.setattr(signals.signal, "signal", restoring)
    with pytest.raises(KeyboardInterrupt):
        with signals_deferred():
            pass
    monkeypatch.setattr(signals.signal, "signal", real)
    assert signal.getsignal(signal.SIGTERM) is before
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_a_command_stops_on_ctrl_c_even_where_it_inherited_it_ignored():
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)  # as `command &` in a script
    try:
        with pytest.raises(KeyboardInterrupt), stops_on_signals():
            os.kill(os.getpid(), signal.SIGINT)
            signal.raise_signal(signal.SIGINT)  # the handler runs at the next bytecode
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN  # and it is put back
    finally:
        signal.signal(signal.SIGINT, previous)


def test_a_command_stops_on_sigterm_even_where_it_inherited_it_blocked():
    held = {signal.SIGINT, signal.SIGTERM}
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, held)
    try:
        # pending on this thread (the others, pytest's, do not block it) before the first line
        signal.pthread_kill(threading.get_ident(), signal.SIGTERM)
        with pytest.raises(Terminated), stops_on_signals():
            pass  # it lands as the command unblocks it
        assert held <= signal.pthread_sigmask(signal.SIG_BLOCK, ())  # the mask is back
    finally:
        handler = signal.signal(signal.SIGTERM, signal.SIG_IGN)  # drops one still pending
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)
        signal.signal(signal.SIGTERM, handler)


# A training started the way a script starts `captioning train ... &`: Ctrl-C ignored. It is
# signalled at its first step (SIGINT) or while its config is read (SIGTERM, before training
# would install its own handler).
CHILD = """
import os, signal, sys
from captioning import config
from captioning.training import step as steps
from captioning.cli import main

name, where = sys.argv[1], sys.argv[2]
signal.signal(signal.SIGINT, signal.SIG_IGN)
real_step, real_load = steps.train_step, config.load_config

def step(*args, **kwargs):
    if where == "step":
        os.kill(os.getpid(), getattr(signal, name))
    return real_step(*args, **kwargs)

def load(*args, **kwargs):
    if where == "config":
        os.kill(os.getpid(), getattr(signal, name))
    return real_load(*args, **kwargs)

steps.train_step, config.load_config = step, load
sys.exit(main(sys.argv[3:]))
"""


@pytest.mark.parametrize(
    "name, where, code, said",
    [
        ("SIGINT", "step", 130, "interrupted"),
        ("SIGTERM", "config", 143, "terminated"),
    ],
)
def test_a_background_training_stops_with_its_line(tiny_shapes, tmp_path, name, where, code, said):
    run = tmp_path / "run"
    argv = ["train", "--config", TINY, "--set", f"data.root={tiny_shapes}", "--out", str(run)]
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    result = subprocess.run(
        [sys.executable, "-c", CHILD, name, where, *argv],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == code, result.stderr[-2000:]
    assert result.stderr.strip().splitlines()[-1] == said
    assert "Traceback" not in result.stderr
    assert not list(run.glob(".*.tmp"))


def test_a_signal_during_an_atomic_write_waits_for_the_rename(ctrl_c_raises, tmp_path, monkeypatch):
    from captioning import files

    real_fsync = os.fsync

    def interrupted_fsync(fd):  # Ctrl-C lands in the middle of the write
        os.kill(os.getpid(), signal.SIGINT)
        real_fsync(fd)

    monkeypatch.setattr(files.os, "fsync", interrupted_fsync)
    target = tmp_path / "metrics.json"
    with pytest.raises(KeyboardInterrupt):
        files.write_atomically(target, "{}")
    assert target.read_text() == "{}"  # whole, renamed into place
    assert not list(tmp_path.glob(".*.tmp"))
