"""The folders the commands write: a folder that is not a command's own is refused before
anything is written there, a command runs again into its own, the lock is taken first,
nothing a person put there is removed, and files are written whole."""

import errno
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from PIL import Image

from captioning import api
from captioning.cli import main
from captioning.config import load_config
from captioning.data.feature_cache import cache_folder, extract_features
from captioning.data.shapes import generate_shapes
from captioning.errors import CaptioningError, ConfigError
from captioning.files import write_atomically
from captioning.folders import MARKER, lock_folder
from captioning.models import build_encoder
from captioning.prepare import prepare_folder
from captioning.quickstart import remove_earlier_run
from captioning.runtime import seed_everything
from captioning.training.run_folder import RUN_FOLDER, write_config

ROOT = Path(__file__).resolve().parent.parent
TINY = str(ROOT / "configs" / "test_tiny.yaml")
FROZEN = ["model.fine_tune=none", "data.num_workers=0", "train.precision=fp32"]


def one_error(capsys) -> str:
    """The one ``error:`` line of stderr, which must be its last, with no traceback."""
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert "Traceback" not in err
    assert [line for line in lines if line.startswith("error: ")] == lines[-1:]
    return lines[-1]


def listing(folder: Path) -> dict[str, bytes]:
    """Every file under ``folder`` with its bytes."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in folder.rglob("*") if p.is_file()}


def a_persons_folder(folder: Path) -> dict[str, bytes]:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "notes.txt").write_text("a person's notes\n")
    (folder / "photo.png").write_bytes(b"a person's photo")
    return listing(folder)


def an_image(shapes: Path) -> str:
    return str(sorted((shapes / "images" / "test").iterdir())[0])


def argv(verb: str, folder: Path, checkpoint: Path, shapes: Path, scratch: Path) -> list[str]:
    """The command line of ``verb`` writing into ``folder`` (its other files in ``scratch``)."""
    captions = scratch / "captions.csv"
    captions.write_text("image,caption\nx.png,a caption\n")
    return {
        "train": ["train", "--config", TINY, "--set", f"data.root={shapes}", "--out", str(folder)],
        "evaluate": ["evaluate", "--checkpoint", str(checkpoint), "--out", str(folder)],
        "caption": [
            "caption",
            an_image(shapes),
            "--checkpoint",
            str(checkpoint),
            "--attention-dir",
            str(folder),
        ],
        "quickstart": [
            "quickstart",
            "--config",
            TINY,
            "--data-root",
            str(shapes),
            "--out",
            str(folder),
        ],
        "quickstart-data": [
            "quickstart",
            "--config",
            TINY,
            "--data-root",
            str(folder),
            "--out",
            str(scratch / "quick"),
        ],
        "shapes": ["shapes", "--out", str(folder), "--train", "2", "--val", "1", "--test", "1"],
        "prepare folder": [
            "prepare",
            "folder",
            "--images",
            str(shapes / "images" / "test"),
            "--captions",
            str(captions),
            "--out",
            str(folder),
        ],
        "prepare coco": ["prepare", "coco", "--root", str(folder)],
    }[verb]


VERBS = [
    "train",
    "evaluate",
    "caption",
    "quickstart",
    "quickstart-data",
    "shapes",
    "prepare folder",
    "prepare coco",
]


@pytest.mark.parametrize("verb", VERBS)
def test_a_folder_a_person_made_is_refused_and_left_as_it_was(
    verb, tiny_checkpoint, tiny_shapes, tmp_path, capsys
):
    folder = tmp_path / "mine"
    before = a_persons_folder(folder)
    assert main(argv(verb, folder, tiny_checkpoint, tiny_shapes, tmp_path)) == 2
    error = one_error(capsys)
    assert f"{folder} already holds files that `captioning " in error
    assert (
        "did not write (such as notes.txt); nothing was changed: choose a new or empty "
        "folder for --" in error
    )
    assert listing(folder) == before  # no lock file, no marker, nothing removed
    assert sorted(p.name for p in folder.iterdir()) == ["notes.txt", "photo.png"]


def test_a_lock_and_a_config_beside_a_users_notes_are_not_an_earlier_run(
    tiny_shapes, tmp_path, capsys
):
    """An unmarked folder counts as an earlier training run only when it holds nothing
    but what training writes: a user's config.yaml beside their notes stays theirs."""
    folder = tmp_path / "mine"
    folder.mkdir()
    (folder / ".lock").write_text("")
    (folder / "config.yaml").write_text("my: settings\n")
    (folder / "notes").write_text("my notes\n")
    before = listing(folder)
    assert main(argv("train", folder, tmp_path / "x.pt", tiny_shapes, tmp_path)) == 2
    assert "already holds files that `captioning train` did not write" in one_error(capsys)
    assert listing(folder) == before
    assert (folder / "config.yaml").read_text() == "my: settings\n"


