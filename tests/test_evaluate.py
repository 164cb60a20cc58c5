"""Grounding metrics, the evaluate verb and the caption verb."""

import contextlib
import io
import json

import pytest
import torch
from PIL import Image

from captioning.cli import main
from captioning.data.records import ImageRecord, ObjectAnnotation
from captioning.data.vocab import Vocabulary
from captioning.evaluate import evaluate_checkpoint
from captioning.inference.decoding import Decoded
from captioning.metrics.grounding import (
    centre_in_box,
    grounding_scores,
    named_object,
    point_and_mass,
)
from captioning.models.trace import AttentionTrace
from captioning.training.train import fit

from .test_train import tiny


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    from captioning.data.shapes import generate_shapes

    root = tmp_path_factory.mktemp("shapes")
    generate_shapes(root, num_train=24, num_val=6, num_test=8, seed=1, image_size=48)
    run = tmp_path_factory.mktemp("run")
    fit(tiny(root, "train.epochs=1"), out_dir=run)
    return root, run / "best.pt"


def test_point_and_mass():
    # a 2x4 grid over a 40x20 image: cells are 10x10
    alpha = torch.zeros(8)
    alpha[5] = 1.0  # row 1, column 1: x 10..20, y 10..20
    hit, mass = point_and_mass(alpha, (10, 10, 10, 10), (2, 4), 40, 20)
    assert hit and mass == pytest.approx(1.0)
    hit, mass = point_and_mass(alpha, (12, 12, 4, 4), (2, 4), 40, 20)
    assert hit and mass == pytest.approx(16 / 100)  # the box covers 16% of the cell
    # dilation by half a cell: a box just beyond the peak cell's centre still counts
    hit, _ = point_and_mass(alpha, (20, 10, 5, 5), (2, 4), 40, 20)  # right of the cell
    assert hit
    hit, mass = point_and_mass(alpha, (31, 0, 9, 9), (2, 4), 40, 20)
    assert not hit and mass == 0.0


def test_named_object_needs_exactly_one_match():
    red = ObjectAnnotation(1, (0, 0, 5, 5), "circle", {"color": "red", "size": "small"})
    blue = ObjectAnnotation(2, (9, 9, 5, 5), "circle", {"color": "blue", "size": "small"})
    assert named_object("red", [red, blue], {}) == ("color", red)
    assert named_object("circle", [red, blue], {}) is None  # two circles
    assert named_object("small", [red, blue], {}) is None
    assert named_object("circle", [red], {}) == ("category", red)
    dog = ObjectAnnotation(3, (0, 0, 5, 5), "dog")
    assert named_object("puppy", [dog], {"puppy": "dog"}) == ("category", dog)
    assert named_object("a", [red, dog], {}) is None


def test_grounding_scores_by_word_type():
    vocab = Vocabulary(["<pad>", "<start>", "<end>", "<unk>", "a", "red", "circle", "blue"])
    red = ObjectAnnotation(1, (0, 0, 10, 10), "circle", {"color": "red"})
    blue = ObjectAnnotation(2, (30, 10, 10, 10), "square", {"color": "blue"})
    record = ImageRecord(7, "x.png", "test", ("a red circle",), 40, 20, (red, blue))
    alphas = torch.zeros(3, 8)
    alphas[0, 0] = 1.0  # "a": not grounded
    alphas[1, 0] = 1.0  # "red": on the red circle (cell 0)
    alphas[2, 7] = 1.0  # "circle": on the blue square's cell
    decoded = Decoded(
        torch.tensor([4, 5, 6]), torch.tensor(3), torch.tensor(0.0), AttentionTrace(alphas)
    )
    scores = grounding_scores([record], {7: decoded}, vocab, (2, 4))
    assert scores["grounded_words"] == 2
    assert scores["pointing_game"] == pytest.approx(0.5)
    assert scores["grounding_by_word_type"]["pointing_game/color"] == 1.0
    assert scores["grounding_by_word_type"]["pointing_game/category"] == 0.0
    assert scores["attention_in_box"] == pytest.approx(0.5)
    assert "centre_pointing_game" not in scores  # no centres: a model without local attention
    assert not any(k.startswith("centre") for k in scores["grounding_by_word_type"])


