"""Faults of training and its command line: SIGTERM, non-finite weights, the run-folder lock,
config sections given as values, an --attention-dir that is a file; and the dependency
floors past the known flaws."""

import errno
import io
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import captioning
from captioning.checkpoint import load_checkpoint
from captioning.cli import main
from captioning.config import load_config
from captioning.data.shapes import generate_shapes
from captioning.errors import CaptioningError
from captioning.training import step as step_module
from captioning.training.step import TrainingError
from captioning.training.train import fit

REPO = Path(__file__).parents[1]
CONFIG = str(REPO / "configs" / "test_tiny.yaml")


@pytest.fixture(scope="module")
def shapes(tmp_path_factory):
    root = tmp_path_factory.mktemp("shapes")
    generate_shapes(root, num_train=24, num_val=6, num_test=6, seed=0, image_size=48)
    return root  # 24 training images: 3 steps of 8 per epoch


def tiny(shapes, *overrides):
    return load_config(CONFIG, [f"data.root={shapes}", *overrides])


def one_error(capsys) -> str:
    """The one ``error:`` line of stderr, which must be its last, with no traceback."""
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert "Traceback" not in err
    assert [line for line in lines if line.startswith("error: ")] == lines[-1:]
    return lines[-1]


def finite(payload) -> bool:
    return all(
        bool(torch.isfinite(v).all()) for v in payload["model"].values() if v.is_floating_point()
    )


# --------------------------------------------------------------------------- SIGTERM

# A training in a process of its own that stops where the test says (after a given step, or
# inside a checkpoint write), writes `ready`, and waits there until the test has sent
# SIGTERM (it writes `sent` once it has).
CHILD = """
import sys, time
from pathlib import Path
from captioning import checkpoint
from captioning.training import step as steps
from captioning.cli import main

where, stop_at, marks = sys.argv[1], int(sys.argv[2]), Path(sys.argv[3])

def wait_for_the_signal():
    (marks / "ready").touch()
    deadline = time.time() + 120
    while not (marks / "sent").exists() and time.time() < deadline:
        time.sleep(0.01)
    time.sleep(0.2)  # the handler runs at the next bytecode; a deferred one is pending

real_step, real_save = steps.train_step, checkpoint.torch.save

def step(run, *args, **kwargs):
    result = real_step(run, *args, **kwargs)
    if where == "step" and run.progress.step == stop_at:
        wait_for_the_signal()
    return result

def save(*args, **kwargs):
    if where == "write":
        wait_for_the_signal()
    real_save(*args, **kwargs)

steps.train_step, checkpoint.torch.save = step, save
sys.exit(main(sys.argv[4:]))
"""


def terminate_training(shapes, run: Path, marks: Path, where: str, stop_at: int = 0):
    """Train in a child process, send it SIGTERM where ``where`` says; its exit code and
    stderr."""
    marks.mkdir()
    argv = [
        "train",
        "--config",
        CONFIG,
        "--set",
        f"data.root={shapes}",
        "--out",
        str(run),
        "--quiet",
    ]
    env = {**os.environ, "PYTHONPATH": str(Path(captioning.__file__).parents[1])}
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, where, str(stop_at), str(marks), *argv],
        env=env,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.time() + 240
        while not (marks / "ready").exists():
            assert child.poll() is None, child.stderr.read()
            assert time.time() < deadline, "the training never reached the point"
            time.sleep(0.02)
        child.send_signal(signal.SIGTERM)
        (marks / "sent").touch()
        _, err = child.communicate(timeout=120)
    finally:
        if child.poll() is None:
            child.kill()
    return child.returncode, err


# Two trainings in a child process; its sibling below (a signal during a checkpoint write)
# stays in the default suite.
@pytest.mark.slow
def test_sigterm_after_a_step_stops_like_ctrl_c_and_the_run_resumes(shapes, tmp_path):
    run = tmp_path / "run"
    # After the first step of epoch 2: epoch 1's checkpoints are whole, nothing else is.
    code, err = terminate_training(shapes, run, tmp_path / "marks", "step", stop_at=4)
    assert code == 143, err
    assert err.strip().splitlines()[-1] == "terminated" and "Traceback" not in err
    assert not list(run.glob(".*.tmp")) and not list(run.glob("*.part"))
    assert load_checkpoint(run / "last.pt")["epoch"] == 1
    assert load_checkpoint(run / "best.pt")["epoch"] == 1
    summary = fit(tiny(shapes), out_dir=run, resume=str(run / "last.pt"))
    assert summary["epochs"] == 2 and summary["steps"] == 6