@pytest.mark.parametrize("where", ["cwd", "home"])
def test_quickstart_refuses_the_current_folder_and_home(
    tiny_shapes, tmp_path, capsys, monkeypatch, where
):
    home = tmp_path / "home"
    before = a_persons_folder(home)
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(home)
    out = "." if where == "cwd" else os.path.expanduser("~")  # as a shell expands --out ~
    code = main(["quickstart", "--config", TINY, "--data-root", str(tiny_shapes), "--out", out])
    assert code == 2
    assert "already holds files that `captioning quickstart` did not write" in one_error(capsys)
    assert listing(home) == before


def test_a_folder_another_command_wrote_is_refused(tiny_checkpoint, tiny_shapes, tmp_path, capsys):
    run = tiny_checkpoint.parent  # a training's run folder
    before = listing(run)
    assert (run / MARKER).read_text().splitlines()[0] == "train"
    for verb in ("evaluate", "caption", "quickstart", "prepare folder", "prepare coco"):
        assert main(argv(verb, run, tiny_checkpoint, tiny_shapes, tmp_path)) == 2
        error = one_error(capsys)
        assert f"{run} holds the output of `captioning train`; nothing was changed" in error
    assert listing(run) == before


@pytest.mark.slow  # two quickstarts with their figures
def test_quickstart_run_again_removes_only_what_it_wrote(tiny_shapes, tmp_path, capsys):
    out = tmp_path / "quick"
    args = [
        "quickstart",
        "--out",
        str(out),
        "--data-root",
        str(tiny_shapes),
        "--config",
        TINY,
        "--set",
        "train.epochs=1",
        "--set",
        "train.figure_every_epoch=true",
    ]
    assert main(args) == 0
    assert (out / MARKER).read_text().startswith("quickstart\n")
    # A person's files, beside and among the quickstart's.
    (out / "notes.txt").write_text("mine")
    (out / "figures" / "sketch.png").write_bytes(b"mine")
    (out / "eval" / "by hand.json").write_text("{}")
    (out / "attention" / "mine.png").write_bytes(b"mine")
    (out / "last.pt").write_bytes(b"stale")  # what the earlier run wrote goes
    assert main(args) == 0
    capsys.readouterr()
    assert (out / "notes.txt").read_text() == "mine"
    assert (out / "figures" / "sketch.png").read_bytes() == b"mine"
    assert (out / "eval" / "by hand.json").read_text() == "{}"
    assert (out / "attention" / "mine.png").read_bytes() == b"mine"
    assert (out / "last.pt").read_bytes() != b"stale"
    assert len(list(out.glob("events.out.tfevents.*"))) == 1  # the earlier run's went
    assert sorted(p.name for p in (out / "figures").iterdir()) == ["epoch_001.png", "sketch.png"]
    examples = json.loads((out / "quickstart.json").read_text())["examples"]
    drawn = [Path(e["attention"]).name for e in examples if e["attention"]]
    assert sorted(p.name for p in (out / "attention").glob("*.png")) == sorted([*drawn, "mine.png"])