def test_centre_in_box():
    # a 2x4 grid over a 40x20 image: cells are 10x10; the centre is (row, column) in cells
    box = (10, 10, 10, 10)  # x 10..20, y 10..20: the cell at row 1, column 1
    assert centre_in_box((1.5, 1.5), box, (2, 4), 40, 20)  # (15, 15) px: the middle
    assert centre_in_box(torch.tensor([1.0, 2.0]), box, (2, 4), 40, 20)  # (20, 10): a corner
    assert not centre_in_box((1.5, 3.5), box, (2, 4), 40, 20)  # (35, 15): far right
    # dilated by half a cell (5 px), as the peak cell's pointing game
    assert centre_in_box((0.6, 2.4), box, (2, 4), 40, 20)  # (24, 6)
    assert not centre_in_box((0.4, 1.5), box, (2, 4), 40, 20)  # (15, 4): 6 px above
    assert not centre_in_box((1.5, 2.6), box, (2, 4), 40, 20)  # (26, 15): 6 px right
    # the column gives x and the row y: a 4x2 grid's cells are 20 wide and 5 high, so
    # (0.5, 1.5) is (30, 2.5) px; read the other way round it would be (10, 7.5)
    assert centre_in_box((0.5, 1.5), (25, 0, 10, 5), (4, 2), 40, 20)
    assert not centre_in_box((0.5, 1.5), (5, 5, 5, 5), (4, 2), 40, 20)


def test_centre_pointing_game_by_word_type():
    vocab = Vocabulary(["<pad>", "<start>", "<end>", "<unk>", "a", "red", "circle", "blue"])
    red = ObjectAnnotation(1, (0, 0, 10, 10), "circle", {"color": "red"})
    blue = ObjectAnnotation(2, (30, 10, 10, 10), "square", {"color": "blue"})
    record = ImageRecord(7, "x.png", "test", ("a red circle",), 40, 20, (red, blue))
    alphas = torch.zeros(4, 8)
    alphas[:, 0] = 1.0  # every peak on cell 0, the red circle's
    centres = torch.tensor(
        [
            [1.5, 3.5],  # "a": not grounded
            [0.5, 0.5],  # "red": (5, 5) px, inside the red circle's box
            [1.5, 3.5],  # "circle": (35, 15) px, on the blue square, not the circle
            [1.0, 1.0],  # <end>
        ]
    )
    decoded = Decoded(
        torch.tensor([4, 5, 6, 0]),
        torch.tensor(3),
        torch.tensor(0.0),
        AttentionTrace(alphas, centre=centres),
    )
    scores = grounding_scores([record], {7: decoded}, vocab, (2, 4))
    assert scores["pointing_game"] == 1.0  # the peaks are all on the circle
    assert scores["centre_pointing_game"] == pytest.approx(0.5)
    by_type = scores["grounding_by_word_type"]
    assert by_type["centre_pointing_game/color"] == 1.0
    assert by_type["centre_pointing_game/category"] == 0.0
    assert by_type["pointing_game/category"] == 1.0
    decoded.trace.centre[2] = torch.tensor([0.2, 0.9])  # (9, 2) px: now on the circle
    assert grounding_scores([record], {7: decoded}, vocab, (2, 4))["centre_pointing_game"] == 1.0


def test_evaluate_reports_the_centre_pointing_game_of_a_local_model(tiny_local_checkpoint):
    import captioning
    from captioning.data import load_splits
    from captioning.inference.caption import caption_files
    from captioning.metrics.grounding import COCO_SYNONYMS

    metrics = evaluate_checkpoint(tiny_local_checkpoint, split="test", meteor=False, progress=False)
    assert "centre_pointing_game" in metrics
    by_type = metrics["grounding_by_word_type"]
    types = [k.split("/")[1] for k in by_type if k.startswith("pointing_game/")]
    assert types and all(f"centre_pointing_game/{t}" in by_type for t in types)
    # the same score from the centres of the captions the Python API gives
    loaded = captioning.load(tiny_local_checkpoint, device="cpu")
    records = load_splits(loaded.config.data)["test"]
    hits = []
    results = caption_files(
        [r.path for r in records], loaded.model, loaded.vocab, loaded.config, loaded.device
    )
    for record, result in zip(records, results):
        for t, word in enumerate(result.words):
            found = named_object(word, record.objects, COCO_SYNONYMS)
            if found is not None:
                hits.append(
                    centre_in_box(
                        result.centres[t],
                        found[1].bbox,
                        loaded.grid_shape,
                        record.width,
                        record.height,
                    )
                )
    assert len(hits) == metrics["grounded_words"] > 0
    assert metrics["centre_pointing_game"] == pytest.approx(sum(hits) / len(hits))


