"""tools.seed_study (the shapes recipe's seeds and its colour probe) and its table
(``python -m tools.tables``)."""

from __future__ import annotations

import importlib
import json
import shutil
from pathlib import Path

import pytest
import torch

import lab.runner as runner
import tools.seed_study
from lab.results import write_results
from tests.conftest import ROOT
from tests.conftest import TINY_SETTINGS as TINY


@pytest.fixture(scope="module")
def study():
    return tools.seed_study


@pytest.fixture(scope="module")
def tables():
    return importlib.import_module("tools.tables")


def _objects(colour_coded: bool, n: int = 600, dim: int = 32, classes: int = 6):
    """Synthetic grid features of n objects: with the colour written into them (a direction
    per colour under noise of the same size) or without (noise alone)."""
    generator = torch.Generator().manual_seed(1)
    labels = torch.randint(classes, (n,), generator=generator)  # (n,)
    noise = torch.randn(n, dim, generator=generator)  # (n, dim)
    if not colour_coded:
        return noise, labels
    directions = torch.randn(classes, dim, generator=generator)  # (classes, dim)
    return noise + 3 * directions[labels], labels


def test_the_probe_reads_colours_from_a_grid_that_has_them_and_not_otherwise(study) -> None:
    coded = study.colour_probe(*_objects(True), classes=6)
    free = study.colour_probe(*_objects(False), classes=6)
    assert coded > 0.97
    assert 0.08 < free < 0.3  # chance is 1/6
    assert study.colour_probe(*_objects(False), classes=6) == free  # deterministic
    with pytest.raises(ValueError, match="both to fit and to hold out"):
        study.colour_probe(torch.zeros(1, 4), torch.zeros(1, dtype=torch.long), classes=2)


def test_the_probe_holds_out_the_last_objects(study) -> None:
    features, labels = _objects(True)
    # the held-out third carries no colour: only what was fit on is readable
    features[400:] = torch.randn(200, features.shape[1])
    assert study.colour_probe(features, labels, classes=6) < 0.35


def test_the_centre_cell_of_a_box(study) -> None:
    # a 96 px image on a 6 x 6 grid: cells of 16 px; centre (40, 72) is row 4, column 2
    assert study.centre_cell([30.0, 62.0, 20.0, 20.0], 96, 96, 6, 6) == 4 * 6 + 2
    assert study.centre_cell([90.0, 90.0, 6.0, 6.0], 96, 96, 6, 6) == 35  # the last cell


def test_rows_merge_by_variant_and_seed(study, tmp_path: Path) -> None:
    path = tmp_path / "rows.json"
    earlier = [
        {"variant": "b", "seed": 1, "x": 1},
        {"variant": "a", "seed": 0, "x": 1},
        {"variant": "b", "seed": 0, "x": 1},
    ]
    path.write_text(json.dumps(earlier))
    new = [{"variant": "b", "seed": 1, "x": 2}, {"variant": "c", "seed": 0}]
    merged = write_results(path, new, lambda r: (r["variant"], r["seed"]), order=study.order)
    assert [(r["variant"], r["seed"], r.get("x")) for r in merged] == [
        ("b", 0, 1),
        ("b", 1, 2),
        ("a", 0, 1),
        ("c", 0, None),
    ]


def test_seeds_and_overrides(study) -> None:
    assert study.parse_seeds("0-5") == [0, 1, 2, 3, 4, 5]
    assert study.parse_seeds("5,2-3") == [2, 3, 5]
    for bad in ("", "3-1", "a", "-1"):
        with pytest.raises(study.StudyError, match="--seeds wants"):
            study.parse_seeds(bad)
    config = ROOT / "configs" / "shapes_soft.yaml"
    shipped = study.load_config(config).train.warmup_steps
    other = shipped + 300  # differs from whatever the shipped config says
    settings = [
        "model.cnn_channels=[32,32,64,128]",
        f"train.warmup_steps={other}",
        "train.seed=4",
        "train.threads=1",
        "train.precision=bf16",
    ]
    run = study.load_config(config, settings)
    # the folder's own differences join the --set list; seed, threads, precision do not
    assert study.overrides_of(config, [], run) == [
        "model.cnn_channels=[32,32,64,128]",
        f"train.warmup_steps={other}",
    ]
    # a --set that equals the config stays in the row: it is what the run was asked
    assert study.overrides_of(config, [f"train.warmup_steps={shipped}"], None) == [
        f"train.warmup_steps={shipped}"
    ]
    with pytest.raises(study.StudyError, match=f"train.warmup_steps={other} where --set asks 7"):
        study.overrides_of(config, ["train.warmup_steps=7"], run)


