"""benchmarks.flickr8k: rows scored from a finished run's folder with the paper's BLEU
beside the standard one, portable commands, the table beside the paper's rows, and the
options a user can get wrong."""

import json
from dataclasses import replace
from pathlib import Path

import pytest

from benchmarks import flickr8k, flickr8k_options, flickr8k_runs
from captioning.errors import CaptioningError
from captioning.metrics import caption_metrics
from lab import runner
from lab.provenance import usable_cores
from tests.conftest import TINY_SETTINGS, load_tool

REFS = {
    1: ["a dog runs across the grass", "a brown dog is running on a lawn"],
    2: ["a man rides a bike down a hill", "a person on a bicycle"],
    3: ["two children play in the water", "kids splash in a pool"],
}


def finished_run(out: Path, model: str, seed: int, captions: dict[int, str], kind="gpu") -> Path:
    folder = flickr8k.run_dir(out, flickr8k.RECIPE, model, seed, kind)
    (folder / "test_beam3").mkdir(parents=True)
    predictions = [{"image_id": i, "caption": c} for i, c in captions.items()]
    (folder / "test_beam3" / "predictions.json").write_text(json.dumps(predictions))
    job = {
        "model": model,
        "seed": seed,
        "variant": "recipe",
        "config": "configs/x.yaml",
        "settings": [f"data.root={out / 'data'}", f"model.weights={out}/w.pt"],
        "select_metric": "CIDEr",
        "best_val": 0.4,
        "best_epoch": 3,
        "epochs": 4,
        "steps": 80,
        "train_seconds": 100.0,
        "evaluate_seconds": {"3": 5.0},
        "precision": "bf16",
        "device": "NVIDIA H100",
        "cpu": "Xeon",
        "threads": 1,
        "timed_alone": False,
        "stages": {"prepare": 10.0, "extract": 40.0},
        "history": [],
        "commit": "abc",
        "command": "python -m benchmarks.flickr8k --out OUT",
    }
    (folder / "job.json").write_text(json.dumps(job))
    return folder


@pytest.mark.slow  # a whole pipeline (make test-slow)
def test_a_run_is_scored_as_the_paper_and_as_coco(tmp_path):
    captions = {1: "a dog runs on the grass", 2: "a man rides a bike", 3: "kids play"}
    folder = finished_run(tmp_path, "soft", 0, captions)
    [row] = flickr8k.rows_of_run(tmp_path, folder, REFS)
    expected = caption_metrics(captions, REFS)
    for name in ("Bleu_1", "Bleu_4", "METEOR", "ROUGE_L", "CIDEr"):
        assert row[name] == pytest.approx(expected[name])
    # short captions: the brevity penalty lowers BLEU, and the paper's form divides it out
    assert row["Bleu_brevity_penalty"] < 1
    for n in range(1, 5):
        assert row[f"Bleu_{n}_no_bp"] * row["Bleu_brevity_penalty"] == pytest.approx(
            row[f"Bleu_{n}"]
        )
    assert row["distinct_captions"] == 3 and row["unk_captions"] == 0
    assert row["seconds"] == {
        "prepare": 10.0,
        "extract": 40.0,
        "first_stage": 0.0,
        "train": 100.0,
        "evaluate": 5.0,
        "recipe": 155.0,
    }
    assert row["overrides"] == ["data.root=OUT/data", "model.weights=OUT/w.pt"]
    assert row["device"] == "NVIDIA H100" and row["precision"] == "bf16"


@pytest.mark.slow  # a whole pipeline (make test-slow)
def test_a_second_stage_counts_its_first_stages_seconds(tmp_path):
    finished_run(tmp_path, "soft", 1, {1: "a dog", 2: "a man", 3: "kids"})
    folder = finished_run(tmp_path, "scst", 1, {1: "a dog runs", 2: "a man", 3: "kids"})
    [row] = flickr8k.rows_of_run(tmp_path, folder, REFS)
    assert row["seconds"]["first_stage"] == 100.0 and row["seconds"]["recipe"] == 255.0


