"""Progress output: bars on a terminal, one line per loop and per epoch in a log."""

import io
import logging
import os
from contextlib import redirect_stderr

import pytest
from tqdm import tqdm

from captioning.cli import main
from captioning.data.shapes import generate_shapes
from captioning.progress import QuietProgress, progress_bar

CONFIG = os.path.join(os.path.dirname(__file__), "..", "configs", "test_tiny.yaml")


class Terminal(io.StringIO):
    """A captured stderr that says it is a terminal."""

    def isatty(self) -> bool:
        return True


def test_a_bar_only_on_a_terminal(caplog):
    with redirect_stderr(Terminal()):
        assert isinstance(progress_bar(range(3), desc="x"), tqdm)
        assert isinstance(progress_bar(range(3), desc="x", enabled=False), QuietProgress)
    with redirect_stderr(io.StringIO()):
        bar = progress_bar(range(3), desc="checking", unit="img")
        assert isinstance(bar, QuietProgress)
        bar.set_postfix(loss="1.250")
        assert list(bar) == [0, 1, 2]
        assert list(progress_bar(range(3), desc="quiet", enabled=False)) == [0, 1, 2]
        list(progress_bar(range(3), desc="no summary", summary=False))
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1
    assert lines[0].startswith("checking: 3 img in ") and lines[0].endswith("loss 1.250")


def test_bytes_and_manual_updates_give_one_line(caplog):
    with redirect_stderr(io.StringIO()):
        bar = progress_bar(desc="train2014.zip", total=3_000_000, unit="B", initial=1_000_000)
        bar.update(2_000_000)
        bar.close()
        bar.close()
    assert [r.getMessage().split(" in ")[0] for r in caplog.records] == ["train2014.zip: 3.00MB"]


@pytest.fixture(scope="module")
def shapes(tmp_path_factory):
    root = tmp_path_factory.mktemp("shapes")
    generate_shapes(root, num_train=16, num_val=4, num_test=4, seed=0, image_size=48)
    return root


def train(shapes, out, stream) -> str:
    """``captioning train`` for one epoch with bars on, stderr written to ``stream``."""
    args = [
        "train",
        "--config",
        CONFIG,
        "--out",
        str(out),
        "--set",
        f"data.root={shapes}",
        "--set",
        "train.epochs=1",
        "--set",
        "train.quiet=false",
    ]
    with redirect_stderr(stream):
        assert main(args) == 0
    root = logging.getLogger()
    for handler in list(root.handlers):  # the CLI's handler writes to ``stream``
        if getattr(handler, "stream", None) is stream:
            root.removeHandler(handler)
    return stream.getvalue()


def test_a_log_gets_one_line_per_epoch_and_no_redraws(shapes, tmp_path):
    log = train(shapes, tmp_path / "run", io.StringIO())
    assert "\r" not in log
    epoch_lines = [line for line in log.splitlines() if line.startswith("epoch 1/1")]
    assert len(epoch_lines) == 1
    assert "loss " in epoch_lines[0] and "2 steps in " in epoch_lines[0]
    assert "steps/s; validation " in epoch_lines[0]
    assert "checking images: 24 img in " in log


def test_a_terminal_gets_the_bars(shapes, tmp_path):
    log = train(shapes, tmp_path / "run", Terminal())
    assert "\r" in log and "epoch 1:" in log  # tqdm's redrawn "epoch 1: 50%|..." line
    assert "checking images: 24 img in " not in log  # the bar replaced the summary
    assert "epoch 1/1  loss" in log