def test_what_an_earlier_quickstart_wrote_is_all_that_goes(tmp_path):
    out = tmp_path / "quick"
    ours = [
        "config.yaml",
        "best.pt",
        "last.pt",
        "events.out.tfevents.1.host",
        "figures/epoch_001.png",
        "eval/metrics.json",
        "eval/predictions.json",
        "attention/test_000000.png",
    ]
    theirs = [
        "notes.txt",
        "figures/sketch.png",
        "eval/by hand.json",
        "attention/mine.png",
        "attention/test_000001.png",
    ]
    for name in ours + theirs:
        (out / name).parent.mkdir(parents=True, exist_ok=True)
        (out / name).write_text(name)
    summary = {
        "examples": [{"attention": str(out / "attention" / "test_000000.png")}, {"attention": None}]
    }
    (out / "quickstart.json").write_text(json.dumps(summary))
    removed = remove_earlier_run(out)
    assert sorted(str(p.relative_to(out)) for p in removed) == sorted([*ours, "quickstart.json"])
    assert sorted(listing(out)) == sorted(theirs)


def test_quickstart_into_a_folder_in_use_is_refused_before_anything_is_removed(
    tiny_shapes, tmp_path, capsys
):
    out = tmp_path / "quick"
    out.mkdir()
    (out / MARKER).write_text("quickstart\n")
    (out / "last.pt").write_bytes(b"an earlier quickstart's")
    held = lock_folder(out, RUN_FOLDER)  # another quickstart running there
    try:
        assert (
            main(
                ["quickstart", "--out", str(out), "--data-root", str(tiny_shapes), "--config", TINY]
            )
            == 2
        )
    finally:
        held.close()
    assert "is in use by another `captioning quickstart` (pid " in one_error(capsys)
    assert (out / "last.pt").read_bytes() == b"an earlier quickstart's"


@pytest.mark.slow  # about 25 s: it trains or evaluates end to end
def test_a_command_runs_again_into_its_own_folder(tiny_checkpoint, tiny_shapes, tmp_path, capsys):
    for verb in ("evaluate", "caption"):
        folder = tmp_path / verb
        assert main(argv(verb, folder, tiny_checkpoint, tiny_shapes, tmp_path)) == 0
        assert main(argv(verb, folder, tiny_checkpoint, tiny_shapes, tmp_path)) == 0
        assert (folder / MARKER).read_text().splitlines()[0] == verb
    assert (tmp_path / "evaluate" / "metrics.json").is_file()
    assert list((tmp_path / "caption").glob("*.png"))
    capsys.readouterr()


def test_folders_written_before_they_were_marked_are_still_their_commands(tmp_path, capsys):
    shapes = tmp_path / "shapes"
    generate_shapes(shapes, num_train=2, num_val=1, num_test=1, image_size=48)  # unmarked
    assert (
        main(
            [
                "shapes",
                "--out",
                str(shapes),
                "--train",
                "3",
                "--val",
                "1",
                "--test",
                "1",
                "--image-size",
                "48",
            ]
        )
        == 0
    )
    assert (shapes / "images" / "train" / "train_000002.png").is_file()
    coco_like = tmp_path / "coco-like"  # the same two folders, not written by `shapes`
    (coco_like / "images" / "train").mkdir(parents=True)
    (coco_like / "annotations").mkdir()
    (coco_like / "images" / "train" / "IMG_0001.png").write_bytes(b"a photo")
    assert main(["shapes", "--out", str(coco_like)]) == 2
    assert "did not write (such as annotations)" in one_error(capsys)


def test_a_start_that_fails_leaves_no_lock_or_marker_behind(tmp_path, capsys):
    empty = tmp_path / "empty"
    empty.mkdir()
    missing = tmp_path / "none.pt"
    for folder in (empty, tmp_path / "new"):
        assert main(["evaluate", "--checkpoint", str(missing), "--out", str(folder)]) == 2
        assert "checkpoint not found" in one_error(capsys)
    assert list(empty.iterdir()) == []
    assert not (tmp_path / "new").exists()