@pytest.mark.slow  # a whole pipeline (make test-slow)
def test_evaluate_matches_pycocoevalcap_on_the_predictions_file(trained, tmp_path):
    from pycocoevalcap.eval import COCOEvalCap
    from pycocotools.coco import COCO

    root, checkpoint = trained
    metrics = evaluate_checkpoint(checkpoint, split="test", out_dir=tmp_path, progress=False)
    saved = json.loads((tmp_path / "metrics.json").read_text())
    for key in (
        "Bleu_1",
        "Bleu_4",
        "METEOR",
        "ROUGE_L",
        "CIDEr",
        "exact_match",
        "num_images",
        "exact_match_by_objects",
        "pointing_game",
        "attention_in_box",
    ):
        assert key in saved, key
    assert saved["num_images"] == 8
    assert "centre_pointing_game" not in saved  # soft attention has no centres
    predictions = json.loads((tmp_path / "predictions.json").read_text())
    assert sorted(p.keys() for p in predictions)[0] == {"image_id", "caption"}

    with contextlib.redirect_stdout(io.StringIO()):
        coco = COCO(str(root / "annotations" / "captions_test.json"))
        results = coco.loadRes(str(tmp_path / "predictions.json"))
        evaluator = COCOEvalCap(coco, results)
        evaluator.params["image_id"] = results.getImgIds()
        import pycocoevalcap.eval as eval_module

        class NoSpice:  # SPICE downloads models; everything else is the official code path
            def compute_score(self, gts, res):
                return 0.0, []

            def method(self):
                return "SPICE"

        real_spice = eval_module.Spice
        eval_module.Spice = NoSpice
        try:
            evaluator.evaluate()
        finally:
            eval_module.Spice = real_spice
    for key in ("Bleu_1", "Bleu_2", "Bleu_3", "Bleu_4", "METEOR", "ROUGE_L", "CIDEr"):
        assert metrics[key] == pytest.approx(evaluator.eval[key], abs=1e-9), key


@pytest.mark.slow  # four evaluations through the CLI, METEOR's Java each time
def test_evaluate_cli_beam_and_table(trained, tmp_path, capsys):
    _, checkpoint = trained
    code = main(
        [
            "evaluate",
            "--checkpoint",
            str(checkpoint),
            "--split",
            "val",
            "--beam-size",
            "3",
            "--out",
            str(tmp_path),
            "--quiet",
        ]
    )
    out = capsys.readouterr().out
    assert code == 0 and "CIDEr" in out and "exact_match" in out
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    assert metrics["decoding"] == {
        "strategy": "beam",
        "beam_size": 3,
        "hard_context": None,
        "precision": "fp32",
    }
    assert main(["evaluate", "--checkpoint", str(tmp_path / "none.pt")]) == 2
    assert "checkpoint not found" in capsys.readouterr().err


