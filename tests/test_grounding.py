"""Grounding against category boxes: the word map, the pointing game and mass with their
baselines, every kind of attention, evaluate's grounding.json and --set, and the boxes that
the figures, the caption verb and the web page outline."""

import json
import math
import shutil

import numpy as np
import pytest
import torch
from PIL import Image

from captioning.cli import main
from captioning.data.records import ImageRecord, ObjectAnnotation
from captioning.data.vocab import Vocabulary
from captioning.errors import ConfigError
from captioning.evaluate import evaluate_checkpoint
from captioning.inference.decoding import Decoded
from captioning.metrics.pointing import (
    Grid,
    box_coverage,
    category_grounding,
    centre_prior,
    peak_hit,
    word_boxes,
)
from captioning.metrics.words import load_category_words, shipped_category_words
from captioning.models.trace import AttentionTrace

from .conftest import ROOT

# a 2x4 grid over a 40x20 image: cells are 10x10, cell i at row i // 4, column i % 4
GRID = Grid(2, 4, 40.0, 20.0)
DOG = ObjectAnnotation(1, (31.0, 11.0, 8.0, 8.0), "dog")  # inside cell 7
PEOPLE = (
    ObjectAnnotation(2, (1.0, 1.0, 8.0, 8.0), "person"),  # inside cell 0
    ObjectAnnotation(3, (11.0, 1.0, 8.0, 8.0), "person"),  # inside cell 1
)
WORDS = ["<pad>", "<start>", "<end>", "<unk>", "a", "puppy", "on", "men", "cat"]
# the centre prior on GRID by hand: u^2 of the inner columns 1/64, of the outer ones 9/64,
# so weights ∝ exp(-8 u^2): inner e^-0.125, outer e^-1.125, in rows of 2 inner, 2 outer
INNER, OUTER = 1 / (4 * (1 + math.e**-1)), math.e**-1 / (4 * (1 + math.e**-1))


def one_hot(*weights: tuple[int, float]) -> torch.Tensor:
    alpha = torch.zeros(8)
    for cell, weight in weights:
        alpha[cell] = weight
    return alpha


def decoded(words: list[str], alphas: list[torch.Tensor], **fields) -> Decoded:
    vocab = Vocabulary(WORDS)
    tokens = torch.tensor([vocab.stoi[w] for w in words])
    trace = AttentionTrace(torch.stack(alphas), **fields)
    return Decoded(tokens, torch.tensor(len(words)), torch.tensor(0.0), trace)


def record(objects=(DOG, *PEOPLE)) -> ImageRecord:
    return ImageRecord(7, "x.png", "test", ("a puppy",), 40, 20, tuple(objects))


# ------------------------------------------------------------------ the map of words


def test_the_shipped_map_names_coco_categories_and_ships_with_the_package():
    words = shipped_category_words()
    assert len(set(words.values())) == 80
    expected = {
        "man": "person",
        "women": "person",
        "boy": "person",
        "girl": "person",
        "child": "person",
        "people": "person",
        "player": "person",
        "puppy": "dog",
        "bike": "bicycle",
        "table": "dining table",
        "dogs": "dog",
    }
    assert {w: words[w] for w in expected} == expected
    package_data = (ROOT / "pyproject.toml").read_text().split("[tool.setuptools.package-data]")[1]
    assert '"captioning.metrics" = ["category_words.json"]' in package_data


def test_a_users_file_adds_moves_and_drops_words(tmp_path):
    extra = tmp_path / "words.yaml"
    extra.write_text("cowboy: person\nPuppy: cat\nglass: null\n")
    words = load_category_words(extra)
    assert words["cowboy"] == "person" and words["puppy"] == "cat" and "glass" not in words
    assert words["man"] == "person"  # the rest stays