def test_a_seed_is_trained_once_then_adopted(study, tiny_shapes, tmp_path, monkeypatch) -> None:
    results, out = tmp_path / "seeds.json", tmp_path / "runs"
    sets = [a for s in TINY for a in ("--set", s)]
    common = ["--results", str(results), "--data-root", str(tiny_shapes), "--threads", "1"]
    assert study.main(["--out", str(out), "--variant", "tiny", "--seeds", "0", *sets, *common]) == 0
    (row,) = json.loads(results.read_text())
    assert row["variant"] == "tiny" and row["seed"] == 0 and not row["adopted"]
    assert "train.warmup_steps=0" in row["overrides"]
    assert not any(o.startswith(("train.seed", "data.root")) for o in row["overrides"])
    assert 0 <= row["test_exact"] <= 1 and row["stalled"] == (row["test_exact"] < 0.5)
    assert 0 <= row["colour_probe"] <= 1 and 0 < row["probe_chance"] <= 0.5
    assert row["train_seconds"] > 0 and row["commit"] == row["evaluated_at"]
    assert row["trained"] == f"trained at {row['commit'][:7]} by {row['command']}"
    assert row["train_command"].startswith("captioning train --quiet --config configs/")
    # the finished folder, adopted under another name: evaluated, never retrained
    monkeypatch.setattr(runner, "fit", lambda *a, **k: pytest.fail("retrained a finished run"))
    folder = out / "tiny-seed0"
    adopt = ["--adopt", f"0={folder}", "--trained-at", "abc1234"]
    assert (
        study.main(["--out", str(tmp_path), "--variant", "old", "--seeds", "0", *adopt, *common])
        == 0
    )
    first, second = json.loads(results.read_text())
    # the study trained it: its record, not --trained-at, says where it comes from
    assert second["variant"] == "old" and not second["adopted"]
    assert second["commit"] == first["commit"] and second["trained"] == first["trained"]
    assert second["overrides"] == first["overrides"]  # read from the folder's config
    assert second["test_exact"] == first["test_exact"]
    assert second["colour_probe"] == first["colour_probe"]
    # the study's own folder, evaluated again, keeps the commit it was trained at; a copy of
    # it in --out is not the study's training and says so
    assert (
        study.main(
            [
                "--out",
                str(out),
                "--variant",
                "tiny",
                "--seeds",
                "0",
                *sets,
                *common,
                "--trained-at",
                "0ld0ld0",
            ]
        )
        == 0
    )
    assert json.loads(results.read_text())[0] == {
        **first,
        "command": first["command"] + " --trained-at 0ld0ld0",
    }
    shutil.copytree(folder, tmp_path / "copies" / "copy-seed0", ignore=lambda *_: [study.RECORD])
    assert (
        study.main(
            [
                "--out",
                str(tmp_path / "copies"),
                "--variant",
                "copy",
                "--seeds",
                "0",
                *common,
                "--trained-at",
                "0ld0ld0",
            ]
        )
        == 0
    )
    third = json.loads(results.read_text())[2]
    assert third["adopted"] and third["commit"] == "0ld0ld0"
    assert third["trained"].startswith("trained at 0ld0ld0 with warmup_steps=0, adopted from")