def test_a_signal_as_the_lock_is_taken_leaves_nothing_behind(tmp_path, monkeypatch):
    """Ctrl-C landing just after the lock file is made: the start gives the folder up whole
    (no lone .lock for the next run to take for a user's file), and the next run has it."""
    import signal

    from captioning import folders

    writer = folders.Writer("evaluate")
    folder = tmp_path / "out"
    real_lock = folders.lock_folder

    def interrupted_lock(*args):
        handle = real_lock(*args)
        os.kill(os.getpid(), signal.SIGINT)
        return handle

    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        monkeypatch.setattr(folders, "lock_folder", interrupted_lock)
        with pytest.raises(KeyboardInterrupt), folders.claim_folder(folder, writer):
            pass
    finally:
        signal.signal(signal.SIGINT, previous)
    assert not folder.exists()
    monkeypatch.setattr(folders, "lock_folder", real_lock)
    with folders.claim_folder(folder, writer):
        (folder / "metrics.json").write_text("{}")
    assert sorted(p.name for p in folder.iterdir()) == [".captioning", ".lock", "metrics.json"]


def test_a_lock_that_is_a_link_is_never_written_through(tmp_path, capsys):
    """A folder already marked for a verb, whose .lock links to a user's file: the verb
    refuses in one line and the user's file keeps its bytes."""
    out = tmp_path / "q"
    assert (
        main(
            [
                "shapes",
                "--out",
                str(out),
                "--train",
                "2",
                "--val",
                "1",
                "--test",
                "1",
                "--image-size",
                "48",
            ]
        )
        == 0
    )
    precious = tmp_path / "notes.txt"
    precious.write_text("my notes\n")
    (out / ".lock").unlink(missing_ok=True)
    (out / ".lock").symlink_to(precious)
    assert (
        main(
            [
                "shapes",
                "--out",
                str(out),
                "--train",
                "2",
                "--val",
                "1",
                "--test",
                "1",
                "--image-size",
                "48",
            ]
        )
        == 2
    )
    assert "holds a .lock that is a symbolic link" in one_error(capsys)
    assert precious.read_text() == "my notes\n"


def test_no_file_is_written_through_a_link_left_in_a_commands_folder(tmp_path, capsys):
    """The figures, a shapes image and its annotations, a vocabulary and a config are
    opened without following links: a link where one will go is refused in one line and
    the file it points at keeps its bytes."""
    from captioning.config import Config, save_config
    from captioning.data.vocab import Vocabulary
    from captioning.figures.gif import attention_gif
    from captioning.figures.heatmaps import attention_grid_figure
    from captioning.files import open_unlinked

    precious = tmp_path / "notes.txt"
    precious.write_text("my notes\n")
    image = Image.new("RGB", (48, 32))
    alphas = torch.full((1, 6), 1 / 6)
    writers = {
        "figure.png": lambda p: attention_grid_figure(image, ["a"], alphas, (2, 3), p),
        "anim.gif": lambda p: attention_gif(image, ["a"], alphas, (2, 3), p),
        "vocab.json": lambda p: Vocabulary(["<pad>", "<start>", "<end>", "<unk>"]).save(p),
        "config.yaml": lambda p: save_config(Config(), p),
        "raw": lambda p: open_unlinked(p).close(),
    }
    for name, write in writers.items():
        link = tmp_path / name
        link.symlink_to(precious)
        with pytest.raises(CaptioningError, match="is a symbolic link, which this command"):
            write(link)
        assert precious.read_text() == "my notes\n", name
    images = tmp_path / "shapes" / "images" / "train"
    images.mkdir(parents=True)
    (images / "train_000000.png").symlink_to(precious)
    with pytest.raises(CaptioningError, match="is a symbolic link, which this command"):
        generate_shapes(tmp_path / "shapes", num_train=1, num_val=1, num_test=1, image_size=48)
    assert precious.read_text() == "my notes\n"