def test_caption_cli_reports_bad_files_and_captions_the_rest(trained, tmp_path, capsys):
    root, checkpoint = trained
    good = sorted((root / "images" / "test").glob("*.png"))[:2]
    photo = tmp_path / "photo.webp"
    Image.new("RGBA", (300, 200), (200, 30, 30, 128)).save(photo)
    text = tmp_path / "notes.jpg"
    text.write_text("not an image")
    images = [
        str(good[0]),
        str(tmp_path / "missing.png"),
        str(tmp_path),
        str(text),
        str(photo),
        str(good[1]),
    ]
    figures = tmp_path / "att"
    code = main(
        [
            "caption",
            *images,
            "--checkpoint",
            str(checkpoint),
            "--json",
            "--attention-dir",
            str(figures),
            "--gif",
        ]
    )
    captured = capsys.readouterr()
    lines = [json.loads(line) for line in captured.out.splitlines()]
    assert code == 2
    assert [line["image"] for line in lines] == images
    assert [("caption" in line) for line in lines] == [True, False, False, False, True, True]
    assert "no such file" in lines[1]["error"] and "directory" in lines[2]["error"]
    assert "not a JPEG, PNG, WebP, GIF, BMP or TIFF image" in lines[3]["error"]
    assert len(captured.err.strip().splitlines()) == 3
    assert all(line.startswith("error: ") for line in captured.err.strip().splitlines())
    for line in lines:
        if "caption" in line and line["caption"]:
            assert (figures / (line["image"].rsplit("/", 1)[1].rsplit(".", 1)[0] + ".png")).exists()
    assert list(figures.glob("*.gif"))


def test_cli_refuses_bad_counts_and_devices_in_one_line(trained, tmp_path, capsys):
    root, checkpoint = trained
    image = str(sorted((root / "images" / "test").glob("*.png"))[0])
    for argv, message in (
        (
            ["evaluate", "--checkpoint", str(checkpoint), "--max-images", "-1"],
            "--max-images: must be a whole number of at least 1, got '-1'",
        ),
        (
            ["caption", image, "--checkpoint", str(checkpoint), "--device", "tpu9"],
            "unknown device 'tpu9'; use auto, cpu, cuda or cuda:N",
        ),
        (
            ["evaluate", "--checkpoint", str(checkpoint), "--device", "meta"],
            "unknown device 'meta'",
        ),
    ):
        refused = pytest.raises(SystemExit) if "--max-images" in argv else None
        with refused or contextlib.nullcontext() as exited:
            code = main(argv)
        code = exited.value.code if exited is not None else code
        err = capsys.readouterr().err.strip().splitlines()
        assert code == 2 and message in err[-1], (argv, err)
        assert not any("Traceback" in line for line in err)


def test_a_huge_image_is_reported_and_the_others_captioned(trained, tmp_path, capsys):
    from .test_images import _png_declaring

    root, checkpoint = trained
    good = str(sorted((root / "images" / "test").glob("*.png"))[0])
    big = _png_declaring(tmp_path / "big.png", 12000, 12000)
    assert main(["caption", big, good, "--checkpoint", str(checkpoint), "--json"]) == 2
    captured = capsys.readouterr()
    lines = [json.loads(line) for line in captured.out.splitlines()]
    assert "more than data.max_image_pixels=64,000,000" in lines[0]["error"]
    assert lines[1]["image"] == good and "caption" in lines[1]


