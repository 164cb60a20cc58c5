"""tools.grounding_study: a row per model and seed, with no machine paths, and its tables."""

import json
import shutil

import pytest
import torch

from lab.provenance import cpu_model

from .conftest import load_tool


def _layout(tiny_checkpoint, tiny_shapes, tmp_path):
    """The shapes test split as a COCO 2017 folder, two seeds' checkpoints, a words file."""
    shared, runs = tmp_path / "shared", tmp_path / "runs"
    data = shared / "coco"
    (data / "annotations").mkdir(parents=True)
    for kind in ("captions", "instances"):
        shutil.copy(
            tiny_shapes / "annotations" / f"{kind}_test.json",
            data / "annotations" / f"{kind}_val2017.json",
        )
    shutil.copytree(tiny_shapes / "images" / "test", data / "val2017")
    for seed in (0, 1):
        (runs / f"seed{seed}").mkdir(parents=True)
        shutil.copy(tiny_checkpoint, runs / f"seed{seed}" / "best.pt")
    # a model trained for one epoch says few shape words: every word names the circles
    vocab = torch.load(tiny_checkpoint, weights_only=True)["vocab"]
    words = shared / "words.json"
    words.write_text(json.dumps({w: "circle" for w in vocab if not w.startswith("<")}))
    return shared, runs, data, words


@pytest.mark.slow  # about 25 s: it trains or evaluates end to end
def test_the_study_writes_a_row_per_seed_without_machine_paths(
    tiny_checkpoint, tiny_shapes, tmp_path, capsys
):
    study = load_tool("grounding_study")
    shared, runs, data, words = _layout(tiny_checkpoint, tiny_shapes, tmp_path)
    out = tmp_path / "out"
    argv = [
        "--data",
        str(data),
        "--split-name",
        "val2017",
        "--checkpoint",
        str(runs / "seed{seed}" / "best.pt"),
        "--model",
        "soft",
        "--seeds",
        "0,1",
        "--out",
        str(out),
        "--shared",
        str(shared),
        "--runs",
        str(runs),
        "--results",
        str(out / "rows.json"),
        "--category-words",
        str(words),
        "--quiet",
        "--threads",
        "1",
    ]
    assert study.main(argv) == 0
    rows = json.loads((out / "rows.json").read_text())
    assert [r["seed"] for r in rows] == [0, 1]
    row = rows[0]
    assert str(tmp_path) not in json.dumps(rows)
    assert row["command"].startswith("captioning evaluate --checkpoint RUNS/seed0/best.pt")
    assert "--set data.root=SHARED/coco" in row["command"] and "OUT/soft-seed0" in row["command"]
    assert row["study"].startswith("python -m tools.grounding_study --data SHARED/coco")
    assert row["settings"]["model.attention"] == "soft" and row["settings"]["train.seed"] == 0
    assert row["decoding"]["precision"] == "fp32" and row["device"] == cpu_model()
    assert row["machine"]["threads"] == 1 and row["threads"] == 1 and row["commit"]
    assert row["precision"] == "fp32" and row["timed_alone"] is True
    overall = row["grounding"]["overall"]
    saved = json.loads((out / "soft-seed0" / "grounding.json").read_text())
    assert overall == saved["overall"] and overall["words"] > 0
    assert set(overall) == {"words", "model", "even", "centre", "saliency"}
    # the references' words, teacher-forced: the same words for every model, more of them
    assert row["references"]["overall"] == saved["references"]["overall"]
    assert row["references"]["overall"]["words"] > overall["words"]
    # a seed run again replaces its row
    assert study.main([*argv[:9], "1", *argv[10:]]) == 0
    assert [r["seed"] for r in json.loads((out / "rows.json").read_text())] == [0, 1]
    # but not with other decoding settings, unless asked
    assert study.main([*argv[:9], "1", *argv[10:], "--beam-size", "2"]) == 2
    assert "other decoding" in capsys.readouterr().err

    tables = load_tool("tables")
    table = tables.grounding(rows)
    assert "| soft | 0 |" in table and "| soft | 1 |" in table
    assert "spread over the seeds" in table and "`results/grounding.json`" in table
    assert "| soft | circle | 2 |" in tables.grounding_categories(rows)
    capsys.readouterr()


def test_the_study_refuses_missing_files_in_one_line(tiny_checkpoint, tmp_path, capsys):
    study = load_tool("grounding_study")
    common = [
        "--model",
        "soft",
        "--out",
        str(tmp_path / "out"),
        "--results",
        str(tmp_path / "rows.json"),
    ]
    for argv, message in (
        (["--data", str(tmp_path), "--checkpoint", str(tiny_checkpoint)], "no annotations/"),
        (["--data", str(tmp_path), "--checkpoint", "x", "--seeds", "a"], "--seeds"),
    ):
        assert study.main([*argv, *common]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("error: ") and message in err[0], err
    (tmp_path / "annotations").mkdir()
    assert (
        study.main(
            [
                "--data",
                str(tmp_path),
                "--checkpoint",
                str(tmp_path / "s{seed}.pt"),
                "--seeds",
                "4",
                *common,
            ]
        )
        == 2
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no such file for seed 4" in err[0]
    assert not (tmp_path / "rows.json").exists()