# --------------------------------------------------------------------------- atomic writes


@pytest.fixture
def full_disk(monkeypatch):
    """Every fsync fails as a full disk does (delayed allocation reports it there)."""

    def fails(fd):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    def fill():
        monkeypatch.setattr(os, "fsync", fails)

    return fill


def no_temporary_files(folder: Path) -> bool:
    return not [p for p in folder.rglob("*") if p.name.endswith((".tmp", ".partial.npy"))]


def test_write_atomically_keeps_the_previous_file(tmp_path, full_disk):
    path = tmp_path / "notes.txt"
    write_atomically(path, "first\n")
    opened = tmp_path / "opened.txt"
    opened.write_text("as open() makes it")
    assert path.read_text() == "first\n"
    assert path.stat().st_mode == opened.stat().st_mode  # the umask's, not mkstemp's 0600
    opened.unlink()
    full_disk()
    with pytest.raises(
        CaptioningError,
        match=r"notes.txt: cannot write \(No space left on "
        r"device\); the previous one is kept; free some space",
    ):
        write_atomically(path, "second, longer than the first\n")
    assert path.read_text() == "first\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]


def test_a_full_disk_keeps_the_runs_config(tmp_path, full_disk):
    cfg = load_config(TINY, [])
    path = write_config(cfg, tmp_path)
    before = path.read_text()
    full_disk()
    with pytest.raises(ConfigError, match=r"config.yaml: cannot write \(No space left"):
        write_config(load_config(TINY, ["train.epochs=7"]), tmp_path)
    assert path.read_text() == before and no_temporary_files(tmp_path)


@pytest.mark.slow  # about 25 s: it trains or evaluates end to end
def test_a_full_disk_keeps_the_evaluation(tiny_checkpoint, tmp_path, capsys, full_disk):
    out = tmp_path / "eval"
    args = ["evaluate", "--checkpoint", str(tiny_checkpoint), "--out", str(out)]
    assert main(args) == 0
    capsys.readouterr()
    before = listing(out)
    full_disk()
    assert main([*args, "--beam-size", "2"]) == 2
    error = one_error(capsys)
    assert error.startswith(f"error: {out / 'metrics.json'}: cannot write (No space left")
    assert "the previous one is kept" in error
    assert listing(out) == before and json.loads((out / "metrics.json").read_text())


def test_a_full_disk_keeps_the_prepare_report(tmp_path, full_disk):
    images = tmp_path / "photos"
    images.mkdir()
    Image.new("RGB", (32, 32)).save(images / "a.jpg")
    captions = tmp_path / "captions.csv"
    captions.write_text("image,caption\nmissing.jpg,a caption\n")
    out = tmp_path / "out"
    with pytest.raises(CaptioningError, match="no row names a readable image"):
        prepare_folder(images, captions, out, progress=False)
    report = (out / "prepare_report.txt").read_text()
    full_disk()
    captions.write_text("image,caption\ngone.jpg,another caption\n")
    with pytest.raises(CaptioningError, match=r"prepare_report.txt: cannot write \(No space"):
        prepare_folder(images, captions, out, progress=False)
    assert (out / "prepare_report.txt").read_text() == report
    assert no_temporary_files(out)


def frozen(shapes: Path, cache: Path, *extra: str):
    return load_config(
        TINY, [f"data.root={shapes}", f"data.feature_cache={cache}", *FROZEN, *extra]
    )


def test_a_full_disk_keeps_the_feature_cache(tiny_shapes, tmp_path, full_disk):
    cfg = frozen(tiny_shapes, tmp_path / "cache")
    summary = extract_features(cfg, "val", progress=False)
    folder = Path(summary["folder"])
    before = listing(folder)
    full_disk()
    with pytest.raises(CaptioningError, match=r"cannot write \(No space left on device\)"):
        extract_features(cfg, "val", progress=False, overwrite=True)
    assert listing(folder) == before and no_temporary_files(folder)