@pytest.mark.parametrize(
    "text, message",
    [
        ("[1, 2]", "must map words to categories"),
        ("hot dog: hot dog", "'hot dog' is not a single word"),
        ("puppy: 3", "'puppy' maps to 3; give a category name or null to drop the word"),
        ("puppy: [dog", "is not JSON or YAML text"),
    ],
)
def test_a_bad_users_file_is_one_line(tmp_path, text, message):
    path = tmp_path / "words.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=message) as caught:
        load_category_words(path)
    assert "\n" not in str(caught.value)
    with pytest.raises(ConfigError, match="does not exist"):
        load_category_words(tmp_path / "missing.json")


# ------------------------------------------------------------------ maps and boxes


def test_box_coverage_is_exact_for_a_box_and_for_a_union():
    np.testing.assert_allclose(
        box_coverage([(5, 5, 10, 10)], GRID), [0.25, 0.25, 0, 0, 0.25, 0.25, 0, 0]
    )
    # two overlapping boxes: x 5..20, y 5..15 is covered once, not twice
    union = box_coverage([(5, 5, 10, 10), (10, 5, 10, 10)], GRID)
    np.testing.assert_allclose(union, [0.25, 0.5, 0, 0, 0.25, 0.5, 0, 0])
    assert union.sum() * 100 == pytest.approx(15 * 10)
    np.testing.assert_allclose(box_coverage([(31, 11, 8, 8)], GRID), [0] * 7 + [0.64])


def test_the_pointing_game_shares_a_tied_peak():
    box = [(31, 11, 8, 8)]  # grown by half a cell: x 26..44, y 6..24: only cell 7's centre
    assert peak_hit(one_hot((7, 0.7), (6, 0.3)).numpy(), box, GRID) == 1.0
    assert peak_hit(one_hot((6, 0.7), (7, 0.3)).numpy(), box, GRID) == 0.0
    assert peak_hit(np.full(8, 1 / 8), box, GRID) == 1 / 8
    assert peak_hit(one_hot((6, 0.5), (7, 0.5)).numpy(), box, GRID) == 0.5


def test_the_centre_prior_by_hand():
    prior = centre_prior(GRID)
    np.testing.assert_allclose(prior, [OUTER, INNER, INNER, OUTER] * 2)
    assert prior.sum() == pytest.approx(1.0)


def test_category_grounding_of_a_hand_built_caption():
    # "a puppy on men": "puppy" names the dog, "men" the two people
    alphas = [
        one_hot((0, 1.0)),
        one_hot((7, 0.7), (6, 0.3)),
        torch.full((8,), 1 / 8),
        one_hot((1, 1.0)),
    ]
    report = category_grounding(
        [record()],
        {7: decoded(["a", "puppy", "on", "men"], alphas)},
        Vocabulary(WORDS),
        (2, 4),
        shipped_category_words(),
    )
    overall, dog, men = report["overall"], report["categories"]["dog"], report["words"]["men"]
    assert overall["words"] == 2 and dog["words"] == 1 and men["category"] == "person"
    assert dog["model"]["pointing"] == 1.0 and dog["model"]["mass"] == pytest.approx(0.7 * 0.64)
    assert men["model"]["pointing"] == 1.0 and men["model"]["mass"] == pytest.approx(0.64)
    assert dog["even"]["pointing"] == 1 / 8 and dog["even"]["mass"] == pytest.approx(0.08)
    assert men["even"]["pointing"] == 2 / 8 and men["even"]["mass"] == pytest.approx(0.16)
    # the centre prior peaks on the four inner cells: none is the dog's, one a person's
    assert dog["centre"]["pointing"] == 0.0 and dog["centre"]["mass"] == pytest.approx(OUTER * 0.64)
    assert men["centre"]["pointing"] == 0.25
    assert men["centre"]["mass"] == pytest.approx((OUTER + INNER) * 0.64)
    # the caption's mean map: cells 0 and 1 at 1.125 / 4 (a tie), cell 7 at 0.825 / 4
    assert dog["saliency"]["pointing"] == 0.0 and men["saliency"]["pointing"] == 1.0
    assert dog["saliency"]["mass"] == pytest.approx(0.825 / 4 * 0.64)
    assert men["saliency"]["mass"] == pytest.approx(1.125 / 4 * 0.64 * 2)
    assert overall["model"]["pointing"] == 1.0
    assert overall["model"]["mass"] == pytest.approx((0.448 + 0.64) / 2)
    assert overall["model"]["median_peak"] == pytest.approx(0.85)
    entropy = -(0.7 * math.log(0.7) + 0.3 * math.log(0.3))
    assert overall["model"]["mean_entropy"] == pytest.approx(entropy / 2)
    assert overall["even"]["mean_entropy"] == pytest.approx(math.log(8))
    assert list(overall) == ["words", "model", "even", "centre", "saliency"]
    assert report["all_words"]["words"] == 4 and report["absent"] == {}