def test_the_best_recipe_counts_its_own_extraction_not_the_recipes(tmp_path):
    from benchmarks.recipe_stages import Stages

    stages = Stages(tmp_path)
    stages.record("prepare", 9.0)
    stages.record("extract", 146.0)  # the recipe's 10 x 10 grids at 320 px
    stages.record("extract flickr8k_best", 70.0)  # best's 7 x 7 grids at 224 px
    for model in ("best", "best_scst", "best_finetune"):  # best's recipe, then a second stage
        assert flickr8k.stages_of(tmp_path, model) == {"prepare": 9.0, "extract": 70.0}
    for model in ("soft", "hard", "scst", "finetune"):
        assert flickr8k.stages_of(tmp_path, model) == {"prepare": 9.0, "extract": 146.0}
    assert flickr8k.extract_stage("best") == "extract flickr8k_best"
    assert flickr8k.grid_of("best_finetune") == "best" and flickr8k.grid_of("scst") == "soft"


def test_the_second_stages_after_best_are_the_recipes_on_bests_grid():
    from captioning.config import load_config

    root = Path(flickr8k.__file__).resolve().parents[1]
    best = load_config(root / "configs/flickr8k_best.yaml")
    for stage in ("scst", "finetune"):
        after = load_config(root / flickr8k.CONFIGS[f"best_{stage}"][0])
        recipe = load_config(root / flickr8k.CONFIGS[stage][0])
        assert flickr8k.FIRST_STAGE[f"best_{stage}"] == "best"
        assert after.model.image_size == best.model.image_size == 224
        # the recipe's second stage, self-critical training at the frameworks' learning rate
        assert replace(after.train, lr=recipe.train.lr) == recipe.train
        assert after.train.lr == (5e-5 if stage == "scst" else recipe.train.lr)
        assert replace(after.model, fine_tune="none") == best.model
    assert load_config(root / "configs/flickr8k_best_scst.yaml").train.objective == "scst"


def test_commands_name_no_machine_path(tmp_path):
    out, shared = tmp_path / "out", tmp_path / "shared"
    argv = ["--shared", str(shared), "--out", str(out), "--set", f"x={out}/y"]
    assert flickr8k_options.command_of(argv, out, shared) == (
        "python -m benchmarks.flickr8k --shared SHARED --out OUT --set x=OUT/y"
    )


def _args(tmp_path, jobs=1, threads=None, overrides=(), variant="recipe", first_stage=None):
    import argparse

    return argparse.Namespace(
        out=tmp_path,
        variant=variant,
        overrides=list(overrides),
        first_stage=first_stage or variant,
        jobs=jobs,
        threads=threads,
        machine_busy=False,
        commit="abc",
        command="python -m benchmarks.flickr8k",
    )