def test_sigterm_during_a_checkpoint_write_finishes_the_write_then_stops(shapes, tmp_path):
    run = tmp_path / "run"
    code, err = terminate_training(shapes, run, tmp_path / "marks", "write")
    assert code == 143, err
    assert err.strip().splitlines()[-1] == "terminated"
    assert not list(run.glob(".*.tmp"))  # the write finished and was renamed
    payload = load_checkpoint(run / "last.pt")
    assert payload["epoch"] == 1 and payload["step"] == 3
    assert not (run / "best.pt").exists()  # the run stopped right after the first write


# --------------------------------------------------------------------------- non-finite


def poison_after(monkeypatch, step: int) -> None:
    """The weights turn NaN after optimiser step ``step``, with a finite loss (as when a
    step overflows without the loss showing it)."""
    real_step = step_module.train_step

    def poisoned(run, *args, **kwargs):
        result = real_step(run, *args, **kwargs)
        if run.progress.step == step:
            with torch.no_grad():
                next(run.model.decoder.parameters()).fill_(float("nan"))
        return result

    monkeypatch.setattr(step_module, "train_step", poisoned)


def test_nonfinite_weights_are_never_saved_even_when_training_goes_on(
    shapes, tmp_path, capsys, monkeypatch
):
    poison_after(monkeypatch, 2)  # in epoch 1: nothing good to keep yet
    run = tmp_path / "run"
    argv = [
        "train",
        "--config",
        CONFIG,
        "--set",
        f"data.root={shapes}",
        "--set",
        "train.stop_on_nonfinite=false",
        "--out",
        str(run),
    ]
    assert main(argv) == 2
    error = one_error(capsys)
    assert error.startswith("error: the weights became non-finite in epoch 1 (decoder.")
    assert error.endswith(
        "holds NaN or inf), so they were not saved; start again with a "
        "lower train.lr or train.precision=fp32"
    )
    assert not (run / "last.pt").exists() and not (run / "best.pt").exists()
    assert not list(run.glob(".*.tmp"))


def test_nonfinite_weights_in_a_later_epoch_keep_the_last_good_checkpoints(
    shapes, tmp_path, monkeypatch
):
    poison_after(monkeypatch, 5)  # in epoch 2
    run = tmp_path / "run"
    kept = re.escape(f"{run / 'last.pt'} keeps epoch 1: start a new run from its weights (--init")
    with pytest.raises(TrainingError, match=f"in epoch 2 .* {kept}"):
        fit(tiny(shapes, "train.stop_on_nonfinite=false"), out_dir=run)
    for name in ("last.pt", "best.pt"):
        payload = load_checkpoint(run / name)
        assert payload["epoch"] == 1 and finite(payload), name


def test_a_nonfinite_gradient_skips_the_batch_and_the_weights_stay_finite(
    shapes, tmp_path, monkeypatch, caplog
):
    import captioning.objectives.cross_entropy as losses_module

    real_loss = losses_module.caption_loss
    calls = {"n": 0}

    def poisoned(*args, **kwargs):
        terms = real_loss(*args, **kwargs)
        calls["n"] += 1
        if calls["n"] == 2:  # the loss stays 0 + finite, its gradient is NaN
            terms.total = terms.total + torch.sqrt(terms.total * 0)
            assert bool(torch.isfinite(terms.total))
        return terms

    monkeypatch.setattr(losses_module, "caption_loss", poisoned)
    summary = fit(tiny(shapes, "train.stop_on_nonfinite=false"), out_dir=tmp_path / "run")
    assert summary["steps"] == 5  # six batches, one skipped
    assert "skipping batch: non-finite gradient at step 2 (epoch 1)" in caplog.text
    for name in ("last.pt", "best.pt"):
        assert finite(load_checkpoint(tmp_path / "run" / name))
    calls["n"] = 0
    with pytest.raises(TrainingError, match=r"non-finite gradient at step 2 \(epoch 1\)"):
        fit(tiny(shapes), out_dir=tmp_path / "stops")