def test_more_maps_of_each_word_are_scored_beside_the_models():
    # "a puppy": the localiser's map of "puppy" peaks on the dog's cell 7 with 0.6 of its
    # weight, and the model's on cell 6 (outside the dog's box)
    alphas = [one_hot((0, 1.0)), one_hot((6, 1.0))]
    localiser = torch.stack([torch.full((8,), 1 / 8), one_hot((7, 0.6), (3, 0.4))])
    report = category_grounding(
        [record()],
        {7: decoded(["a", "puppy"], alphas)},
        Vocabulary(WORDS),
        (2, 4),
        shipped_category_words(),
        extra_maps={7: {"localiser": localiser}, 8: {"localiser": localiser}},
    )
    dog = report["categories"]["dog"]
    assert dog["model"]["pointing"] == 0.0 and dog["model"]["mass"] == 0.0
    assert dog["localiser"]["pointing"] == 1.0
    assert dog["localiser"]["mass"] == pytest.approx(0.6 * 0.64)
    assert dog["localiser"]["median_peak"] == pytest.approx(0.6)
    assert list(report["overall"]) == ["words", "model", "localiser", "even", "centre", "saliency"]


def test_a_word_whose_category_the_photo_lacks_is_counted_apart():
    alphas = [one_hot((0, 1.0)), one_hot((7, 1.0))]
    report = category_grounding(
        [record(PEOPLE)],
        {7: decoded(["a", "cat"], alphas)},
        Vocabulary(WORDS),
        (2, 4),
        shipped_category_words(),
    )
    assert report["overall"]["words"] == 0 and report["absent"] == {"cat": 1}


def test_every_kind_of_attention_is_scored():
    # "men": head 1 on cell 1 (a person), head 2 on cell 7; hard attention chose cell 7; the
    # local centre (row 0.5, column 1.5) is (15, 5) px, inside the second person's box
    heads = torch.stack([one_hot((1, 1.0)), one_hot((7, 1.0))])[None]  # (1, 2, 8)
    trace = {"heads": heads, "cell": torch.tensor([7]), "centre": torch.tensor([[0.5, 1.5]])}
    report = category_grounding(
        [record()],
        {7: decoded(["men"], [heads[0].mean(0)], **trace)},
        Vocabulary(WORDS),
        (2, 4),
        shipped_category_words(),
    )
    overall = report["overall"]
    assert overall["model"]["pointing"] == 0.5  # the mean of the heads ties cells 1 and 7
    assert overall["model"]["mass"] == pytest.approx(0.5 * 0.64)
    assert (overall["head_1"]["pointing"], overall["head_1"]["mass"]) == (1.0, pytest.approx(0.64))
    assert (overall["head_2"]["pointing"], overall["head_2"]["mass"]) == (0.0, 0.0)
    assert (overall["chosen_cell"]["pointing"], overall["chosen_cell"]["mass"]) == (0.0, 0.0)
    assert overall["local_centre"]["pointing"] == 1.0 and overall["local_centre"]["mass"] is None
    assert list(overall)[:6] == [
        "words",
        "model",
        "head_1",
        "head_2",
        "chosen_cell",
        "local_centre",
    ]


