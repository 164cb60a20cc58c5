import io
import json
import logging
import math
import threading

import pytest
from pycocoevalcap import eval as cocoeval
from pycocoevalcap.bleu.bleu import Bleu
from pycocotools.coco import COCO

from captioning.data.vocab import tokenize
from captioning.errors import CaptioningError
from captioning.metrics import (
    METRIC_NAMES,
    caption_metrics,
    exact_match,
    exact_match_by_group,
    java_available,
    tokenize_for_eval,
)
from captioning.metrics import captions as captions_module
from captioning.metrics.captions import BLEU_NO_BP_NAMES

REFERENCES = {
    11: [
        "A small red circle, to the left of a blue square.",
        "A red circle left of a blue square.",
        "There is a red circle and a blue square.",
        "The small red circle is to the left of the big blue square!",
        "Red circle; blue square.",
    ],
    12: [
        "A green triangle above a yellow circle.",
        "The green triangle is above the yellow circle.",
        "A yellow circle below a green triangle.",
        "Green triangle over a yellow circle.",
        "A triangle (green) above a circle (yellow).",
    ],
    13: [
        "Two blue squares.",
        "There are two blue squares.",
        "Two squares, both blue.",
        "A pair of blue squares.",
        "Two blue squares side by side.",
    ],
    14: [
        "A purple star next to a red square.",
        "A red square and a purple star.",
        "The purple star is next to the red square.",
        "Purple star beside red square.",
        "A star, purple, next to a square, red.",
    ],
    15: [
        "An orange circle.",
        "A single orange circle.",
        "There's one orange circle.",
        "Just an orange circle in the middle.",
        "An orange circle, alone.",
    ],
    16: [
        "Three red triangles in a row.",
        "Three triangles, all red.",
        "A row of three red triangles.",
        "There are three red triangles.",
        "Red triangles, three of them, in a row.",
    ],
}
PREDICTIONS = {
    11: "A red circle left of a blue square.",  # exact (up to case and punctuation)
    12: "a green triangle above a blue circle",  # one wrong word
    13: "Two blue squares",  # exact without the period
    14: "a red star next to a purple square",  # colours swapped
    15: "three green squares",  # wrong
    16: "a row of red triangles",  # partial
}
SCORED = list(METRIC_NAMES)
NO_METEOR = [name for name in SCORED if name != "METEOR"]


class _NoSpice:
    """COCOEvalCap always runs SPICE, which downloads Stanford models; the tests stay offline."""

    def compute_score(self, gts, res):
        return 0.0, [0.0] * len(gts)

    def method(self):
        return "SPICE"


class _PythonTokenizer:
    def tokenize(self, captions):
        return {k: [" ".join(tokenize(c["caption"])) for c in v] for k, v in captions.items()}


class _NoMeteor:
    def compute_score(self, gts, res):
        return float("nan"), [float("nan")] * len(gts)

    def method(self):
        return "METEOR"


@pytest.fixture(scope="module")
def coco_files(tmp_path_factory):
    root = tmp_path_factory.mktemp("metrics")
    images = [{"id": i, "file_name": f"{i}.png", "width": 64, "height": 64} for i in REFERENCES]
    annotations = [
        {"id": image_id * 10 + k, "image_id": image_id, "caption": caption}
        for image_id, refs in REFERENCES.items()
        for k, caption in enumerate(refs)
    ]
    annotation_file = root / "captions.json"
    annotation_file.write_text(
        json.dumps({"info": {}, "licenses": [], "images": images, "annotations": annotations})
    )
    results_file = root / "results.json"
    results_file.write_text(
        json.dumps([{"image_id": i, "caption": c} for i, c in PREDICTIONS.items()])
    )
    return annotation_file, results_file