# --------------------------------------------------------------------------- run folder


def test_the_lock_is_taken_before_the_folder_is_checked(shapes, tmp_path):
    from captioning.training.run_folder import lock_run_dir

    run = tmp_path / "run"
    run.mkdir()
    (run / "last.pt").write_bytes(b"a run in progress")
    held = lock_run_dir(run)  # a training that has the folder
    try:
        # The other training's checkpoint is not looked at, let alone trusted or replaced.
        with pytest.raises(CaptioningError, match=r"is in use by another training \(pid "):
            fit(tiny(shapes, "train.epochs=1"), out_dir=run)
        with pytest.raises(CaptioningError, match="is in use by another training"):
            fit(tiny(shapes, "train.epochs=1"), out_dir=run, resume=str(run / "last.pt"))
    finally:
        held.close()
    assert sorted(p.name for p in run.iterdir()) == [".lock", "last.pt"]
    with pytest.raises(CaptioningError, match="already holds a run; continue it with --resume"):
        fit(tiny(shapes, "train.epochs=1"), out_dir=run)


@pytest.mark.parametrize("code", [errno.ENOLCK, errno.EOPNOTSUPP])
def test_a_file_system_without_locks_is_named_as_such(shapes, tmp_path, capsys, monkeypatch, code):
    import fcntl

    def no_locks(handle, operation):
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(fcntl, "flock", no_locks)
    run = tmp_path / "run"
    argv = ["train", "--config", CONFIG, "--set", f"data.root={shapes}", "--out", str(run)]
    assert main(argv) == 2
    error = one_error(capsys)
    assert error == (
        f"error: cannot lock run folder {run} ({os.strerror(code)}): its file "
        f"system does not take file locks (some network mounts); choose an --out "
        f"on a local disk"
    )
    assert "in use" not in error
    assert not (run / "config.yaml").exists()


def test_a_run_folder_that_cannot_be_made_is_one_line(shapes, tmp_path, capsys):
    (tmp_path / "file").write_text("not a folder")
    argv = [
        "train",
        "--config",
        CONFIG,
        "--set",
        f"data.root={shapes}",
        "--out",
        str(tmp_path / "file" / "run"),
    ]
    assert main(argv) == 2
    assert "cannot make run folder" in one_error(capsys)


def test_a_failed_start_leaves_no_folder_behind(tmp_path, capsys):
    run = tmp_path / "run"
    argv = [
        "train",
        "--config",
        CONFIG,
        "--set",
        f"data.root={tmp_path / 'no data'}",
        "--out",
        str(run),
    ]
    assert main(argv) == 2
    one_error(capsys)
    assert not run.exists()


# --------------------------------------------------------------------------- config


@pytest.mark.parametrize(
    "sets",
    [
        ["train=3"],
        ["train=3", "train.epochs=1"],  # once accepted: the later key replaced the value
        ["train.epochs=1", "train=3"],
        ["train=null", "train.epochs=1"],
        ["data=[1, 2]", "data.root=x"],
    ],
)
def test_a_section_given_as_a_value_is_refused_in_any_order(tmp_path, capsys, sets):
    argv = ["train", "--out", str(tmp_path / "run")]
    for text in sets:
        argv += ["--set", text]
    for args in ([*argv, "--config", CONFIG], ["train", "--config", CONFIG, *argv[1:]]):
        assert main(args) == 2
        section = next(s for s in sets if "." not in s.split("=")[0])
        name = section.split("=")[0]
        assert one_error(capsys) == (
            f"error: override {section!r}: {name} is a section of keys, not a value; set one "
            f"of its keys, e.g. --set {name}.{'format' if name == 'data' else 'epochs'}=..."
        )
    assert not (tmp_path / "run").exists()


def test_a_section_given_as_a_value_in_yaml_is_refused(tmp_path, capsys):
    config = tmp_path / "c.yaml"
    config.write_text("train: 3\n")
    for extra in ([], ["--set", "train.epochs=1"]):
        assert main(["train", "--config", str(config), *extra]) == 2
        assert one_error(capsys) == (
            f"error: config file {config}: section 'train' must be a mapping of keys, got 3"
        )


# --------------------------------------------------------------------------- caption