def test_extract_features_refuses_a_cache_folder_it_did_not_write(tiny_shapes, tmp_path, capsys):
    cache = tmp_path / "cache"
    cfg = frozen(tiny_shapes, cache)
    seed_everything(cfg.train.seed)
    folder = cache_folder(cfg, build_encoder(cfg.model, cfg.runtime))
    capsys.readouterr()  # what building the encoder logged
    before = a_persons_folder(folder)
    args = ["extract-features", "--config", TINY, "--split", "val", "--quiet"]
    for setting in (f"data.root={tiny_shapes}", f"data.feature_cache={cache}", *FROZEN):
        args += ["--set", setting]
    assert main(args) == 2
    error = one_error(capsys)
    assert (
        f"data.feature_cache {folder} already holds files that `captioning "
        f"extract-features` did not write" in error
    )
    assert listing(folder) == before


STOPPING = """
import os, signal, sys
import captioning.data.feature_cache as feature_cache
from captioning.cli import main

real = feature_cache.progress_bar

def stopping(iterable, **kwargs):
    for index, batch in enumerate(real(iterable, **kwargs)):
        if index == 1:  # the first batch is in the partial file
            os.kill(os.getpid(), getattr(signal, sys.argv[1]))
        yield batch

feature_cache.progress_bar = stopping
sys.exit(main(sys.argv[2:]))
"""


# A child process each; SIGINT in the default suite, SIGTERM with the slow tests.
@pytest.mark.parametrize(
    "name, code, said",
    [
        pytest.param("SIGTERM", 143, "terminated", marks=pytest.mark.slow),
        ("SIGINT", 130, "interrupted"),
    ],
)
def test_extract_features_stopped_by_a_signal_leaves_no_partial_file(
    tiny_shapes, tmp_path, name, code, said
):
    script = tmp_path / "stopping.py"
    script.write_text(STOPPING)
    cache = tmp_path / "cache"
    args = [
        "extract-features",
        "--config",
        TINY,
        "--split",
        "train",
        "--batch-size",
        "4",
        "--quiet",
    ]
    for setting in (f"data.root={tiny_shapes}", f"data.feature_cache={cache}", *FROZEN):
        args += ["--set", setting]
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    result = subprocess.run(
        [sys.executable, str(script), name, *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == code, result.stderr[-2000:]
    assert result.stderr.strip().splitlines()[-1] == said
    assert not [p for p in cache.rglob("*") if p.suffix == ".npy"], list(cache.rglob("*"))


# --------------------------------------------------------------------------- the API's lock


def test_images_are_read_outside_the_model_lock(tiny_checkpoint, tiny_shapes, monkeypatch):
    model = api.load(tiny_checkpoint, "cpu")
    paths = [str(p) for p in sorted((tiny_shapes / "images" / "test").iterdir())[:3]]
    picture = Image.open(paths[0]).convert("RGB")
    seen = []
    real_load, real_picture = api.load_image, api._to_picture
    real_resize = model.model.encoder.transform

    def opening(*args, **kwargs):
        seen.append(("open", model._lock.locked()))
        return real_load(*args, **kwargs)

    def converting(*args, **kwargs):
        seen.append(("convert", model._lock.locked()))
        return real_picture(*args, **kwargs)

    def resizing(image):
        seen.append(("resize", model._lock.locked()))
        return real_resize(image)

    monkeypatch.setattr(api, "load_image", opening)
    monkeypatch.setattr(api, "_to_picture", converting)
    monkeypatch.setattr(model.model.encoder, "transform", resizing)
    results = list(model.caption_each([*paths, picture], batch_size=2))
    assert [r.source for r in results] == [*paths, "image 3"]
    assert seen == [("open", False), ("resize", False)] * 3 + [
        ("convert", False),
        ("resize", False),
    ]