@pytest.fixture(scope="module")
def official(coco_files):
    """What pycocoevalcap's standard evaluation gives on the fixture files."""
    annotation_file, results_file = coco_files
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(cocoeval, "Spice", _NoSpice)
        if not java_available():
            # Keeps the comparison of the pure-Python scorers meaningful on machines without Java.
            mp.setattr(cocoeval, "PTBTokenizer", _PythonTokenizer)
            mp.setattr(cocoeval, "Meteor", _NoMeteor)
        coco = COCO(str(annotation_file))
        res = coco.loadRes(str(results_file))
        evaluator = cocoeval.COCOEvalCap(coco, res)
        evaluator.params["image_id"] = res.getImgIds()
        evaluator.evaluate()
    return evaluator.eval


@pytest.fixture(scope="module")
def ours():
    return caption_metrics(PREDICTIONS, REFERENCES)


@pytest.fixture(scope="module")
def perfect():
    predictions = {image_id: refs[1] for image_id, refs in REFERENCES.items()}
    with pytest.MonkeyPatch.context() as mp:
        # METEOR's Java start-up is the slow part, and it is already compared in another test.
        mp.setattr(captions_module, "_meteor", lambda gts, res: None)
        return predictions, caption_metrics(predictions, REFERENCES)


@pytest.fixture
def no_java(monkeypatch):
    monkeypatch.setattr(captions_module, "java_available", lambda: False)
    monkeypatch.setattr(captions_module, "_warned", set())

    def fail(*args, **kwargs):
        raise AssertionError("Java was called although java_available() is False")

    monkeypatch.setattr(captions_module, "PTBTokenizer", fail)
    monkeypatch.setattr(captions_module, "Meteor", fail)


def test_keys(ours):
    assert list(ours) == [
        *SCORED[:5],
        *BLEU_NO_BP_NAMES,
        "Bleu_brevity_penalty",
        "Bleu_length_ratio",
        *SCORED[5:],
    ]


def test_matches_cocoevalcap(ours, official):
    for name in NO_METEOR:
        assert ours[name] == pytest.approx(official[name], abs=1e-9, rel=0), name
    assert 0 < ours["Bleu_4"] < 1
    assert 0 < ours["CIDEr"]


def test_meteor_matches_cocoevalcap(ours, official):
    if not java_available():
        pytest.skip("METEOR needs Java")
    assert ours["METEOR"] == pytest.approx(official["METEOR"], abs=1e-9, rel=0)
    assert 0 < ours["METEOR"] < 1


def test_scores_only_the_predicted_images(ours):
    # Extra reference images must change nothing (they are not part of the scored set).
    extra = dict(REFERENCES)
    extra[99] = ["Something else entirely."]
    with pytest.MonkeyPatch.context() as mp:
        # Only the scorers that do not need Java, to keep this test fast.
        mp.setattr(captions_module, "java_available", lambda: False)
        mp.setattr(captions_module, "_warned", set())
        a = caption_metrics(PREDICTIONS, REFERENCES)
        b = caption_metrics(PREDICTIONS, extra)
    assert a == b


def test_perfect_predictions(perfect, ours):
    predictions, scores = perfect
    assert scores["Bleu_4"] == pytest.approx(1.0, abs=1e-6)
    assert scores["CIDEr"] > ours["CIDEr"]
    assert scores["ROUGE_L"] == pytest.approx(1.0)
    assert exact_match(predictions, REFERENCES) == 1.0
    for name in NO_METEOR:
        assert scores[name] > ours[name], name
    assert exact_match(PREDICTIONS, REFERENCES) == pytest.approx(2 / 6)


def test_exact_match_ignores_case_and_punctuation():
    refs = {1: ["a red circle"], 2: ["Two blue squares, side by side."]}
    assert exact_match({1: "A red circle."}, refs) == 1.0
    assert exact_match({2: "two blue squares side by side"}, refs) == 1.0
    assert exact_match({1: "a red square"}, refs) == 0.0
    assert exact_match({1: "a red circle", 2: "two squares"}, refs) == 0.5