@pytest.mark.parametrize(
    "jobs, threads, overrides, expected",
    [
        (2, None, (), max(1, usable_cores() // 2)),  # parallel runs share the cores
        (1, None, (), None),  # one run: torch's choice
        (2, 1, (), 1),  # --threads
        (2, None, ("train.threads=1",), 1),  # --set train.threads: the user's
    ],
)
def test_parallel_runs_share_the_cores_unless_the_user_says(
    tmp_path, monkeypatch, jobs, threads, overrides, expected
):
    planned = []

    def run_study(specs, make_row, jobs, run):
        planned.extend(specs)
        return iter(())

    monkeypatch.setattr(runner, "run_study", run_study)
    flickr8k.train_all(_args(tmp_path, jobs, threads, overrides), ["soft", "scst"], [0, 1])
    assert [(s.name, s.seed) for s in planned] == [
        ("soft", 0),
        ("soft", 1),
        ("scst", 0),
        ("scst", 1),
    ]
    for spec in planned:
        assert spec.load().train.threads == expected
        # the run folder layout that --no-train re-scores: OUT/runs/KIND/MODEL-seedS/train
        assert spec.folder == flickr8k.run_dir(tmp_path, "recipe", spec.name, spec.seed) / "train"
    soft = flickr8k.run_dir(tmp_path, "recipe", "soft", 1) / "train" / "best.pt"
    assert planned[3].init == soft  # a second stage starts from the soft run of its seed
    assert planned[0].init is None


def test_a_second_stage_needs_its_first(tmp_path):
    with pytest.raises(CaptioningError, match="add soft to --models"):
        flickr8k.train_all(_args(tmp_path), ["finetune"], [0])
    # a lever of the second stage: its first stage is looked for in the variant's own runs
    with pytest.raises(CaptioningError, match="add best to --models"):
        flickr8k.train_all(_args(tmp_path, variant="lr"), ["best_scst"], [0])


def test_a_second_stage_lever_can_start_from_the_recipes_first_stage(tmp_path):
    first = finished_run(tmp_path, "best", 0, {1: "a dog"}, kind=flickr8k_runs.device_kind())
    args = _args(tmp_path, overrides=("train.lr=5e-5",), variant="lr", first_stage="recipe")
    spec = flickr8k.run_spec_of(args, "best_scst", 0)
    assert spec.init == first / "train" / "best.pt"
    assert spec.folder == flickr8k.run_dir(tmp_path, "lr", "best_scst", 0) / "train"
    assert spec.load().train.lr == 5e-5
    parsed = flickr8k_options.parse_args(
        ["--shared", "s", "--out", "o", "--models", "best_scst", "--variant", "lr"]
    )
    assert parsed.first_stage == "lr"  # by default the first stage is the variant's own


def test_first_stage_without_a_second_stage_is_refused(capsys):
    with pytest.raises(SystemExit) as exit_info:
        flickr8k_options.parse_args(
            ["--shared", "s", "--out", "o", "--models", "best", "--first-stage", "recipe"]
        )
    assert exit_info.value.code == 2
    assert "--models has none; add one of scst" in capsys.readouterr().err


@pytest.mark.slow  # scores a run
def test_a_second_stage_lever_counts_the_seconds_of_the_first_stage_it_started_from(tmp_path):
    finished_run(tmp_path, "best", 0, {1: "a dog", 2: "a man", 3: "kids"})
    folder = finished_run(tmp_path, "best_scst", 0, {1: "a dog runs", 2: "a man", 3: "kids"})
    lever = folder.parent / "lr" / folder.name
    lever.parent.mkdir()
    folder.rename(lever)
    job = json.loads((lever / "job.json").read_text())
    job.update(variant="lr", first_stage_variant="recipe")
    (lever / "job.json").write_text(json.dumps(job))
    [row] = flickr8k.rows_of_run(tmp_path, lever, REFS)
    assert row["seconds"]["first_stage"] == 100.0 and row["seconds"]["recipe"] == 255.0


@pytest.mark.slow  # a tiny training and two decodings
def test_a_run_goes_through_the_runner_into_its_folder_and_job_json(tiny_shapes, tmp_path):
    spec = flickr8k.run_spec_of(_args(tmp_path), "soft", 0)
    tiny = [f"data.root={tiny_shapes}", "model.weights=null", *TINY_SETTINGS, "train.threads=1"]
    spec = replace(
        spec,
        config="configs/test_tiny.yaml",
        overrides=(),
        plumbing=tuple(tiny),
        meta={**spec.meta, "beams": (1, 3)},
    )
    flickr8k.train_and_decode(spec)
    folder = spec.folder.parent
    job = json.loads((folder / "job.json").read_text())
    assert {
        "model",
        "seed",
        "variant",
        "config",
        "settings",
        "select_metric",
        "best_val",
        "best_epoch",
        "epochs",
        "steps",
        "train_seconds",
        "evaluate_seconds",
        "precision",
        "device",
        "cpu",
        "threads",
        "timed_alone",
        "commit",
        "command",
        "stages",
        "history",
    } <= set(job)
    assert set(job["evaluate_seconds"]) == {"1", "3"} and job["threads"] == 1
    assert (folder / "test_beam3" / "predictions.json").is_file()
    stamp = (folder / "job.json").stat().st_mtime_ns
    flickr8k.train_and_decode(spec)  # a finished run is left as it is
    assert (folder / "job.json").stat().st_mtime_ns == stamp


def test_the_table_puts_the_papers_rows_beside_ours():
    tables = load_tool("tables")
    rows = [
        {
            "variant": "recipe",
            "model": "soft",
            "seed": s,
            "beam_size": 3,
            "device": "Xeon",
            "threads": 2,
            "precision": "bf16",
            "commit": "abcdef0123",
            "Bleu_1": 0.6,
            "Bleu_2": 0.4,
            "Bleu_3": 0.27,
            "Bleu_4": b,
            "METEOR": 0.19,
            "Bleu_4_no_bp": b,
            "ROUGE_L": 0.45,
            "CIDEr": c,
        }
        for s, b, c in ((0, 0.18, 0.45), (1, 0.19, 0.47))
    ]
    text = tables.flickr8k(rows)
    paper = (
        "| **paper: soft** (Xu et al. 2015; BLEU without BP) | | | | 67.0 | 44.8 | 29.9 | 19.5 |"
    )
    assert paper + " 18.93 |" in text
    line = (
        "| soft | 3 | Xeon CPU | 2 | 60.00 | 40.00 | 27.00 | 18.50 | 19.00 | 18.50 | 45.00 | 46.00"
    )
    assert line + " | 45.0 (0), 47.0 (1) |" in text
    assert "Xeon (2 threads), precision bf16; commits abcdef0" in text


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--models", "soft,wat"], "unknown model 'wat'"),
        (["--seeds", "0,x"], "--seeds wants seeds >= 0"),
        (["--set", "train.seed=3"], "train.seed is the study's to set"),
        (["--variant", "a b", "--models", "soft"], "--variant must be a plain name"),
        (["--variant", "wide"], "leave nn out of --models"),
    ],
)
def test_options_a_user_can_get_wrong(tmp_path, capsys, argv, message):
    with pytest.raises(SystemExit) as stopped:
        flickr8k.main(["--shared", str(tmp_path), "--out", str(tmp_path / "o"), *argv])
    assert stopped.value.code == 2
    assert message in capsys.readouterr().err