def test_user_errors_are_one_line(study, tiny_shapes, tmp_path, capsys) -> None:
    common = ["--out", str(tmp_path), "--variant", "v", "--data-root", str(tiny_shapes)]
    cases = [
        (["--seeds", "x"], "--seeds wants"),
        (["--adopt", f"0={tmp_path}"], "holds no best.pt"),
        (["--adopt", "9=somewhere", "--seeds", "0"], "seed 9 is not among --seeds"),
        (["--set", "train.seed=3"], "is the study's to set"),
        (["--config", "configs/nope.yaml"], "config configs/nope.yaml not found"),
    ]
    for extra, message in cases:
        assert study.main([*common, *extra]) == 2
        err = capsys.readouterr().err
        assert message in err and err.count("\n") == 1, err
    assert study.main(["--out", str(tmp_path), "--variant", "v", "--data-root", "nowhere"]) == 2
    assert "no shapes data under nowhere" in capsys.readouterr().err


def _row(variant: str, seed: int, exact: float, probe: float) -> dict:
    return {
        "variant": variant,
        "config": "configs/shapes_soft.yaml",
        "overrides": ["train.warmup_steps=400"],
        "seed": seed,
        "test_exact": exact,
        "colour_probe": probe,
        "stalled": exact < 0.5,
        "train_threads": 1,
        "adopted": seed == 0,
        "commit": "abcdef123",
        "evaluated_at": "1234567aa+dirty",
        "cores": 2,
        "cpu": "cpu",
        "torch": "2",
        "probe_objects": {"fit": 546, "held_out": 274},
        "probe_chance": 0.1667,
    }


def test_the_table_counts_stalls_and_means_the_others(tables) -> None:
    rows = [
        _row("w400", 0, 0.9, 0.99),
        _row("w400", 1, 0.05, 0.27),
        _row("w400", 2, 0.95, 0.98),
        _row("w100", 2, 0.04, 0.25),
    ]
    text = tables.shapes_seeds(rows)
    lines = text.splitlines()
    assert lines[2] == (
        "| w400 | `train.warmup_steps=400` | 0, 1, 2 | 0.900 / **0.050** / 0.950 | 1 of 3 "
        "| 0.925 ± 0.035 | 0.990 / **0.270** / 0.980 |"
    )
    assert (
        lines[3] == "| w100 | `train.warmup_steps=400` | 2 | **0.040** | 1 of 1 | – | **0.250** |"
    )
    assert "(1 of them runs trained before the study" in text
    assert "evaluated at 1234567+dirty" in text and "274 objects" in text
    assert (
        "w400: `python -m tools.seed_study --out runs/seeds --variant w400 --seeds 0,1,2 "
        "--set train.warmup_steps=400 --threads 1`" in text
    )


def test_the_targets_table_keeps_held_out_seeds_apart(tables) -> None:
    def row(seed: int, exact: float, overrides: list[str]) -> dict:
        return {
            **_row("v", seed, exact, 0.99),
            "overrides": overrides,
            "test_exact_by_objects": {"3": exact - 0.02},
            "train_seconds": 100.0 + seed,
            "pointing": {"color": 0.97, "size": 0.96, "shape": 0.95},
        }

    rows = [row(s, 0.98, []) for s in range(3)] + [row(11, 0.04, []), row(12, 0.97, [])]
    rows.append(row(0, 0.99, ["model.cnn_block=residual"]))
    lines = tables.shapes_targets(rows).splitlines()
    assert lines[2].startswith(
        "| `configs/shapes_soft.yaml` | preact (shipped) | 0, 1, 2 | 0 of 3 | 3 of 3 |"
    )
    assert lines[3].startswith(
        "| `configs/shapes_soft.yaml` | preact (shipped), held-out seeds "
        "| 11, 12 | 1 of 2 | 1 of 2 |"
    )
    assert "| 0.040 | 0.020 |" in lines[3]
    assert lines[4].startswith("| `configs/shapes_soft.yaml` | residual | 0 | 0 of 1 | 1 of 1 |")