def test_an_attention_dir_that_is_a_file_is_one_line(shapes, tmp_path, capsys):
    assert (
        main(
            [
                "train",
                "--config",
                CONFIG,
                "--set",
                f"data.root={shapes}",
                "--set",
                "train.epochs=1",
                "--out",
                str(tmp_path / "run"),
            ]
        )
        == 0
    )
    image = str(next((shapes / "images" / "val").iterdir()))
    taken = tmp_path / "figures.png"
    taken.write_bytes(b"a file the user has")
    for folder in (taken, taken / "sub"):
        code = main(
            [
                "caption",
                image,
                "--checkpoint",
                str(tmp_path / "run" / "best.pt"),
                "--attention-dir",
                str(folder),
            ]
        )
        assert code == 2
        assert one_error(capsys) == (
            f"error: --attention-dir {folder}: {taken} is a file, "
            f"not a folder; name a folder (it is made when "
            f"missing)"
        )
        assert taken.read_bytes() == b"a file the user has"
    code = main(
        [
            "caption",
            image,
            "--checkpoint",
            str(tmp_path / "run" / "best.pt"),
            "--attention-dir",
            str(tmp_path / "new" / "figures"),
        ]
    )
    assert code == 0 and list((tmp_path / "new" / "figures").glob("*.png"))


# --------------------------------------------------------------------------- dependencies

# The first release of each dependency without a known flaw on the paths this project uses.
FIXED = {
    "torch": "2.6",  # torch.load(weights_only=True) bypass, CVE-2025-32434
    "pillow": "10.3",  # libwebp (CVE-2023-4863) and _imagingcms (CVE-2024-28219) overflows
    "starlette": "0.47.2",  # event loop blocked by upload rollover, CVE-2025-54121
    "python-multipart": "0.0.18",  # preamble/epilogue DoS, CVE-2024-53981
}


def test_dependency_floors_are_past_the_known_flaws_and_installed():
    import importlib.metadata

    tomllib = pytest.importorskip("tomllib")
    requirements = pytest.importorskip("packaging.requirements")
    from packaging.version import Version

    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    declared = project["dependencies"] + project["optional-dependencies"]["serve"]
    floors = {}
    for text in declared:
        requirement = requirements.Requirement(text)
        floor = next((s.version for s in requirement.specifier if s.operator == ">="), None)
        floors[requirement.name.lower()] = Version(floor) if floor else None
        if requirement.name.lower() in FIXED:
            installed = importlib.metadata.version(requirement.name)
            assert requirement.specifier.contains(installed, prereleases=True), text
    for name, fixed in FIXED.items():
        assert floors[name] is not None and floors[name] >= Version(fixed), name


def test_a_full_disk_during_a_checkpoint_write_is_one_line_and_keeps_the_last_one(
    shapes, tmp_path, capsys, monkeypatch
):
    from captioning import checkpoint

    real_save = torch.save
    saves = {"n": 0}

    def disk_fills(obj, handle):
        saves["n"] += 1
        if saves["n"] == 3:  # epoch 2's last.pt (epoch 1 wrote last.pt and best.pt)
            handle.write(b"half a checkpoint")
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real_save(obj, handle)

    monkeypatch.setattr(checkpoint.torch, "save", disk_fills)
    run = tmp_path / "run"
    argv = ["train", "--config", CONFIG, "--set", f"data.root={shapes}", "--out", str(run)]
    assert main(argv) == 2
    assert one_error(capsys) == (
        f"error: {run / 'last.pt'}: cannot write the checkpoint "
        f"([Errno 28] No space left on device); the previous one is "
        f"kept; free some space and run again"
    )
    assert load_checkpoint(run / "last.pt")["epoch"] == 1
    assert not list(run.glob(".*.tmp"))


def test_a_full_disk_when_writing_the_runs_config_is_one_line(tmp_path, monkeypatch):
    import captioning.config
    from captioning.config import ConfigError, save_config

    class Full(io.StringIO):
        def write(self, text):
            raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(captioning.config, "open_unlinked", lambda path, text=False: Full())
    with pytest.raises(ConfigError, match=r"config.yaml: cannot write \(No space left on device\)"):
        save_config(load_config(None, []), tmp_path / "config.yaml")