def test_a_missing_shared_folder_is_one_line(tmp_path, capsys):
    code = flickr8k.main(["--shared", str(tmp_path / "nowhere"), "--out", str(tmp_path / "o")])
    assert code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--shared must name the shared folder" in err


def test_the_committed_rows_name_no_machine_path():
    path = Path(__file__).resolve().parents[1] / "results" / "flickr8k.json"
    if not path.is_file():
        pytest.skip("results/flickr8k.json is not there yet")
    rows = json.loads(path.read_text())
    for row in rows:
        text = json.dumps({k: row[k] for k in ("command", "overrides", "config")})
        assert "/" + "tmp" not in text and "/home" not in text and "/work" not in text, text
        assert row["commit"] and row["device"] and row["precision"] and row["threads"]


def test_a_row_says_an_even_maps_entropy_per_training_caption(tiny_hard_checkpoint, tmp_path):
    """The yardstick of the traced entropy: ln L for each step of a mean training caption
    (its words cut as training cuts them, and <end>), on the checkpoint's grid."""
    import math
    import shutil

    from benchmarks.flickr8k_scores import even_entropy
    from captioning.api import load

    model = load(tiny_hard_checkpoint, "cpu")
    limit = model.config.data.max_caption_length
    folder = tmp_path / "runs" / "best_hard-seed0"
    (folder / "train").mkdir(parents=True)
    shutil.copy(tiny_hard_checkpoint, folder / "train" / "best.pt")
    long = " ".join(["dog"] * (limit + 7))
    annotations = [{"image_id": 1, "id": 1, "caption": "A dog runs ."}, {"caption": long}]
    captions = tmp_path / "data" / "annotations" / "captions_train.json"
    captions.parent.mkdir(parents=True)
    captions.write_text(json.dumps({"annotations": annotations}))
    rows, cols = model.grid_shape
    steps = ((3 + 1) + (limit + 1)) / 2  # "a dog runs" and <end>; the cut caption and <end>
    assert even_entropy(tmp_path, folder) == {
        "even_entropy": pytest.approx(steps * math.log(rows * cols), abs=1e-3)
    }
    assert even_entropy(tmp_path, tmp_path / "no-run") == {}