def test_caption_cli_refuses_a_bad_checkpoint(trained, tmp_path, capsys):
    root, _ = trained
    fake = tmp_path / "model.pt"
    torch.save({"weights": torch.zeros(2)}, fake)
    image = sorted((root / "images" / "test").glob("*.png"))[0]
    assert main(["caption", str(image), "--checkpoint", str(fake)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "not a captioning checkpoint" in err[0] and str(fake) in err[0]


@pytest.mark.parametrize("instances", ["none", "coco"])
def test_evaluate_reports_only_what_the_data_supports(trained, tmp_path, instances):
    # The shapes test split read as a plain COCO-style dataset: without instances, or with
    # COCO instances (no colour or size, categories that no generated word names). Neither
    # has object counts in its captions, nor a word to ground: those lines must not show.
    import shutil

    from captioning.evaluate import format_table

    root, checkpoint = trained
    data = tmp_path / "data"
    shutil.copytree(root, data)
    for path in sorted((data / "annotations").glob("instances_*.json")):
        if instances == "none":
            path.unlink()
            continue
        coco = json.loads(path.read_text())
        for annotation in coco["annotations"]:
            del annotation["color"], annotation["size"]
        names = ["dog", "cat", "car"]
        coco["categories"] = [{"id": c["id"], "name": n} for c, n in zip(coco["categories"], names)]
        path.write_text(json.dumps(coco))
    metrics = evaluate_checkpoint(
        checkpoint,
        split="test",
        data_root=str(data),
        meteor=False,
        out_dir=tmp_path / "eval",
        progress=False,
    )
    saved = json.loads((tmp_path / "eval" / "metrics.json").read_text())
    for key in (
        "exact_match_by_objects",
        "pointing_game",
        "attention_in_box",
        "grounded_words",
        "grounding_by_word_type",
    ):
        assert key not in metrics and key not in saved, key
    assert saved["exact_match"] == metrics["exact_match"] and saved["num_images"] == 8
    table = format_table(metrics)
    assert "exact_match " in table and " obj" not in table and "pointing" not in table, table
    # The same images as shapes data keep both.
    full = evaluate_checkpoint(checkpoint, split="test", meteor=False, progress=False)
    assert set(full["exact_match_by_objects"]) <= {"1", "2", "3"} and full["grounded_words"] > 0


def test_applicable_metrics_keeps_what_each_kind_of_data_supports():
    from captioning.evaluate import applicable_metrics

    shape = ObjectAnnotation(1, (0, 0, 5, 5), "circle", {"color": "red", "size": "small"})
    dog = ObjectAnnotation(2, (0, 0, 5, 5), "dog", {})
    scores = {
        "CIDEr": 0.5,
        "METEOR": None,
        "exact_match": 0.25,
        "exact_match_by_objects": {"1": 0.25},
        "pointing_game": 0.5,
        "attention_in_box": 0.4,
        "grounded_words": 4,
        "grounding_by_word_type": {"pointing_game/color": 0.5, "pointing_game/size": None},
    }
    shapes = [ImageRecord(1, "a.png", "test", ("a red circle",), 9, 9, (shape,))]
    coco = [ImageRecord(1, "a.png", "test", ("a dog",), 9, 9, (dog,))]
    plain = [ImageRecord(1, "a.png", "test", ("một con chó",), 9, 9)]
    kept = applicable_metrics(scores, shapes)
    assert kept["exact_match_by_objects"] == {"1": 0.25} and kept["pointing_game"] == 0.5
    assert kept["grounding_by_word_type"] == {"pointing_game/color": 0.5}
    assert kept["METEOR"] is None  # not computed is said, not hidden
    kept = applicable_metrics(scores, coco)
    assert "exact_match_by_objects" not in kept and kept["grounded_words"] == 4
    ungrounded = {
        **scores,
        "pointing_game": None,
        "attention_in_box": None,
        "grounded_words": 0,
        "grounding_by_word_type": {},
    }
    for records in (coco, plain):
        kept = applicable_metrics(ungrounded, records)
        assert set(kept) == {"CIDEr", "METEOR", "exact_match"}


def test_meteor_is_left_out_for_captions_that_are_not_english(trained, tmp_path, monkeypatch):
    import torch

    from captioning.checkpoint import save_checkpoint
    from captioning.evaluate import format_table
    from captioning.metrics import captions

    _, checkpoint = trained
    payload = torch.load(checkpoint, weights_only=True)
    payload["config"]["data"]["language"] = "vi"
    vietnamese = save_checkpoint(payload, tmp_path / "vi.pt")

    def no_meteor(*args, **kwargs):
        raise AssertionError("METEOR computed for Vietnamese captions")

    monkeypatch.setattr(captions, "_meteor", no_meteor)
    metrics = evaluate_checkpoint(vietnamese, split="test", progress=False)
    assert "METEOR" not in metrics and "CIDEr" in metrics
    assert "METEOR" not in format_table(metrics)


def test_an_instances_file_the_user_names_and_that_is_missing_is_an_error(
    tiny_checkpoint, tiny_shapes, tmp_path, capsys
):
    out = tmp_path / "eval"
    code = main(
        [
            "evaluate",
            "--checkpoint",
            str(tiny_checkpoint),
            "--split",
            "test",
            "--set",
            f"data.root={tiny_shapes}",
            "--set",
            "data.instances=instances_{split}.json",
            "--out",
            str(out),
        ]
    )
    assert code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert "data.instances=instances_{split}.json names no file for split 'test'" in lines[-1]
    assert not (out / "grounding.json").exists()
