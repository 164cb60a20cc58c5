"""Device, precision and seeding helpers."""

import pytest
import torch
import yaml

import captioning.runtime as runtime
from captioning.checkpoint import load_checkpoint
from captioning.errors import CaptioningError
from captioning.runtime import autocast, native_bf16, resolve_device, resolve_precision
from captioning.training.train import fit

from .test_train import tiny

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def shapes(tmp_path_factory):
    from captioning.data.shapes import generate_shapes

    root = tmp_path_factory.mktemp("shapes")
    generate_shapes(root, num_train=24, num_val=6, num_test=6, seed=0, image_size=48)
    return root


@pytest.mark.parametrize(
    ("flags", "native"),
    [({"avx2", "avx512f"}, False), ({"avx512f", "avx512_bf16"}, True), ({"amx_bf16"}, True)],
)
def test_auto_precision_is_bf16_only_where_the_cpu_has_it(monkeypatch, flags, native):
    monkeypatch.setattr(runtime, "cpu_flags", lambda: flags)
    assert native_bf16(CPU) is native
    assert resolve_precision("auto", CPU) == ("bf16" if native else "fp32")
    assert resolve_precision("fp16", CPU) == "fp16"  # an explicit choice is kept
    with autocast(CPU, "auto"):
        product = torch.ones(2, 2) @ torch.ones(2, 2)
    assert product.dtype == (torch.bfloat16 if native else torch.float32)


@pytest.mark.parametrize("native", [False, True])
def test_training_records_the_precision_auto_chose(shapes, tmp_path, monkeypatch, native):
    monkeypatch.setattr(runtime, "cpu_flags", lambda: {"avx512_bf16"} if native else set())
    fit(tiny(shapes, "train.precision=auto", "train.epochs=1"), out_dir=tmp_path / "run")
    expected = "bf16" if native else "fp32"
    saved = yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())
    assert saved["train"]["precision"] == saved["runtime"]["precision"] == expected
    config = load_checkpoint(tmp_path / "run" / "last.pt")["config"]
    assert config["train"]["precision"] == config["runtime"]["precision"] == expected


def test_resolve_device_errors_are_one_line():
    assert resolve_device("cpu") == CPU
    with pytest.raises(CaptioningError, match="unknown device 'gpu0'"):
        resolve_device("gpu0")
    for name in ("tpu9", "meta", "xla", "cpu:x"):  # torch knows some of them; we run on none
        with pytest.raises(CaptioningError, match=f"unknown device '{name}'; use auto, cpu"):
            resolve_device(name)
    if not torch.cuda.is_available():
        with pytest.raises(CaptioningError, match="CUDA is not available"):
            resolve_device("cuda:7")


def test_in_passing_thread_returns_and_raises_on_the_caller():
    import threading

    from captioning.runtime import in_passing_thread

    caller = threading.get_ident()
    ran_on = in_passing_thread(threading.get_ident)
    assert ran_on != caller
    assert in_passing_thread(lambda a, b=0: a + b, 2, b=3) == 5
    with pytest.raises(ValueError, match="bad"):
        in_passing_thread(int, "bad")


def test_map_in_threads_keeps_the_order_and_raises_at_the_items_turn():
    import threading
    import time

    from captioning.runtime import map_in_threads

    seen = set()  # the worker threads themselves: an ended thread's ident can be reused

    def slow_square(x):
        seen.add(threading.current_thread())
        time.sleep(0.002 * (x % 3))  # items finish out of order
        if x == 7:
            raise ValueError("seven")
        return x * x

    assert list(map_in_threads(slow_square, range(7), 3)) == [x * x for x in range(7)]
    assert len(seen) == 3 and threading.current_thread() not in seen
    results = map_in_threads(slow_square, range(10), 4)
    assert [next(results) for _ in range(7)] == [x * x for x in range(7)]
    with pytest.raises(ValueError, match="seven"):
        next(results)
    assert list(map_in_threads(slow_square, [], 2)) == []
    with pytest.raises(ValueError, match="workers must be at least 1"):
        list(map_in_threads(slow_square, [1], 0))
    assert not [t for t in threading.enumerate() if t in seen]  # every worker ended


SWEPT = r"^(\d+) points, none hung, (\d+) left a daemon thread$"
# hung, or broken for the runs after (either way not safe to stop)
HUNG = r"^(hung at bytecode \d+ \(.*\)|broken after bytecode \d+: .*)$"


@pytest.mark.parametrize(
    ("run", "code", "says"),
    [
        ("ours", 0, SWEPT),
        ("executor", 3, HUNG),
        ("loader threading.py", 0, SWEPT),
        pytest.param("loader", 0, SWEPT, marks=pytest.mark.slow),  # 3 minutes: workers a trial
        pytest.param("plain-loader threading.py:__enter__", 3, HUNG, marks=pytest.mark.slow),
        pytest.param("events", 0, SWEPT, marks=pytest.mark.slow),  # 20 s: a writer a trial
        pytest.param("summary-writer", 3, HUNG, marks=pytest.mark.slow),
    ],
)
def test_ctrl_c_at_every_bytecode_of_work_handed_to_threads(run, code, says):
    """A Ctrl-C at any bytecode of ``map_in_threads``' caller ends the map and its threads,
    and one anywhere in a training's TensorBoard log or a loader's worker processes (read
    through ``batches``) never hangs the run; the same sweep finds ThreadPoolExecutor.map,
    TensorBoard's SummaryWriter and a DataLoader with workers hung (their threads wait on a
    lock the interrupted caller took, and their ends wait on those threads), which is why
    the project goes around all three."""
    import re
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    result = subprocess.run(
        [sys.executable, "-m", "tests.interrupt_sweep", *run.split()],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode in ((0,) if code == 0 else (3, 4)), (
        result.stdout + result.stderr[-3000:]
    )
    found = re.match(says, result.stdout.strip().splitlines()[-1])
    assert found, result.stdout
    if code == 0:
        points, strays = int(found.group(1)), int(found.group(2))
        # the sweep went through the whole run (how many places a loader passes in threading.py
        # depends on how long it waits for its workers)
        assert points > (10 if " " in run else 1000)
        if run != "events":
            assert strays == 0, result.stdout  # every thread ended with its run
        else:  # a signal just before close() is called, left to the exit's close
            assert strays < points / 100


def test_an_event_log_left_open_is_closed_at_exit_with_every_scalar(tmp_path):
    """A signal just before ``EventLog.close`` is called leaves the log open; the exit closes
    it, so every scalar it was handed is in the file (an open SummaryWriter loses the last
    ones it had queued in most such runs: three runs make that a failure here)."""
    import subprocess
    import sys

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    for run in range(3):
        folder = tmp_path / str(run)
        code = (
            "from captioning.training.events import EventLog\n"
            f"log = EventLog({str(folder)!r})\n"
            "for step in range(200):\n"
            "    log.scalars({'loss': 1.0 / (step + 1)}, step)\n"
        )
        subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
        events = EventAccumulator(str(folder))
        events.Reload()
        written = [(e.step, round(e.value, 3)) for e in events.Scalars("loss")]
        assert written == [(step, round(1.0 / (step + 1), 3)) for step in range(200)], run