def test_word_boxes_are_shares_of_the_image():
    boxes = word_boxes(["a", "puppy", "men"], (DOG, *PEOPLE), (40, 20), shipped_category_words())
    assert boxes[0] == [] and boxes[1] == [(31 / 40, 11 / 20, 8 / 40, 8 / 20)]
    assert boxes[2] == [(1 / 40, 1 / 20, 8 / 40, 8 / 20), (11 / 40, 1 / 20, 8 / 40, 8 / 20)]


def test_the_figure_outlines_the_boxes_of_each_word():
    from matplotlib.patches import Rectangle
    from PIL import Image

    from captioning.figures.heatmaps import attention_grid

    image = Image.new("RGB", (40, 20))
    alphas = torch.stack([one_hot((0, 1.0)), one_hot((7, 1.0))])
    fig = attention_grid(
        image, ["a", "puppy"], alphas, (2, 4), boxes=[[], [(0.25, 0.5, 0.5, 0.25)]]
    )
    outlined = [[p for p in ax.patches if isinstance(p, Rectangle)] for ax in fig.axes]
    assert [len(p) for p in outlined] == [0, 0, 1]
    box = outlined[2][0]
    assert (box.get_x(), box.get_y(), box.get_width(), box.get_height()) == (9.5, 9.5, 20, 5)
    assert "yellow: the boxes" in " ".join(" ".join(t.get_text().split()) for t in fig.texts)
    with pytest.raises(ValueError, match="boxes has 1 entries for 2 words"):
        attention_grid(image, ["a", "puppy"], torch.ones(2, 8) / 8, (2, 4), boxes=[[]])


# ------------------------------------------------------------------ trained tiny models


def _grounding(checkpoint, tmp_path, **options) -> dict:
    # A model trained for one epoch says few shape words: a user's file makes every word of
    # its vocabulary name the circles, which most test images have.
    tmp_path.mkdir(parents=True, exist_ok=True)
    words = tmp_path / "words.json"
    vocab = torch.load(checkpoint, weights_only=True)["vocab"]
    words.write_text(json.dumps({w: "circle" for w in vocab if not w.startswith("<")}))
    metrics = evaluate_checkpoint(
        checkpoint,
        split="test",
        meteor=False,
        progress=False,
        out_dir=tmp_path / "eval",
        category_words=words,
        **options,
    )
    saved = json.loads((tmp_path / "eval" / "grounding.json").read_text())
    assert saved == json.loads(json.dumps(metrics["grounding"]))
    assert saved["overall"]["words"] > 0 and saved["images"] == 6
    assert "grounding" not in json.loads((tmp_path / "eval" / "metrics.json").read_text())
    return saved["overall"]


def test_evaluate_writes_grounding_for_a_soft_model(tiny_checkpoint, tmp_path):
    overall = _grounding(tiny_checkpoint, tmp_path)
    assert set(overall) == {"words", "model", "even", "centre", "saliency"}
    assert all(
        0 <= overall[k]["pointing"] <= 1 and 0 <= overall[k]["mass"] <= 1
        for k in ("model", "even", "centre", "saliency")
    )


