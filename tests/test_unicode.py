"""Vietnamese captions through every layer: the caption verb's output under an ASCII locale,
evaluate's files, the web demo's answers, the Java tokenizer of the COCO evaluation under
``LANG=C``, the scores against pycocoevalcap's own, and matplotlib's glyphs."""

import contextlib
import io
import json
import os
import subprocess
import sys
import unicodedata
import urllib.request
import uuid
import warnings
from pathlib import Path

import pytest
from PIL import Image

import captioning
from captioning.data.vocab import tokenize
from captioning.evaluate import evaluate_checkpoint, format_table
from captioning.metrics import caption_metrics, java_available, tokenize_for_eval

from .conftest import write_json
from .test_vocab import VIETNAMESE

REPO = Path(__file__).resolve().parents[1]
# Two kinds of picture, each with one caption whose every word carries a diacritic, so any
# word the model says is outside ASCII.
MAN, DOG = "Một người đàn ông đứng trên đá .", "Một chú chó chạy trên cỏ ."


def _c_locale_env(**extra: str) -> dict[str, str]:
    """The environment of a CI job with no locale: ASCII everywhere, Python's UTF-8 mode off."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("LC_", "PYTHONIO", "PYTHONUTF8", "JAVA_TOOL"))
    }
    env.update(LANG="C", LC_ALL="C", PYTHONUTF8="0", PYTHONPATH=str(REPO), **extra)
    return env


def _write_split(root: Path, split: str, count: int, first_id: int) -> None:
    images, annotations = [], []
    for k in range(count):
        image_id = first_id + k
        name = f"{split}_{k:03d}.png"
        colour = (220, 40, 40) if k % 2 else (40, 60, 220)
        (root / "images" / split).mkdir(parents=True, exist_ok=True)
        Image.new("RGB", (48, 48), colour).save(root / "images" / split / name)
        images.append({"id": image_id, "file_name": name, "width": 48, "height": 48})
        annotations.append({"id": image_id, "image_id": image_id, "caption": MAN if k % 2 else DOG})
    write_json(
        root / "annotations" / f"captions_{split}.json",
        {"images": images, "annotations": annotations},
    )


@pytest.fixture(scope="module")
def vietnamese_run(tmp_path_factory):
    """A COCO-style dataset with Vietnamese captions and no instances, and a tiny model
    trained on it for a few epochs (seconds)."""
    from captioning.config import load_config
    from captioning.training.train import fit

    root = tmp_path_factory.mktemp("photos_vi")
    for first_id, (split, count) in zip((1, 101, 201), (("train", 24), ("val", 4), ("test", 4))):
        _write_split(root, split, count, first_id)
    run = tmp_path_factory.mktemp("run_vi")
    cfg = load_config(
        REPO / "configs" / "test_tiny.yaml",
        [f"data.root={root}", "train.epochs=4", "train.lr=1e-2"],
    )
    fit(cfg, out_dir=run)
    model = captioning.load(run / "best.pt", device="cpu")
    image = str(root / "images" / "test" / "test_001.png")
    caption = model.caption(image).caption
    assert caption and not caption.isascii(), caption  # the model says something Vietnamese
    return root, run / "best.pt", image, caption


@pytest.mark.slow  # a whole pipeline (make test-slow)
def test_caption_json_is_readable_utf8_under_an_ascii_locale(vietnamese_run):
    # LANG=C with Python's UTF-8 mode off makes stdout ASCII: printing "ộ" would crash.
    _, checkpoint, image, caption = vietnamese_run
    command = [
        sys.executable,
        "-m",
        "captioning",
        "caption",
        image,
        "--checkpoint",
        str(checkpoint),
        "--device",
        "cpu",
    ]
    done = subprocess.run(
        [*command, "--json"], capture_output=True, env=_c_locale_env(), timeout=300, check=False
    )
    assert done.returncode == 0, done.stderr.decode(errors="replace")
    assert caption.encode("utf-8") in done.stdout and b"\\u" not in done.stdout
    assert json.loads(done.stdout.decode("utf-8"))["caption"] == caption
    done = subprocess.run(
        command, capture_output=True, env=_c_locale_env(), timeout=300, check=False
    )
    assert done.returncode == 0 and done.stdout.decode("utf-8").strip() == f"{image}: {caption}"
    # An encoding the user forces is kept: the JSON escapes what ASCII lacks, and stays JSON.
    done = subprocess.run(
        [*command, "--json"],
        capture_output=True,
        timeout=300,
        check=False,
        env=_c_locale_env(PYTHONIOENCODING="ascii"),
    )
    assert done.returncode == 0 and done.stdout.isascii()
    assert json.loads(done.stdout)["caption"] == caption


def test_evaluate_writes_letters_and_only_the_metrics_that_apply(vietnamese_run, tmp_path):
    root, checkpoint, _, _ = vietnamese_run
    metrics = evaluate_checkpoint(
        checkpoint, split="test", out_dir=tmp_path, meteor=False, progress=False
    )
    predictions = (tmp_path / "predictions.json").read_bytes()
    assert b"\\u" not in predictions
    captions = [p["caption"] for p in json.loads(predictions.decode("utf-8"))]
    assert len(captions) == 4 and any(not c.isascii() for c in captions)
    # No instances: no object counts, no grounding, in the file or the table.
    saved = json.loads((tmp_path / "metrics.json").read_text(encoding="utf-8"))
    assert saved == json.loads(json.dumps(metrics))
    for key in (
        "exact_match_by_objects",
        "pointing_game",
        "attention_in_box",
        "grounded_words",
        "grounding_by_word_type",
        "centre_pointing_game",
    ):
        assert key not in saved, key
    assert all(saved[k] is not None for k in saved if k != "METEOR")
    table = format_table(metrics)
    assert "CIDEr" in table and "obj" not in table and "pointing" not in table, table


def test_the_web_demo_answers_in_utf8(vietnamese_run):
    from captioning.serve import require

    try:
        require()
    except captioning.CaptioningError as exc:
        pytest.skip(str(exc))
    from captioning.serve.server import BackgroundServer

    _, checkpoint, image, caption = vietnamese_run
    model = captioning.load(checkpoint, device="cpu")
    boundary = uuid.uuid4().hex
    body = (
        f'--{boundary}\r\nContent-Disposition: form-data; name="image"; '
        f'filename="ảnh.png"\r\nContent-Type: image/png\r\n\r\n'
    ).encode()
    body += Path(image).read_bytes() + f"\r\n--{boundary}--\r\n".encode()
    with BackgroundServer(model) as url:
        request = urllib.request.Request(
            f"{url}/api/caption",
            data=body,
            headers={"Content-Type": f"multipart/form-data; boundary={boundary}"},
        )
        with urllib.request.urlopen(request, timeout=120) as response:
            kind, raw = response.headers["Content-Type"], response.read()
    assert kind == "application/json"  # UTF-8 by definition (RFC 8259)
    assert caption.encode("utf-8") in raw and b"\\u" not in raw
    assert json.loads(raw.decode("utf-8"))["caption"] == caption


_TOKENIZE_IN_C_LOCALE = """
import json, sys
from captioning.metrics import tokenize_for_eval
captions = json.loads(sys.stdin.read())
print(json.dumps(tokenize_for_eval({0: captions})[0]))
"""


@pytest.mark.skipif(not java_available(), reason="needs Java (the PTB tokenizer)")
def test_the_java_tokenizer_reads_vietnamese_under_lang_c():
    # Java 17 takes its default charset from the locale (ASCII under LANG=C); the PTB tokenizer
    # must still read and write UTF-8, or every diacritic would come back as "?".
    captions = [*VIETNAMESE, *(unicodedata.normalize("NFD", c) for c in VIETNAMESE)]
    done = subprocess.run(
        [sys.executable, "-c", _TOKENIZE_IN_C_LOCALE],
        input=json.dumps(captions).encode(),
        capture_output=True,
        env=_c_locale_env(),
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr.decode(errors="replace")
    java = json.loads(done.stdout)
    assert java == [" ".join(tokenize(c)) for c in captions]
    assert java[0].startswith("một người đàn ông")


@pytest.mark.skipif(not java_available(), reason="needs Java (the PTB tokenizer)")
def test_vietnamese_scores_equal_pycocoevalcap(tmp_path):
    import pycocoevalcap.eval as eval_module
    from pycocoevalcap.eval import COCOEvalCap
    from pycocotools.coco import COCO

    references = {
        1: [
            VIETNAMESE[0],
            "Người leo núi đứng trên đỉnh núi tuyết .",
            "Một người đàn ông leo núi trong sương mù .",
        ],
        2: [VIETNAMESE[1], "Một cậu bé giơ hai tay lên trời .", "Cậu bé mặc áo nâu ."],
        3: [VIETNAMESE[4], "Một con chó nhỏ ngủ trên khăn .", "Con chó ngủ trên cỏ ."],
    }
    predictions = {
        1: "một người đàn ông đứng trên núi tuyết",
        2: "một cậu bé giơ tay lên",
        3: "một con chó ngủ trên cỏ",
    }
    images = [{"id": i, "file_name": f"{i}.jpg"} for i in references]
    annotations = [
        {"id": 10 * i + k, "image_id": i, "caption": c}
        for i, caps in references.items()
        for k, c in enumerate(caps)
    ]
    gts = tmp_path / "captions.json"
    gts.write_text(json.dumps({"images": images, "annotations": annotations}), encoding="utf-8")
    res = tmp_path / "results.json"
    res.write_text(
        json.dumps([{"image_id": i, "caption": c} for i, c in predictions.items()]),
        encoding="utf-8",
    )

    class Skipped:  # METEOR is English only, SPICE downloads models
        def __init__(self, name):
            self.name = name

        def compute_score(self, gts, res):
            return 0.0, []

        def method(self):
            return self.name

    saved = eval_module.Meteor, eval_module.Spice
    eval_module.Meteor, eval_module.Spice = lambda: Skipped("METEOR"), lambda: Skipped("SPICE")
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            coco = COCO(str(gts))
            results = coco.loadRes(str(res))
            evaluator = COCOEvalCap(coco, results)
            evaluator.params["image_id"] = results.getImgIds()
            evaluator.evaluate()
    finally:
        eval_module.Meteor, eval_module.Spice = saved
    ours = caption_metrics(predictions, references, meteor=False)
    for key in ("Bleu_1", "Bleu_2", "Bleu_3", "Bleu_4", "ROUGE_L", "CIDEr"):
        assert ours[key] == pytest.approx(evaluator.eval[key], abs=1e-12), key
    assert 0.5 < ours["Bleu_1"] < 1 and ours["CIDEr"] > 0.5  # real overlap, not all zeros
    # The tokens the scorers saw kept their letters.
    assert tokenize_for_eval({1: [predictions[1]]})[1] == [predictions[1]]


def _missing_glyphs(title: str) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure = plt.figure(figsize=(6, 1))
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            figure.suptitle(title)
            figure.canvas.draw()
    finally:
        plt.close(figure)
    return [str(w.message) for w in caught if "missing from" in str(w.message)]


def test_the_default_font_draws_every_vietnamese_letter():
    # matplotlib's default font, DejaVu Sans (shipped with it), has all of them.
    from matplotlib import font_manager

    font = Path(font_manager.findfont(font_manager.FontProperties())).name
    letters = "ăâđêôơư ửậờữẫỹ ĂÂĐÊÔƠƯ ỬẬỜỮẪỸ"
    assert _missing_glyphs(f"{VIETNAMESE[0]} {letters}") == [], font
    # The check can fail: a script DejaVu Sans does not cover is reported.
    assert any("Glyph" in message for message in _missing_glyphs("ảnh 日本"))