def test_exact_match_by_group():
    refs = {i: [f"caption {i}"] for i in range(1, 8)}
    predictions = {
        1: "Caption 1.",
        2: "caption 2",  # group 1: 2/2
        3: "caption 3",
        4: "wrong",  # group 2: 1/2
        5: "wrong",  # group 3: 0/1
        6: "caption 6",  # group 10: 1/1
    }
    groups = {1: 1, 2: 1, 3: 2, 4: 2, 5: 3, 6: 10, 7: 4}  # group 4 has no predicted image
    result = exact_match_by_group(predictions, refs, groups)
    assert result == {"1": 1.0, "2": 0.5, "3": 0.0, "10": 1.0}
    assert list(result) == ["1", "2", "3", "10"]
    with pytest.raises(CaptioningError, match="6"):
        exact_match_by_group(predictions, refs, {i: 1 for i in range(1, 6)})


def test_without_java(no_java, caplog):
    first = caption_metrics(PREDICTIONS, REFERENCES)
    second = caption_metrics(PREDICTIONS, REFERENCES)
    assert first == second
    assert first["METEOR"] is None
    for name in NO_METEOR:
        assert math.isfinite(first[name]) and first[name] > 0, name
    warnings = [r for r in caplog.records if r.levelname == "WARNING" and "METEOR" in r.message]
    assert len(warnings) == 1
    assert "\n" not in warnings[0].getMessage()
    with pytest.raises(CaptioningError, match="SPICE"):
        caption_metrics(PREDICTIONS, REFERENCES, spice=True)


def test_python_bleu_matches_java_bleu_on_plain_text(monkeypatch):
    if not java_available():
        pytest.skip("needs Java for the comparison")
    refs = {
        1: ["a red circle left of a blue square", "a red circle and a blue square"],
        2: ["two blue squares", "there are two blue squares"],
        3: ["a green triangle above a yellow circle", "green triangle over yellow circle"],
    }
    predictions = {1: "a red circle near a blue square", 2: "two blue squares", 3: "a triangle"}
    gts = tokenize_for_eval(refs)
    res = tokenize_for_eval({i: [c] for i, c in predictions.items()})
    java_bleu, _ = Bleu(4).compute_score(gts, res, verbose=0)

    monkeypatch.setattr(captions_module, "java_available", lambda: False)
    monkeypatch.setattr(captions_module, "_warned", set())
    python = caption_metrics(predictions, refs)
    for n in range(4):
        assert python[f"Bleu_{n + 1}"] == pytest.approx(java_bleu[n], abs=1e-12, rel=0)


def test_java_and_python_tokenizers_agree():
    if not java_available():
        pytest.skip("needs Java for the comparison")
    java = tokenize_for_eval(REFERENCES)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(captions_module, "java_available", lambda: False)
        python = tokenize_for_eval(REFERENCES)
    # PTBTokenizer lower-cases "-LRB-" before its punctuation filter (which looks for "-LRB-"),
    # so brackets survive as "-lrb-"/"-rrb-" tokens in the official evaluation.
    assert java[12][4] == "a triangle -lrb- green -rrb- above a circle -lrb- yellow -rrb-"
    assert python[12][4] == "a triangle green above a circle yellow"
    del java[12], python[12]
    assert java == python


def test_line_breaks_inside_captions_do_not_shift_others():
    captions = {1: ["a red\rcircle", "a\u2028b"], 2: ["two blue squares"], 3: []}
    out = tokenize_for_eval(captions)
    assert out == {1: ["a red circle", "a b"], 2: ["two blue squares"], 3: []}


def test_missing_reference_raises():
    with pytest.raises(CaptioningError, match="42"):
        caption_metrics({11: "a red circle", 42: "a blue square"}, REFERENCES)
    with pytest.raises(CaptioningError, match="42"):
        exact_match({42: "a blue square"}, REFERENCES)


def test_bad_inputs_raise():
    with pytest.raises(CaptioningError, match="no predictions"):
        caption_metrics({}, REFERENCES)
    with pytest.raises(CaptioningError, match="list of strings"):
        caption_metrics({1: "a red circle"}, {1: "a red circle"})
    with pytest.raises(CaptioningError, match="empty"):
        caption_metrics({1: "a red circle"}, {1: []})