def test_the_references_are_grounded_with_their_teacher_forced_maps(tiny_checkpoint, tmp_path):
    """Every word of every reference names the circles (a user's file): each reference of
    an image with a circle is fed to the decoder, and its words are scored with the maps
    teacher forcing gives them, computed here on their own."""
    from captioning.api import load
    from captioning.data import load_splits
    from captioning.evaluate import reference_grounding
    from captioning.metrics.pointing import category_boxes

    loaded = load(tiny_checkpoint, "cpu")
    vocab, model = loaded.vocab, loaded.model
    words = {w: "circle" for w in vocab.to_list() if not w.startswith("<")}
    records = [r for r in load_splits(loaded.config.data)["test"] if r.objects]
    report = reference_grounding(loaded, loaded.config, records, words)
    count, hits, masses = 0, [], []
    for record in records:
        boxes = category_boxes(record.objects).get("circle")
        image = model.encoder.transform(Image.open(record.path).convert("RGB"))
        grid = Grid(*model.grid_shape, float(record.width), float(record.height))
        for caption in record.captions:
            tokens = torch.tensor([vocab.encode(caption)])
            with torch.no_grad():
                alphas = model(image[None], tokens).alphas[0].double().numpy()  # (T, L)
            for t, token in enumerate(tokens[0, 1:-1].tolist()):
                if boxes is None or token == vocab.unk_id:
                    continue
                count += 1
                hits.append(peak_hit(alphas[t], boxes, grid))
                masses.append(float((alphas[t] * box_coverage(boxes, grid)).sum()))
    overall = report["overall"]
    assert count > 20 and overall["words"] == count
    assert overall["model"]["pointing"] == pytest.approx(np.mean(hits), abs=1e-6)
    assert overall["model"]["mass"] == pytest.approx(np.mean(masses), abs=1e-5)
    assert set(overall) == {"words", "model", "even", "centre", "saliency"}


def test_evaluate_writes_grounding_for_a_multi_head_model(tiny_heads_checkpoint, tmp_path):
    overall = _grounding(tiny_heads_checkpoint, tmp_path)
    # the mass is linear in the map, and the model's map is the heads' mean
    heads = (overall["head_1"]["mass"] + overall["head_2"]["mass"]) / 2
    assert overall["model"]["mass"] == pytest.approx(heads, abs=1e-6)


def test_evaluate_writes_grounding_for_a_hard_model(tiny_hard_checkpoint, tmp_path):
    overall = _grounding(tiny_hard_checkpoint, tmp_path, hard_context="argmax")
    # the chosen cell is the distribution's peak
    assert overall["chosen_cell"]["pointing"] == pytest.approx(overall["model"]["pointing"])
    expected = _grounding(tiny_hard_checkpoint, tmp_path / "e", hard_context="expectation")
    assert "chosen_cell" not in expected


def test_evaluate_writes_grounding_for_a_local_model(tiny_local_checkpoint, tmp_path):
    overall = _grounding(tiny_local_checkpoint, tmp_path)
    assert 0 <= overall["local_centre"]["pointing"] <= 1
    assert overall["local_centre"]["mass"] is None


def test_evaluate_scores_the_word_localisers_maps(tiny_shapes, tmp_path):
    from tests.conftest import _tiny_run

    checkpoint = _tiny_run(tiny_shapes, tmp_path / "run", "model.word_maps=true")
    overall = _grounding(checkpoint, tmp_path / "grounding")
    references = json.loads((tmp_path / "grounding" / "eval" / "grounding.json").read_text())
    assert list(references["references"]["overall"])[:3] == ["words", "model", "localiser"]
    assert list(overall)[:3] == ["words", "model", "localiser"]
    localiser = overall["localiser"]
    assert 0 <= localiser["pointing"] <= 1 and 0 < localiser["mass"] <= 1
    # a map over the cells: it peaks at least as high as an even one, and is less spread
    assert localiser["median_peak"] >= overall["even"]["median_peak"]
    assert localiser["mean_entropy"] <= overall["even"]["mean_entropy"] + 1e-9


@pytest.mark.slow  # an evaluation with its figures on a second folder
def test_evaluate_scores_another_data_set_through_set(
    tiny_checkpoint, tiny_shapes, tmp_path, capsys
):
    # the shapes test split laid out as COCO 2017 is: no train or val files, images in NAME/
    data = tmp_path / "coco"
    (data / "annotations").mkdir(parents=True)
    for kind in ("captions", "instances"):
        shutil.copy(
            tiny_shapes / "annotations" / f"{kind}_test.json",
            data / "annotations" / f"{kind}_val2017.json",
        )
    shutil.copytree(tiny_shapes / "images" / "test", data / "val2017")
    out = tmp_path / "eval"
    code = main(
        [
            "evaluate",
            "--checkpoint",
            str(tiny_checkpoint),
            "--set",
            f"data.root={data}",
            "--set",
            "data.splits.test=val2017",
            "--set",
            "data.images={split}",
            "--out",
            str(out),
            "--quiet",
        ]
    )
    assert code == 0 and json.loads((out / "grounding.json").read_text())["images"] == 6
    printed = capsys.readouterr().out
    assert "grounding of the captions: " in printed
    assert "grounding of the references, teacher-forced: " in printed


