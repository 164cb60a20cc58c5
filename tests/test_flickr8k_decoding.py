"""benchmarks.flickr8k_decoding: the dev split chooses the beam size and length penalty, the
test split is decoded once with the choice and scored as the study's rows are."""

import json
from pathlib import Path

import pytest

from benchmarks import flickr8k_decoding as decoding
from benchmarks.flickr8k_runs import RECIPE, run_dir
from captioning.metrics import caption_metrics

REFS = {
    1: ["a dog runs across the grass", "a brown dog is running on a lawn"],
    2: ["a man rides a bike down a hill", "a person on a bicycle"],
}


def test_the_grid_has_greedy_once_and_every_beam_at_every_penalty():
    assert decoding.grid_of([1, 3, 5], [0.0, 0.5]) == [
        (1, 0.0),
        (3, 0.0),
        (3, 0.5),
        (5, 0.0),
        (5, 0.5),
    ]


def test_the_best_dev_score_wins_and_of_equals_the_cheaper_decoding():
    dev = {(3, 0.0): {"Bleu_4": 0.20}, (5, 0.0): {"Bleu_4": 0.22}, (5, 0.5): {"Bleu_4": 0.21}}
    assert decoding.choose(dev, "Bleu_4") == (5, 0.0)
    dev[7, 0.0] = {"Bleu_4": 0.22}  # as good as 5 beams, and dearer
    dev[5, 1.0] = {"Bleu_4": 0.22}  # as good as no penalty
    assert decoding.choose(dev, "Bleu_4") == (5, 0.0)


def _finished_run(out: Path) -> Path:
    folder = run_dir(out, RECIPE, "best", 0, "cpu")
    (folder / "train").mkdir(parents=True)
    job = {
        "model": "best",
        "seed": 0,
        "variant": RECIPE,
        "config": "configs/flickr8k_best.yaml",
        "settings": [f"data.root={out / 'data'}", "train.seed=0"],
        "select_metric": "CIDEr",
        "best_val": 0.45,
        "best_epoch": 18,
        "epochs": 20,
        "steps": 3760,
        "precision": "fp32",
        "device": "AMD EPYC",
        "threads": 2,
        "commit": "abc1234",
    }
    (folder / "job.json").write_text(json.dumps(job))
    annotations = out / "data" / "annotations"
    annotations.mkdir(parents=True)
    for split in ("val", "test"):
        coco = {
            "annotations": [{"image_id": i, "caption": c} for i, cs in REFS.items() for c in cs]
        }
        (annotations / f"captions_{split}.json").write_text(json.dumps(coco))
    return folder


@pytest.mark.slow  # scores five decodings with the PTB tokenizer and METEOR (Java)
def test_the_dev_split_chooses_and_the_test_split_is_scored_once(tmp_path, monkeypatch):
    folder = _finished_run(tmp_path)
    # what each setting decodes: 5 beams says the most on the dev split
    said = {
        (3, 0.0): "a dog",
        (3, 1.0): "a dog runs across",
        (5, 1.0): "a dog runs",
        (5, 0.0): "a brown dog is running on a lawn",
    }
    decoded = []

    def fake_decode(checkpoint, split, beam, penalty, out, meteor):
        assert checkpoint == folder / "train" / "best.pt"
        decoded.append((split, beam, penalty))
        captions = {1: said[beam, penalty], 2: "a man rides a bike"}
        return captions, caption_metrics(captions, REFS, meteor=False)  # as evaluate writes

    monkeypatch.setattr(decoding, "decode", fake_decode)
    results = tmp_path / "rows.json"
    code = decoding.main(
        [
            "--out",
            str(tmp_path),
            "--seeds",
            "0",
            "--beams",
            "3,5",
            "--length-penalties",
            "0,1",
            "--results",
            str(results),
        ]
    )
    assert code == 0
    # the grid on the dev split, then the test split once, with the choice
    assert decoded[:-1] == [("val", 3, 0.0), ("val", 3, 1.0), ("val", 5, 0.0), ("val", 5, 1.0)]
    assert decoded[-1] == ("test", 5, 0.0)
    [row] = json.loads(results.read_text())
    assert row["variant"] == "dev_decode" and row["beam_size"] is None
    assert row["decode"] == {"beam_size": 5, "length_penalty": 0.0, "chosen_on": "val Bleu_4"}
    expected = caption_metrics({1: said[5, 0.0], 2: "a man rides a bike"}, REFS)
    for name in ("Bleu_4", "METEOR", "CIDEr"):
        assert row[name] == pytest.approx(expected[name])
    assert set(row["dev_grid"]) == {"beam3_lp0", "beam3_lp1", "beam5_lp0", "beam5_lp1"}
    assert row["device"] == "AMD EPYC" and row["overrides"][0] == "data.root=OUT/data"
    assert "/" + "tmp" not in row["command"]


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--beams", "0,3"], "--beams: must be a comma-separated list of beam sizes"),
        (["--length-penalties", "-1"], "--length-penalties: must be a comma-separated list"),
        (["--models", "best,wat"], "unknown model 'wat'"),
        (["--models", "nn"], "unknown model 'nn'"),
    ],
)
def test_options_a_user_can_get_wrong(tmp_path, capsys, argv, message):
    with pytest.raises(SystemExit) as stopped:
        decoding.main(["--out", str(tmp_path), *argv])
    assert stopped.value.code == 2
    assert message in capsys.readouterr().err


def test_a_folder_without_the_study_or_the_run_is_one_line(tmp_path, capsys):
    assert decoding.main(["--out", str(tmp_path / "nowhere")]) != 0
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "has no prepared Flickr8k data" in err
    (tmp_path / "data" / "annotations").mkdir(parents=True)
    assert decoding.main(["--out", str(tmp_path), "--seeds", "4"]) != 0
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "best seed 4 has no finished run" in err


def test_a_levers_rows_are_named_after_the_runs_they_decode() -> None:
    from benchmarks.flickr8k_decoding import parse_args
    from tools.tables.flickr8k_decoding import decoded_variant

    for runs, variant in (("recipe", "dev_decode"), ("looks_e15", "looks_e15_dev_decode")):
        args = parse_args(["--out", "runs/f8k", "--run-variant", runs])
        assert args.variant == variant and decoded_variant(args.variant) == runs
    assert parse_args(["--out", "o", "--run-variant", "a", "--variant", "b"]).variant == "b"
    assert decoded_variant("recipe") is None