def test_spice_failure_is_a_one_line_error(monkeypatch):
    class BrokenSpice:
        def compute_score(self, gts, res):
            raise RuntimeError("no models\nsecond line")

    monkeypatch.setattr(captions_module, "Spice", BrokenSpice)
    if not java_available():
        pytest.skip("SPICE is refused earlier without Java")
    with pytest.raises(CaptioningError, match="SPICE failed") as info:
        caption_metrics(PREDICTIONS, REFERENCES, spice=True)
    assert "\n" not in str(info.value)


def test_bleu_without_the_brevity_penalty_is_the_papers_form():
    """Xu et al. (2015) report BLEU without the brevity penalty: the same clipped n-gram
    precisions, with exp(1 - r/c) divided out when the captions are shorter than the
    references, and nothing changed when they are not."""
    refs = {
        1: ["a dog runs across the green grass", "a brown dog is running on a lawn"],
        2: ["a man rides a bike down a steep hill", "a person rides a bicycle"],
    }
    short = {1: "a dog runs", 2: "a man rides a bike"}
    scores = caption_metrics(short, refs, meteor=False)
    tokens_refs, tokens_res = (
        tokenize_for_eval(refs),
        tokenize_for_eval({k: [v] for k, v in short.items()}),
    )
    pycoco, _ = Bleu(4).compute_score(tokens_refs, tokens_res, verbose=0)
    assert [scores[f"Bleu_{n}"] for n in range(1, 5)] == pytest.approx(pycoco)
    # 3 + 5 caption words against the closest reference lengths 7 and 5
    assert scores["Bleu_length_ratio"] == pytest.approx(8 / 12)
    assert scores["Bleu_brevity_penalty"] == pytest.approx(math.exp(1 - 12 / 8))
    # unigram precision: every word of both captions is in a reference
    assert scores["Bleu_1_no_bp"] == pytest.approx(1.0)
    for n in range(1, 5):
        assert scores[f"Bleu_{n}_no_bp"] * scores["Bleu_brevity_penalty"] == pytest.approx(
            scores[f"Bleu_{n}"]
        )
    long = {
        1: "a brown dog runs across the green grass of a big lawn",
        2: "a person rides a bicycle",
    }
    scores = caption_metrics(long, refs, meteor=False)
    assert scores["Bleu_brevity_penalty"] == 1.0
    assert all(scores[f"Bleu_{n}_no_bp"] == scores[f"Bleu_{n}"] for n in range(1, 5))


class _FakeProcess:
    def __init__(self):
        self.killed = False
        self.stdin, self.stdout, self.stderr = (io.BytesIO() for _ in range(3))

    def kill(self):
        self.killed = True

    def wait(self):
        return 0


def test_one_meteor_process_serves_every_score_and_a_failed_one_is_replaced(monkeypatch, caplog):
    started = []

    class Scorer:
        def __init__(self):
            self.lock, self.meteor_p, self.fail = threading.Lock(), _FakeProcess(), False
            started.append(self)

        def compute_score(self, gts, res):
            self.lock.acquire()  # held when it raises, as pycocoevalcap's scorer does
            if self.fail:
                raise BrokenPipeError("the JVM went away")
            self.lock.release()
            return 0.25, [0.25] * len(gts)

    monkeypatch.setattr(captions_module, "Meteor", Scorer)
    monkeypatch.setattr(captions_module, "_meteor_scorer", None)
    gts, res = {1: ["a red circle"]}, {1: ["a circle"]}
    assert captions_module._meteor(gts, res) == captions_module._meteor(gts, res) == 0.25
    assert len(started) == 1  # the second score reused the first process
    started[0].fail = True
    with caplog.at_level(logging.WARNING, logger="captioning"):
        assert captions_module._meteor(gts, res) is None
    assert "METEOR failed, reported as None: BrokenPipeError" in caplog.text
    assert started[0].meteor_p.killed and not started[0].lock.locked()
    assert captions_module._meteor(gts, res) == 0.25 and len(started) == 2  # a fresh one
    captions_module._stop_meteor()  # what the process does at exit
    assert started[1].meteor_p.killed and captions_module._meteor_scorer is None