@pytest.mark.parametrize(
    "setting, message",
    [
        ("model.hidden_dim=3", "evaluate takes keys of the data, decode, runtime sections only"),
        ("data.rooot=x", "data.rooot"),
        ("data.root.x=1", "data.root is no section of keys"),
        ("data.splits.test", "must look like section.key=value"),
    ],
)
def test_evaluate_refuses_a_bad_setting_in_one_line(tiny_checkpoint, capsys, setting, message):
    assert main(["evaluate", "--checkpoint", str(tiny_checkpoint), "--set", setting]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and message in err[0], err


def test_evaluate_refuses_a_bad_category_words_file_in_one_line(tiny_checkpoint, tmp_path, capsys):
    bad = tmp_path / "words.json"
    bad.write_text('{"puppy": 3}')
    assert (
        main(["evaluate", "--checkpoint", str(tiny_checkpoint), "--category-words", str(bad)]) == 2
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "'puppy' maps to 3" in err[0]


def test_caption_outlines_the_boxes_from_an_instances_file(
    tiny_checkpoint, tiny_shapes, tmp_path, monkeypatch, capsys
):
    import captioning.figures.trace
    from captioning.data.coco import read_instance_images

    drawn = {}
    real = captioning.figures.trace.trace_figure

    def spy(image, words, trace, grid, path, *args, boxes=None, **kwargs):
        drawn["words"], drawn["boxes"] = words, boxes
        return real(image, words, trace, grid, path, *args, boxes=boxes, **kwargs)

    monkeypatch.setattr(captioning.figures.trace, "trace_figure", spy)
    instances = tiny_shapes / "annotations" / "instances_test.json"
    image = sorted((tiny_shapes / "images" / "test").glob("*.png"))[0]
    out = tmp_path / "figures"
    assert (
        main(
            [
                "caption",
                str(image),
                "--checkpoint",
                str(tiny_checkpoint),
                "--attention-dir",
                str(out),
                "--instances",
                str(instances),
            ]
        )
        == 0
    )
    size, objects = read_instance_images(instances)[image.name]
    expected = word_boxes(drawn["words"], objects, size, shipped_category_words())
    assert drawn["boxes"] == expected and (out / f"{image.stem}.png").is_file()
    for argv, message in (
        ([], "--instances outlines object boxes in the figures of --attention-dir"),
        (["--attention-dir", str(tmp_path / "f2")], "instances file not found"),
    ):
        code = main(
            [
                "caption",
                str(image),
                "--checkpoint",
                str(tiny_checkpoint),
                "--instances",
                str(tmp_path / "none.json"),
                *argv,
            ]
        )
        err = capsys.readouterr().err.strip().splitlines()
        assert code == 2 and len(err) == 1 and message in err[0], err


def test_the_web_page_gets_the_boxes_of_its_examples(tiny_checkpoint):
    import captioning
    from captioning.serve.app import model_info, settings_for

    model = captioning.load(tiny_checkpoint, device="cpu")
    info = model_info(model, settings_for(model, 10.0))
    examples = info["examples"]
    assert examples and all(e["boxes"] for e in examples)
    box = examples[0]["boxes"][0]
    assert set(box) == {"category", "box"} and all(0 <= v <= 1 for v in box["box"])
    assert set(info["category_words"]) <= set(model.vocab.itos)
    plain = model_info(model, settings_for(model, 10.0, examples=[]))
    assert plain["category_words"] == {} and plain["examples"] == []
    page = (ROOT / "captioning" / "serve" / "page.html").read_text()
    assert "namedBoxes(result.words[index])" in page
