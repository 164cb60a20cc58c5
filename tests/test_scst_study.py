"""tools.scst_study: the self-critical study's runs, rows and table."""

from __future__ import annotations

import importlib
import json

import pytest
import torch

import tools.scst_study
from captioning.checkpoint import load_checkpoint
from tests.conftest import TINY_SETTINGS


@pytest.fixture(scope="module")
def study():
    return tools.scst_study


@pytest.fixture(scope="module")
def tables():
    return importlib.import_module("tools.tables")


def test_caption_statistics_count_words_and_dangling_endings(study) -> None:
    length, dangling = study.caption_statistics(["a red circle", "a big blue square of", "the"])
    assert length == pytest.approx(9 / 3)
    assert dangling == pytest.approx(2 / 3)  # "of" and "the"; "circle" is a noun


def test_bad_seeds_and_missing_data_end_in_one_line(study, tmp_path, capsys) -> None:
    assert (
        study.main(["--data", str(tmp_path), "--out", str(tmp_path / "o"), "--seeds", "0,x"]) == 2
    )
    assert "--seeds wants seeds >= 0" in capsys.readouterr().err
    assert study.main(["--data", str(tmp_path), "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert "captioning shapes --captions varied" in err and err.count("\n") == 1


def _row(variant: str, seed: int, cider: float) -> dict:
    return {
        "variant": variant,
        "seed": seed,
        "CIDEr": cider,
        "Bleu_4": 0.7,
        "METEOR": 0.4,
        "exact_match": 0.07,
        "mean_length": 12.0,
        "dangling": 0.0,
        "test_images": 500,
        "beam_size": 3,
        "commit": "abcdef0123",
        "timed_alone": True,
        "machine": {"cores": 2, "cpu": "CPU", "threads": 1, "torch": "2"},
    }


def test_the_table_gives_each_seed_and_the_ratio_to_its_own_start(tables) -> None:
    rows = [
        _row("xe", 0, 4.0),
        _row("xe", 1, 2.0),
        _row("scst_loo", 0, 4.4),
        _row("scst_loo", 1, 2.4),
        _row("xe_control", 0, 4.0),
    ]
    text = tables.scst_shapes(rows)
    loo = next(line for line in text.splitlines() if "`loo`" in line)
    # per seed, mean ± sd, and the mean of the per-seed ratios 1.1 and 1.2
    assert "4.400 / 2.400" in loo and "3.400 ± 1.414" in loo and "1.150 ± 0.071" in loo
    control = next(line for line in text.splitlines() if "control" in line)
    assert "| 4.000 | 4.000 | 1.000 |" in control  # one seed: no spread
    assert "greedy" not in text  # a variant without rows is left out
    assert "5 rows of `results/scst_shapes.json`" in text


@pytest.mark.slow  # four trainings and four evaluations on the tiny data
def test_the_study_trains_each_variant_from_its_seed_and_writes_rows(
    study, tiny_shapes, tmp_path
) -> None:
    results = tmp_path / "rows.json"
    settings = [w for s in TINY_SETTINGS for w in ("--set", s)]
    argv = [
        "--data",
        str(tiny_shapes),
        "--out",
        str(tmp_path / "runs"),
        "--seeds",
        "3",
        "--results",
        str(results),
        "--threads",
        "1",
        *settings,
        "--set",
        "train.val_max_images=6",
    ]
    assert study.main(argv) == 0
    rows = json.loads(results.read_text())
    assert [(r["variant"], r["seed"]) for r in rows] == [
        ("xe", 3),
        ("scst_loo", 3),
        ("scst_greedy", 3),
        ("xe_control", 3),
    ]
    for row in rows:
        assert 0 <= row["CIDEr"] and row["test_images"] == 6 and row["train_seconds"] > 0
        assert "train.threads=1" in row["train_command"] and row["machine"]["threads"] == 1
        assert row["command"].startswith("python -m tools.scst_study --data DATA --out OUT ")
        assert str(tmp_path) not in row["train_command"] + row["evaluate"] + row["command"]
    assert (
        rows[1]["init"] == "xe-s3/best.pt"
        and "--init OUT/xe-s3/best.pt" in rows[1]["train_command"]
    )
    assert "train.objective=xe" in rows[3]["train_command"]

    # each fine-tune starts from the cross-entropy model: its weights differ after the epoch
    def weights(name):
        return load_checkpoint(tmp_path / "runs" / name / "best.pt")["model"]

    xe, loo = weights("xe-s3"), weights("scst_loo-s3")
    assert any(not torch.equal(xe[k], loo[k]) for k in xe if torch.is_tensor(xe[k]))
    # a finished run is scored again, not retrained: the same rows, the same seconds
    assert study.main(argv) == 0
    again = json.loads(results.read_text())
    assert [r["train_seconds"] for r in again] == [r["train_seconds"] for r in rows]
