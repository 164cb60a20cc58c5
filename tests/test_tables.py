"""The docs' generated tables equal what ``python -m tools.tables`` makes of the committed
results, and the note under each table says where its rows come from."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import tools.tables
from tests.conftest import ROOT
from tools.tables import common, shapes


def _tables():
    return tools.tables


def test_every_generated_table_is_current() -> None:
    tables = _tables()
    documents = tables.documents()
    assert any("<!-- table: " in p.read_text(encoding="utf-8") for p in documents)
    for path in documents:
        text = path.read_text(encoding="utf-8")
        assert tables.render(text) == text, (
            f"{path.name}: a generated table differs from results/; run python -m tools.tables"
        )


def _row(model: str, seed: int | None, cider: float) -> dict:
    return {
        "model": model,
        "seed": seed,
        "CIDEr": cider,
        "Bleu_1": 0.6,
        "Bleu_4": 0.3,
        "ROUGE_L": 0.5,
        "recipe_seconds": 300.0 + (seed or 0),
        "k": 10,
        "command": "python -m benchmarks.photos --shared SHARED --out OUT/x",
        "commit": "abcdef123",
        "cores": 2,
        "cpu": "cpu",
        "test_images": 293,
        "beam_size": 3,
    }


def test_a_changed_row_changes_the_table(tmp_path: Path) -> None:
    tables = _tables()
    rows = [_row("nn", None, 1.1), _row("soft", 0, 1.2), _row("soft", 1, 1.4)]
    (tmp_path / "photos.json").write_text(json.dumps(rows))
    text = "before\n<!-- table: photos -->\nstale\n<!-- end table -->\nafter\n"
    out = tables.render(text, tmp_path)
    assert out.startswith("before\n<!-- table: photos -->\n| model |")
    assert out.endswith("<!-- end table -->\nafter\n")
    assert "| soft attention | 1.300 ± 0.141 | 1.200 (0), 1.400 (1) |" in out
    assert "| nearest neighbour (consensus, k on val) | 1.100 | k = 10 (deterministic) |" in out
    assert tables.render(out, tmp_path) == out  # rendering is idempotent
    rows[1]["CIDEr"] = 1.0
    (tmp_path / "photos.json").write_text(json.dumps(rows))
    assert "| soft attention | 1.200 ± 0.283 |" in tables.render(out, tmp_path)


def test_an_unknown_table_is_refused(tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match="unknown table 'nope'"):
        _tables().render("<!-- table: nope -->\n<!-- end table -->", tmp_path)


def test_levers_table_sets_each_variant_against_the_recipe(tmp_path: Path) -> None:
    tables = _tables()

    def soft(variant: str | None, seed: int, cider: float, extra: list[str]) -> dict:
        row = _row("soft", seed, cider)
        row["val_CIDEr"] = cider - 0.01
        row["overrides"] = ["data.root=OUT/data", "model.attention=soft", f"train.seed={seed}"]
        row["overrides"] += extra
        if variant is not None:  # rows written before variants existed are the recipe's
            row["variant"] = variant
        return row

    nn = _row("nn", None, 1.25)
    nn["val_CIDEr_by_k"] = {"10": 1.15}
    rows = [
        nn,
        soft(None, 0, 1.2, []),
        soft("recipe", 1, 1.1, []),
        soft("smooth", 0, 1.3, ["train.label_smoothing=0.1"]),
    ]
    (tmp_path / "photos.json").write_text(json.dumps(rows))
    out = tables.render("<!-- table: photo_levers -->\n<!-- end table -->\n", tmp_path)
    assert "| recipe | (the config as it is) | 2 | 1.140 ± 0.071 | 1.150 ± 0.071 |" in out
    assert "| smooth | `train.label_smoothing=0.1` | 1 | 1.290 | 1.300 | 1.300 (0) |" in out
    assert "nearest neighbour scores 1.250 on test at k = 10 (val 1.150)" in out
    # the recipe's own table leaves the lever out
    recipe = tables.render("<!-- table: photos -->\n<!-- end table -->\n", tmp_path)
    assert "| soft attention | 1.150 ± 0.071 | 1.200 (0), 1.100 (1) |" in recipe


def test_two_stage_rows_are_timed_whole_and_left_out_of_the_levers(tmp_path: Path) -> None:
    tables = _tables()
    nn = _row("nn", None, 1.25)
    nn["val_CIDEr_by_k"] = {"10": 1.15}
    staged = _row("soft", 0, 1.3)
    staged.update(
        variant="budget",
        val_CIDEr=1.2,
        train_seconds=400.0,
        evaluate_seconds=9.0,
        config="configs/photos_mobilenet.yaml",
        recipe_seconds=520.0,
        prepare_seconds=4.0,
        extract_seconds=107.0,
        overrides=["data.root=OUT/data", "model.dropout=0.3", "train.seed=0"],
        then={
            "config": "configs/photos_scst.yaml",
            "overrides": ["train.epochs=4"],
            "first_val_CIDEr": 1.1,
            "first_best_epoch": 12,
            "first_seconds": 180.0,
        },
    )
    recipe = {**_row("soft", 0, 1.2), "val_CIDEr": 1.1, "overrides": ["train.seed=0"]}
    (tmp_path / "photos.json").write_text(json.dumps([nn, recipe, staged]))
    timed = tables.render("<!-- table: photo_budget_timed -->\n<!-- end table -->\n", tmp_path)
    assert (
        "| budget | 0 | `photos_mobilenet.yaml` `model.dropout=0.3` | `photos_scst.yaml` "
        "`train.epochs=4` | 111 | 180 | 220 | 9 | **520** | 1.300 | yes |"
    ) in timed
    levers = tables.render("<!-- table: photo_levers -->\n<!-- end table -->\n", tmp_path)
    assert "budget" not in levers
    main = tables.render("<!-- table: photos -->\n<!-- end table -->\n", tmp_path)
    assert "self-critical" not in main  # a two-stage row of another variant
    staged["variant"] = tables.RECIPE_SCST  # the shipped two-stage recipe's rows
    (tmp_path / "photos.json").write_text(json.dumps([nn, recipe, staged]))
    main = tables.render("<!-- table: photos -->\n<!-- end table -->\n", tmp_path)
    assert "| soft attention | 1.200 | 1.200 (0) |" in main
    assert "| soft attention, then self-critical training | 1.300 | 1.300 (0) |" in main
    assert "| 520 |" in main


def test_runs_beside_other_work_are_not_timed(tmp_path: Path) -> None:
    rows = [_row("soft", 0, 1.2), _row("soft", 1, 1.3), _row("hard", 1, 1.1)]
    rows[1]["timed_alone"] = False
    rows[2]["timed_alone"] = False
    (tmp_path / "photos.json").write_text(json.dumps(rows))
    out = _tables().render("<!-- table: photos -->\n<!-- end table -->\n", tmp_path)
    assert "| 0.500 ± 0.000 | 300 |" in out  # soft: seed 0's seconds only
    assert (
        "| hard attention (exact marginal) | 1.100 | 1.100 (1) | – | 0.600 | 0.300 | 0.500 | - |"
        in out  # no nearest-neighbour row here: nothing to count seeds against
    )
    assert "not timed: soft seed 1, hard seed 1." in out


def test_the_shapes_recipe_rows_are_the_shipped_config() -> None:
    """The seed-study variant that docs/shapes.md shows as the recipe sets nothing the shipped
    config does not already say."""
    from captioning.config import config_to_dict, load_config

    tables = _tables()
    rows = [r for r in tables.load_rows("shapes_seeds") if r["variant"] == tables.SHAPES_RECIPE]
    assert len(rows) >= 3
    shipped = config_to_dict(load_config(ROOT / "configs" / "shapes_soft.yaml"))
    for row in rows:
        for override in row["overrides"]:
            key, value = override.split("=", 1)
            section, name = key.split(".")
            assert str(shipped[section][name]) == value, override


def test_the_hard_recipe_rows_are_at_the_shipped_rate() -> None:
    """docs/hard-attention.md shows the family study's hard rows at HARD_LR as the shipped
    config: that rate is the config's, for the decoder and the encoder."""
    from captioning.config import load_config

    tables = _tables()
    cfg = load_config(ROOT / "configs" / "shapes_hard.yaml")
    assert cfg.train.lr == cfg.train.encoder_lr == tables.HARD_LR
    rows = tables.load_rows("attention_family")
    assert len([r for r in rows if r["member"] == "hard" and r["lr"] == tables.HARD_LR]) == 3


def test_no_committed_row_names_a_machine_path():
    """Rows are re-runnable elsewhere: paths are OUT/, SHARED/ or inside the checkout."""
    for path in sorted((ROOT / "results").glob("*.json")):
        text = path.read_text(encoding="utf-8")
        for prefix in ("/" + "tmp/", "/" + "work/", "/" + "home/", "/" + "root/"):
            assert prefix not in text, f"{path.name} names {prefix}..."


def test_a_seed_is_at_target_only_when_every_score_is():
    tables = _tables()
    target = tables.SHAPES_TARGETS["configs/shapes_soft.yaml"]
    row = {
        "test_exact": 0.96,
        "test_exact_by_objects": {"3": 0.92},
        "pointing": {"color": 0.95, "size": 0.91, "shape": 0.99},
    }
    assert shapes._at_target(row, target)
    assert not shapes._at_target({**row, "test_exact": 0.949}, target)
    assert not shapes._at_target({**row, "test_exact_by_objects": {"3": 0.89}}, target)
    assert not shapes._at_target({**row, "pointing": {**row["pointing"], "size": 0.5}}, target)
    local = tables.SHAPES_TARGETS["configs/shapes_local.yaml"]  # exact match alone
    assert shapes._at_target({**row, "test_exact": 0.91, "pointing": {}}, local)


def test_the_photos_table_counts_the_seeds_that_beat_the_nearest_neighbour(tmp_path: Path):
    rows = [
        _row("nn", None, 1.25),
        _row("soft", 0, 1.2),
        _row("soft", 1, 1.3),
        _row("soft", 2, 1.26),
    ]
    (tmp_path / "photos.json").write_text(json.dumps(rows))
    out = _tables().render("<!-- table: photos -->\n<!-- end table -->\n", tmp_path)
    assert "| 1.200 (0), 1.300 (1), 1.260 (2) | 2 of 3 |" in out
    assert "| k = 10 (deterministic) | – |" in out


def _photo_rows(**provenance) -> list[dict]:
    """A nearest neighbour and two soft seeds of ``results/photos.json`` with ``provenance``
    in place of the old ``cpu``/``cores`` keys."""
    rows = [_row("nn", None, 1.1), _row("soft", 0, 1.2), _row("soft", 1, 1.4)]
    for row in rows:
        del row["cpu"], row["cores"]
        row.update(provenance)
    return rows


def _note(text: str) -> str:
    """The lines of a rendered table that are not table lines."""
    return "\n".join(line for line in text.splitlines() if not line.startswith("|"))


def test_the_note_says_precision_device_threads_timing_and_the_dirty_commit() -> None:
    rows = _photo_rows(
        precision="bf16",
        device="NVIDIA H100 80GB HBM3",
        threads=4,
        timed_alone=True,
        commit="abcdef123+dirty",
    )
    rows[0]["commit"] = "1234567890"
    note = _note(tools.tables.photos(rows))
    assert "precision bf16" in note
    assert "NVIDIA H100 80GB HBM3 (4 threads)" in note
    assert "timed alone" in note and "not timed alone" not in note
    assert "commit 1234567, abcdef1+dirty" in note


def test_the_note_reads_the_older_keys_and_says_what_no_row_recorded() -> None:
    machine = {"cpu": "AMD EPYC", "cores": 2, "threads": 1, "torch": "2.6"}
    rows = _photo_rows(device="cpu", machine=machine, timed_alone="not recorded")
    note = _note(tools.tables.photos(rows))
    assert "on AMD EPYC (2 cores, 1 thread)" in note  # a device kind gives way to the CPU
    assert "precision not recorded" in note and "timed alone: not recorded" in note
    mixed = [*_photo_rows(cpu="Intel Xeon", cores=2, timed_alone=False), *rows]
    assert common.timed(mixed) == "timed alone: 0 of 6 rows, 3 not recorded"
    assert common.machines([{"device": "NVIDIA H200"}]) == "NVIDIA H200 (threads not recorded)"
    assert common.machines([{}]) == "device not recorded"


def test_an_absolute_path_in_a_command_never_reaches_the_doc(tmp_path: Path) -> None:
    machine_folder = "/" + "home/someone/runs"  # spelt apart: no committed text names it
    rows = _photo_rows(precision="fp32", device="AMD EPYC", threads=1, timed_alone=True)
    for row in rows:
        row["val_CIDEr"], row["val_CIDEr_by_k"] = 1.0, {"10": 1.0}
        row["overrides"] = [f"train.seed={row['seed']}"]
    rows[2].update(
        variant="smooth",
        overrides=["train.label_smoothing=0.1"],
        command=f"python -m benchmarks.photos --shared {common.SHARED}/data "
        f"--out {machine_folder}/bench --set data.root={machine_folder}/d "
        f"--config {common.ROOT}/configs/photos.yaml",
    )
    (tmp_path / "photos.json").write_text(json.dumps(rows))
    out = tools.tables.render("<!-- table: photo_levers -->\n<!-- end table -->\n", tmp_path)
    assert machine_folder not in out and str(common.ROOT) not in out
    assert (
        "`python -m benchmarks.photos --shared SHARED/data --out OUT/bench "
        "--set data.root=DATA/d --config configs/photos.yaml`"
    ) in out


def _checkout(root: Path) -> Path:
    """A checkout at ``root`` with the committed photos rows and a doc of their table."""
    (root / "results").mkdir(parents=True)
    (root / "docs").mkdir()
    shutil.copy(ROOT / "results" / "photos.json", root / "results" / "photos.json")
    doc = root / "docs" / "photos.md"
    doc.write_text("# Photos\n\n<!-- table: photos -->\n<!-- end table -->\n\nProse.\n")
    return doc


def test_check_fails_on_a_doc_edited_by_hand(tmp_path: Path, capsys) -> None:
    doc = _checkout(tmp_path)
    assert tools.tables.main(["--check"], root=tmp_path) == 1  # the block is empty
    assert tools.tables.main([], root=tmp_path) == 0
    assert tools.tables.main(["--check"], root=tmp_path) == 0
    rendered = doc.read_text()
    edited = rendered.replace("| soft attention |", "| soft attention (typed by hand) |")
    assert edited != rendered
    doc.write_text(edited)
    capsys.readouterr()
    assert tools.tables.main(["--check"], root=tmp_path) == 1
    assert "docs/photos.md: out of date" in capsys.readouterr().out
    assert doc.read_text() == edited  # --check changes nothing
    assert tools.tables.main([], root=tmp_path) == 0 and doc.read_text() == rendered


def test_the_module_checks_the_committed_docs() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "tools.tables", "--check"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout + done.stderr


@pytest.mark.parametrize("name", sorted(tools.tables.TABLES))
def test_every_committed_table_notes_its_provenance(name: str) -> None:
    """Each table's note names a commit, a precision, the threads and the timing of the rows
    of its file."""
    source = tools.tables.SOURCES.get(name, name)
    if not (ROOT / "results" / f"{source}.json").is_file():
        pytest.skip(f"results/{source}.json is not committed")
    rows = tools.tables.load_rows(source)
    table = tools.tables.TABLES[name](rows)
    if table.startswith("No rows"):
        pytest.skip(f"no rows of {name} in results/{source}.json")
    note = _note(table)
    assert any(c in note for c in common.commits(rows).split(", ")), note
    assert any(p in note for p in common.precisions(rows).split(", ")), note
    assert "thread" in note, note
    assert any(t in note for t in ("timed alone", "idle machine", "doing other work")), note


def test_no_module_of_the_renderer_exceeds_400_lines() -> None:
    modules = sorted((ROOT / "tools" / "tables").glob("*.py"))
    assert len(modules) > 5
    long = {m.name: n for m in modules if (n := len(m.read_text().splitlines())) > 400}
    assert long == {}


def test_placeholders_and_templates_in_a_command_stay_as_they_are() -> None:
    command = (
        "python -m tools.grounding_study --checkpoint 'RUNS/soft-seed{seed}/train/best.pt' "
        "--out OUT/g --data SHARED/data/coco_mini"
    )
    assert common.portable(command) == command
    assert common.portable("x --out /abs/folder/run") == "x --out OUT/run"


def test_the_results_index_lists_every_file_with_its_commands(tmp_path: Path) -> None:
    same = {"command": "python -m tools.a --out OUT/x"}
    rows = [same, same, {"study": "python -m tools.b", "command": "captioning evaluate"}]
    (tmp_path / "first.json").write_text(json.dumps(rows))
    (tmp_path / "second.json").write_text("[]")
    out = tools.tables.render("<!-- table: results_index -->\n<!-- end table -->\n", tmp_path)
    assert "| [`results/first.json`](../results/first.json) | 3 | " in out
    assert "`python -m tools.a --out OUT/x` (2)<br>`python -m tools.b` (1)" in out
    assert "| [`results/second.json`](../results/second.json) | 0 | – |" in out


def test_flickr8k_targets_say_met_only_when_the_mean_reaches_the_target() -> None:
    from tools.tables.flickr8k_time import flickr8k_targets

    def row(model: str, seed: int | None, bleu4: float, cider: float) -> dict:
        return {
            "variant": "recipe",
            "model": model,
            "seed": seed,
            "beam_size": 3,
            "device": "Intel Xeon",
            "Bleu_4": bleu4,
            "METEOR": 0.19,
            "CIDEr": cider,
            "timed_alone": False,
            "seconds": {},
            "precision": "bf16",
            "threads": 2,
            "commit": "abc1234",
        }

    rows = [
        row("nn", None, 0.15, 0.43),
        row("soft", 0, 0.20, 0.50),
        row("soft", 1, 0.19, 0.46),
        row("soft", 2, 0.20, 0.49),
    ]
    table = flickr8k_targets(rows)
    assert "| soft attention by cross-entropy: BLEU-4 ≥ 19.5 | Intel CPU | 3 | 19.67 |" in table
    bleu = next(line for line in table.splitlines() if "BLEU-4 ≥ 19.5" in line)
    assert bleu.endswith("| yes |")
    # the worst seed (46.0) beats nn (43.0) by 3.0, more than the spread (2.08)
    cider = next(line for line in table.splitlines() if "by more than the seed spread" in line)
    assert "(2.08)" in cider and cider.endswith("| yes |")
    rows[2]["CIDEr"] = 0.44  # now below the baseline's 43.0 + spread
    cider = next(line for line in flickr8k_targets(rows).splitlines() if "seed spread" in line)
    assert cider.endswith("| no |")
    # a second host's rows are its own group, never averaged with the first's
    other = {**row("soft", 0, 0.10, 0.40), "device": "AMD EPYC", "precision": "fp32"}
    lines = [
        line
        for line in flickr8k_targets([*rows, other]).splitlines()
        if line.startswith("| soft attention by cross-entropy: BLEU-4")
    ]
    assert lines[0].startswith(
        "| soft attention by cross-entropy: BLEU-4 ≥ 19.5 | AMD CPU | 1 | 10.00 |"
    )
    assert "| Intel CPU | 3 | 19.67 |" in lines[1] and len(lines) == 2


def test_the_flickr8k_headline_shows_the_models_of_three_seeds_and_the_neighbour() -> None:
    from tools.tables.flickr8k import flickr8k, flickr8k_headline

    def row(model: str, seed: int | None, device: str = "Intel Xeon") -> dict:
        return {
            "variant": "recipe",
            "model": model,
            "seed": seed,
            "beam_size": 3,
            "device": device,
            "Bleu_4": 0.19,
            "METEOR": 0.19,
            "CIDEr": 0.46,
            "timed_alone": False,
            "precision": "bf16",
            "threads": 2,
            "commit": "abc1234",
        }

    rows = [
        {**row("nn", None), "beam_size": None},
        *(row("best", s) for s in range(3)),
        row("best", 0, "AMD EPYC"),
        row("best_exact", 0, "AMD EPYC"),
    ]
    every = [line.split(" | ")[:3] for line in flickr8k(rows).splitlines()[4:-2]]
    headline = [line.split(" | ")[:3] for line in flickr8k_headline(rows).splitlines()[4:-2]]
    assert ["| best", "3", "AMD CPU"] in every and ["| best_exact", "3", "AMD CPU"] in every
    assert headline == [["| nn", "–", "Intel CPU"], ["| best", "3", "Intel CPU"]]


def test_flickr8k_levers_name_what_a_lever_sets_beyond_the_best_recipe() -> None:
    from tools.tables.flickr8k import flickr8k_levers

    def row(variant: str, overrides: list[str], threads: int = 1) -> dict:
        return {
            "variant": variant,
            "model": "best",
            "seed": 0,
            "beam_size": 3,
            "device": "Intel Xeon",
            "Bleu_4": 0.19,
            "METEOR": 0.19,
            "CIDEr": 0.46,
            "best_val": 0.45,
            "select_metric": "CIDEr",
            "overrides": overrides,
            "timed_alone": False,
            "precision": "bf16",
            "threads": threads,
            "commit": "abc1234",
        }

    own = ["model.image_size=224", "train.epochs=20"]  # configs/flickr8k_best.yaml's own
    rows = [
        row("recipe", [], 2),
        row("best_ls", [*own, "train.label_smoothing=0.1"]),
        row("one_thread", own),
    ]
    table = flickr8k_levers(rows)
    lines = {line.split(" | ")[0]: line for line in table.splitlines()}
    assert (
        "`configs/flickr8k_best.yaml`: `model.image_size=224`, `train.epochs=20`" in lines["| best"]
    )
    assert "`configs/flickr8k_best.yaml` and `train.label_smoothing=0.1` |" in lines["| best_ls"]
    assert "`configs/flickr8k_best.yaml` and trained on 1 thread(s) |" in lines["| one_thread"]
    # second stages name their config and the run they start from
    stages = [
        {**row("recipe", []), "model": model, "config": f"configs/flickr8k_{model}.yaml"}
        for model in ("finetune", "best_finetune")
    ]
    lines = {line.split(" | ")[0]: line for line in flickr8k_levers(stages).splitlines()}
    assert "`configs/flickr8k_finetune.yaml`, from the recipe's `best.pt`" in lines["| finetune"]
    assert (
        "`configs/flickr8k_best_finetune.yaml`, from best's `best.pt`" in lines["| best_finetune"]
    )
    # a second stage's own lever: its config and what the lever sets over it
    lever = {
        **stages[1],
        "model": "best_scst",
        "config": "configs/flickr8k_best_scst.yaml",
        "variant": "lr2e4",
        "overrides": ["data.root=OUT/data", "train.lr=2e-4"],
    }
    hard = {**lever, "model": "hard", "config": "configs/flickr8k_hard.yaml", "variant": "recipe"}
    hard7 = {**hard, "variant": "hard_grid7", "overrides": ["model.image_size=224"]}
    table = flickr8k_levers([lever, hard, hard7])
    lines = {line.split(" | ")[0]: line for line in table.splitlines()}
    assert "| `configs/flickr8k_best_scst.yaml` and `train.lr=2e-4` |" in lines["| lr2e4"]
    assert "| hard | `configs/flickr8k_hard.yaml` |" in lines["| hard"]
    assert "`configs/flickr8k_hard.yaml` and `model.image_size=224` |" in lines["| hard_grid7"]


def test_flickr8k_step_cost_compares_settings_with_the_soft_model_on_as_many_threads() -> None:
    from tools.tables.flickr8k_time import flickr8k_step_cost

    def row(config: str, step: float, threads: int, extra: tuple = ()) -> dict:
        return {
            "kind": "profile",
            "config": f"configs/flickr8k_{config}.yaml",
            "overrides": ["data.root=OUT/data", f"train.threads={threads}", *extra],
            "threads": threads,
            "step_seconds": step,
            "steps_per_epoch": 188,
            "precision": "bf16",
            "device": "Intel Xeon",
            "timed_alone": True,
            "commit": "abc1234",
        }

    wide = ("model.hidden_dim=1024",)
    rows = [
        row("mobilenet", 0.4, 1),
        row("hard_exact", 12.0, 1),
        row("best", 0.2, 2),
        row("best", 0.1, 2),
        row("best", 0.15, 2),
        row("best", 0.3, 2, wide),
    ]
    # a row that names only the device type is labelled by its machine's CPU
    rows[-1] |= {"device": "cpu", "machine": {"cpu": "Intel(R) Xeon(R) Processor"}}
    lines = flickr8k_step_cost(rows).splitlines()
    assert (
        "| `configs/flickr8k_hard_exact.yaml` | – | Intel CPU | 1 | 1 | 12.00 | 12.00 | 30.0x "
        "| 38 min |" in lines
    )
    assert (
        "| `configs/flickr8k_best.yaml` | – | Intel CPU | 2 | 3 | 0.15 | 0.20, 0.10, 0.15 | 1.0x "
        "| 28 s |" in lines
    )
    assert (
        "| `configs/flickr8k_best.yaml` | `model.hidden_dim=1024` | Intel CPU | 2 | 1 | 0.30 "
        "| 0.30 | 2.0x | 56 s |" in lines
    )


def test_flickr8k_time_leaves_a_stage_not_recorded_and_its_total_blank() -> None:
    from tools.tables.flickr8k_time import flickr8k_time

    def row(seed: int, prepare: float | None) -> dict:
        seconds = {
            "prepare": prepare,
            "extract": 72.0,
            "train": 651.0,
            "evaluate": 12.0,
            "recipe": 748.0 if prepare else 737.0,
        }
        return {
            "variant": "recipe",
            "model": "best",
            "seed": seed,
            "beam_size": 3,
            "device": "Intel Xeon",
            "threads": 2,
            "timed_alone": seed == 0,
            "seconds": seconds,
            "precision": "bf16",
            "commit": "abc1234",
        }

    lines = flickr8k_time([row(0, 11.0), row(1, None)]).splitlines()
    assert "| best | 0 | Intel Xeon | bf16 | 2 | yes | 11 | 72 | 651 | 12 | 748 |" in lines
    assert "| best | 1 | Intel Xeon | bf16 | 2 | no | – | 72 | 651 | 12 | – |" in lines


def test_flickr8k_attention_shows_hard_levers_and_leaves_out_self_critical_runs() -> None:
    from tools.tables.flickr8k import flickr8k_attention

    def row(model: str, variant: str = "recipe") -> dict:
        trace = {"nll_per_token": 2.5, "penalty": 0.0 if "scst" in model else 28.5}
        return {
            "variant": variant,
            "model": model,
            "seed": 0,
            "beam_size": 3,
            "device": "Intel Xeon",
            "training": {"first_epoch": trace, "last_epoch": trace},
            "precision": "bf16",
            "threads": 1,
            "timed_alone": False,
            "commit": "abc1234",
        }

    looks = row("best_hard", "os16_hard")
    looks["training"] = {
        "first_epoch": {"penalty": 174.0, "entropy": 52.0},
        "last_epoch": {"penalty": 174.0, "entropy": 49.0},
        "even_entropy": 61.25,
    }
    rows = [
        row("best"),
        row("best_scst"),
        row("scst"),
        row("hard", "hard_grid7"),
        row("soft", "dsw0"),
        looks,
        row("best_exact", "os16_exact"),
    ]
    lines = [line for line in flickr8k_attention(rows).splitlines()[2:] if line.startswith("| ")]
    names = [line.split(" | ")[0] for line in lines]
    assert names == [
        "| best",
        "| best_exact (os16_exact)",
        "| best_hard (os16_hard)",
        "| hard (hard_grid7)",
    ]
    lines.remove(lines[1])
    # the last epoch's entropy as a share of an even map's, where the row records one
    assert lines[1].split(" | ")[5:8] == ["52.00", "49.00", "80.0"]
    assert lines[2].split(" | ")[7] == "–"


def test_flickr8k_targets_hold_every_attending_model_to_the_cider_target() -> None:
    from tools.tables.flickr8k_time import flickr8k_targets

    def row(model: str, seed: int | None, cider: float) -> dict:
        return {
            "variant": "recipe",
            "model": model,
            "seed": seed,
            "beam_size": 3,
            "device": "Intel Xeon",
            "CIDEr": cider,
            "Bleu_4": 0.19,
            "METEOR": 0.19,
            "timed_alone": False,
            "seconds": {},
            "precision": "bf16",
            "threads": 1,
            "commit": "abc1234",
        }

    rows = [
        row("nn", None, 0.43),
        row("none", 0, 0.44),
        row("none", 1, 0.44),
        row("best_finetune", 0, 0.47),
        row("best_finetune", 1, 0.471),
    ]
    lines = [line for line in flickr8k_targets(rows).splitlines() if "CIDEr-D above" in line]
    assert len(lines) == 1 and lines[0].startswith("| best_finetune: CIDEr-D above nn and none")
    assert lines[0].endswith("| yes |")


def test_the_grounding_verdict_needs_two_seeds_for_a_spread() -> None:
    from tools.tables.grounding import _grounding_verdict

    def row(model: float) -> dict:
        maps = {"model": (model, 0.30), "centre": (0.50, 0.25), "saliency": (0.40, 0.20)}
        return {
            "grounding": {"overall": {k: {"pointing": p, "mass": m} for k, (p, m) in maps.items()}}
        }

    one = _grounding_verdict("hard", [row(0.60)])
    assert "one seed, so no spread to beat them by" in one and "0.000" not in one
    three = _grounding_verdict("soft", [row(0.60), row(0.62), row(0.64)])
    assert "standard deviation) 0.020: it beats both on every seed" in three


def test_the_localiser_table_shows_only_models_with_a_localiser_as_shares_of_baselines() -> None:
    from tools.tables.looks import grounding_localiser

    def row(variant: str, seed: int, localiser: bool) -> dict:
        maps = {
            "model": (0.6, 0.45, 0.1, 3.0),
            "centre": (0.5, 0.30, 0.01, 5.0),
            "saliency": (0.55, 0.35, 0.02, 4.5),
            **({"localiser": (0.4, 0.39, 0.49, 1.32)} if localiser else {}),
        }
        keys = ("pointing", "mass", "median_peak", "mean_entropy")
        overall = {k: dict(zip(keys, v, strict=True)) for k, v in maps.items()}
        return {
            "model": "soft",
            "variant": variant,
            "seed": seed,
            "grounding": {"grid": [7, 7], "overall": {"words": 40, **overall}},
            "precision": "bf16",
            "device": "AMD EPYC",
            "threads": 1,
            "timed_alone": False,
            "commit": "abc1234",
        }

    table = grounding_localiser([row("os16", 0, False), row("os16_current", 1, True)])
    lines = [line for line in table.splitlines() if line.startswith("| soft")]
    # mass 0.39 and 0.45 against the centre's 0.30; peak 0.49 on 49 cells is 24.0x even;
    # entropy 1.32 of ln 49 = 3.89 nats is 34%
    assert lines == [
        "| soft (os16_current) | 1 | 40 | 0.400 / 0.600 / 0.500 / 0.550 | 1.30, 1.50 | 24.0 | 34 |"
    ]


def test_the_references_table_checks_the_targets_for_the_attention_and_the_localiser() -> None:
    from tools.tables.looks import grounding_references

    def row(seed: int, model: float, localiser: float) -> dict:
        maps = {
            "model": (model, 0.36, 0.1, 3.0),
            "localiser": (localiser, 0.45, 0.5, 1.0),
            "centre": (0.58, 0.30, 0.01, 5.0),
            "saliency": (0.56, 0.33, 0.02, 4.5),
        }
        keys = ("pointing", "mass", "median_peak", "mean_entropy")
        overall = {k: dict(zip(keys, v, strict=True)) for k, v in maps.items()}
        return {
            "model": "soft",
            "variant": "os16_current",
            "seed": seed,
            "grounding": {"grid": [7, 7], "overall": {"words": 40, **overall}},
            "references": {"overall": {"words": 459, **overall}},
            "precision": "bf16",
            "device": "AMD EPYC",
            "threads": 1,
            "timed_alone": False,
            "commit": "abc1234",
        }

    table = grounding_references([row(0, 0.60, 0.66), row(1, 0.57, 0.68), row(2, 0.59, 0.70)])
    assert "| soft (os16_current) | 0 | 459 | 0.600 / 0.660 / 0.580 / 0.560 | 1.20, 1.50 |" in table
    assert (
        "**soft (os16_current)**: pointing minus the better of the centre prior and the "
        "saliency map, seed by seed, +0.020, -0.010, +0.010 (spread 0.015): not above both by "
        "the spread on every seed; mass under 1.25x the centre prior's on some seed. The "
        "localiser's maps, against the same baselines: pointing minus the better of the centre "
        "prior and the saliency map, seed by seed, +0.080, +0.100, +0.120 (spread 0.020): above "
        "both by more than the spread on every seed; mass at least 1.25x the centre prior's on "
        "every seed." in table
    )


def test_flickr8k_dev_decode_sets_each_seeds_choice_beside_three_beams_on_the_same_runs() -> None:
    from tools.tables.flickr8k_decoding import flickr8k_dev_decode

    def row(seed: int, variant: str, bleu: float, beam: int | None, chosen=None) -> dict:
        return {
            "variant": variant,
            "model": "best",
            "seed": seed,
            "beam_size": beam,
            "Bleu_4": bleu,
            "METEOR": 0.19,
            "CIDEr": 0.46,
            "device": "AMD EPYC",
            "precision": "fp32",
            "threads": 2,
            "timed_alone": False,
            "commit": "abc1234",
            **({"decode": {"beam_size": chosen[0], "length_penalty": chosen[1]}} if chosen else {}),
        }

    rows = [
        row(0, "recipe", 0.187, 3),
        row(1, "recipe", 0.190, 3),
        row(0, "recipe", 0.19, 5),
        row(0, "dev_decode", 0.192, None, (5, 0.0)),
        row(1, "dev_decode", 0.196, None, (7, 0.5)),
        row(2, "dev_decode", 0.30, None, (5, 0.0)),
        row(0, "looks", 0.180, 3),
        row(0, "looks_dev_decode", 0.185, None, (10, 1.0)),
        row(1, "looks_dev_decode", 0.185, None, (10, 1.0)),  # no 3-beam row of looks seed 1
    ]  # seed 2: no 3-beam row
    lines = flickr8k_dev_decode(rows).splitlines()
    assert lines[2] == (
        "| best | recipe | AMD CPU | 2 | 5 / 0 (0), 7 / 0.5 (1) | 19.40 | 18.85 | 19.00 "
        "| 19.00 | 46.00 | 46.00 | 19.20 (0), 19.60 (1) | 19.00 (0), 19.00 (1) |"
    )
    assert lines[3] == (
        "| best | looks | AMD CPU | 1 | 10 / 1 (0) | 18.50 | 18.00 | 19.00 "
        "| 19.00 | 46.00 | 46.00 | 18.50 (0) | 19.00 (0) |"
    )
    assert len(lines) == 6  # the head, two lines, a blank and the note


def _roofline_row(**values) -> dict:
    """A roofline row of one fp32 task on a 2-core Xeon, with ``values`` over it."""
    return {
        "precision": "fp32",
        "images": 32,
        "threads": 2,
        "command": "python -m benchmarks.roofline",
        "commit": "abc1234",
        "cpu": "Xeon",
        "cores": 2,
        "device": "Xeon",
        "timed_alone": True,
        **values,
    }


def test_the_roofline_table_gives_each_tasks_share_of_both_peaks():
    from tools.tables.speed import roofline

    row = _roofline_row(
        task="greedy",
        gflop=30.2,
        seconds=0.5,
        gflops_per_s=60.4,
        peak_square_gflops_per_s=120.8,
        peak_model_gflops_per_s=80.0,
        share_of_square_peak=0.5,
        share_of_model_peak=0.755,
    )
    table = roofline([row])
    assert "| greedy | fp32 | 30.2 | 0.500 | 60 | 121 / 80 | 50% | 76% |" in table
    assert "1 rows of `results/roofline.json`" in table
    assert roofline([]).startswith("No rows")


def test_the_roofline_table_gives_the_memory_roof_and_torchs_own_layers():
    from tools.tables.speed import roofline

    base = _roofline_row(
        gflop=30.0,
        seconds=0.3,
        gflops_per_s=100.0,
        peak_square_gflops_per_s=300.0,
        peak_model_gflops_per_s=250.0,
        share_of_square_peak=0.333,
        share_of_model_peak=0.4,
        bandwidth_gb_per_s=20.0,
        seconds_unpacked=0.36,
        seconds_torch_score=0.39,
        seconds_tanh=0.33,
    )
    greedy = {
        **base,
        "task": "greedy",
        "gbytes": 2.4,
        "roofline_seconds": 0.12,
        "share_of_roofline": 0.4,
    }
    train = {**base, "task": "train", "gbytes": None, "roofline_seconds": None}
    table = roofline([greedy, train])
    assert (
        "| 2.40 (20) | 0.120 s | 40% | 0.360 s (1.20x) | 0.390 s (1.30x) | 0.330 s (1.10x) "
        "| Xeon |" in table
    )
    assert "| – | – | – | 0.360 s (1.20x) | 0.390 s (1.30x) |" in table  # no memory roof
    # a row from before the C kernel, or from a host without it: a dash
    older = {k: v for k, v in greedy.items() if k != "seconds_torch_score"}
    assert "| 40% | 0.360 s (1.20x) | – | 0.330 s (1.10x) |" in roofline([older])


def test_the_speed_table_takes_a_ratio_only_within_one_run():
    from tools.tables.speed import speed_bench

    def row(impl, seconds, commit, compiled=False):
        return {
            "kind": "bench",
            "size": "coco",
            "device": "cpu",
            "precision": "fp32",
            "task": "greedy",
            "impl": impl,
            "compiled": compiled,
            "median_s": seconds,
            "commit": commit,
            "checks_passed": True,
            "command": "python -m benchmarks.bench",
            "cpu": "Xeon",
            "cores": 2,
            "threads": 2,
            "timed_alone": True,
        }

    rows = [row("reference", 3.0, "aaa"), row("ours", 0.3, "aaa"), row("ours", 0.2, "bbb", True)]
    table = speed_bench(rows)
    assert "| coco | cpu: Xeon | fp32 | greedy | 3 s | 0.3 s | 10.0× | 0.2 s | – |" in table


def test_the_grid_probe_verdict_holds_every_seed_to_the_spread() -> None:
    from tools.tables.grid_probe import grid_probe

    def row(grid: str, seed: int, probe: float, mass: float) -> dict:
        maps = {"probe": (probe, mass), "centre": (0.5, 0.3), "saliency": (0.45, 0.3)}
        maps["even"] = (0.3, 0.2)
        overall = {k: {"pointing": p, "mass": m} for k, (p, m) in maps.items()}
        overall["probe"] |= {"median_peak": 0.1, "mean_entropy": 3.0}
        return {
            "grid": grid,
            "seed": seed,
            "overrides": [],
            "grid_shape": [7, 7],
            "channels": 1280,
            "dev_map": 0.25,
            "grounding": {"overall": {"words": 90, **overall}},
            "precision": "fp32",
            "commit": "abc1234",
        }

    # 0.60, 0.62, 0.64 beat the centre's 0.5 by more than their spread of 0.02
    found = [row("os16", s, 0.60 + 0.02 * s, 0.42) for s in range(3)]
    # 0.51 beats it by less than the spread of 0.06
    level = [row("top7", s, p, 0.36) for s, p in enumerate((0.51, 0.62, 0.57))]
    table = grid_probe(level + found)
    assert table.index("| top7 |") < table.index("| os16 |")
    assert (
        "| os16 | – | categories | 7x7 x 1,280 | 0 | 0.250 | 90 | "
        "0.600 / 0.500 / 0.450 / 0.300 | 1.40 |" in table
    )
    assert (
        "**os16**, 3 seeds: pointing minus the better of the centre prior and the saliency map "
        "+0.100, +0.120, +0.140 (the probe's spread 0.020); mass 1.40, 1.40, 1.40 times the "
        "centre prior's: meets pointing above both by more than the spread, mass ≥ 1.25x "
        "centre's on every seed." in table
    )
    assert "**top7**, 3 seeds" in table and "meets neither on every seed." in table
    # rows scored on the references' words too, with word classes: their own group and verdict
    words = [row("os16", s, 0.52, 0.33) for s in range(3)]
    for r, probe in zip(words, (0.60, 0.61, 0.63)):
        r["classes"] = "words"
        overall = {k: dict(v) for k, v in r["grounding"]["overall"].items() if k != "words"}
        overall["probe"]["pointing"] = probe
        r["grounding"]["references"] = {"overall": {"words": 300, **overall}}
    table = grid_probe(level + found + words)
    assert "| os16 | – | words | 7x7 x 1,280 | 0 |" in table
    assert "| 300, 0.600 / 0.500 / 0.450, 1.10 |" in table
    assert (
        "**os16 (words)**, 3 seeds: pointing minus the better of the centre prior and the "
        "saliency map +0.020, +0.020, +0.020" in table
    )
    assert (
        "On the references' words: pointing minus the better of the centre prior and the "
        "saliency map +0.100, +0.110, +0.130 (the probe's spread 0.015); mass 1.10, 1.10, "
        "1.10 times the centre prior's: meets pointing above both by more than the spread on "
        "every seed; misses mass ≥ 1.25x centre's." in table
    )


def test_the_keep_table_pairs_each_seed_on_one_host_and_asks_two_points_on_every_seed():
    from tools.tables.looks import flickr8k_keep

    def row(variant: str, seed: int, cider: float, device: str = "Intel Xeon") -> dict:
        return {
            "model": "best",
            "variant": variant,
            "seed": seed,
            "beam_size": 3,
            "CIDEr": cider,
            "device": device,
            "precision": "bf16",
            "command": "python -m benchmarks.flickr8k --shared SHARED --out OUT",
            "commit": "abcdef123",
        }

    rows = [
        *(row("os16_current_dsw0_categories_only", s, 0.46) for s in range(3)),
        *(row("os16_none", s, 0.43) for s in range(3)),
        row("os16_current_dsw0_categories_only_sgate", 0, 0.47),
        row("os16_current_dsw0_categories_only_sgate", 1, 0.47),
        row("os16_current_dsw0_categories_only_sgate", 2, 0.47),
        row("os16_none_sgate", 0, 0.44),
        row("os16_none_sgate", 1, 0.46),  # one seed short of two points
        row("os16_none_sgate", 2, 0.44, device="AMD EPYC"),  # another host: not paired
        row("os16_none_sgate", 2, 0.40, device="Intel Xeon"),  # seed 2 on the same host
        row("os16_none_sgate", 9, 0.10),  # no attention run of this seed
    ]
    lines = flickr8k_keep(rows).splitlines()
    gated = next(line for line in lines if "| os16_current_dsw0_categories_only_sgate |" in line)
    plain = next(line for line in lines if "| os16_current_dsw0_categories_only |" in line)
    assert "| +3.00 / +3.00 / +3.00 | +3.00 | yes |" in plain
    assert "| 0, 1, 2 | 47.00 / 47.00 / 47.00 against 44.00 / 46.00 / 40.00 |" in gated
    assert "| +3.00 / +1.00 / +7.00 | +3.67 | no |" in gated
    assert not any("best_none" in line for line in lines)  # a pair without rows is left out


def test_the_looks_recipe_is_held_to_best_s_fifteen_minutes_when_timed_alone():
    from tools.tables.flickr8k_time import flickr8k_targets

    def row(variant: str, seconds: float, alone: bool) -> dict:
        return {
            "model": "best",
            "variant": variant,
            "seed": 0,
            "beam_size": 3,
            "CIDEr": 0.47,
            "device": "Intel Xeon",
            "precision": "bf16",
            "timed_alone": alone,
            "seconds": {"extract": 50.0, "recipe": seconds},
            "command": "python -m benchmarks.flickr8k --shared SHARED --out OUT",
            "commit": "abcdef123",
        }

    table = flickr8k_targets(
        [
            row("os16_current_dsw0_categories_only_sgate_e15_alone", 676.0, True),
            row("os16_current_dsw0_categories_only_sgate_alone", 975.0, True),
            row("os16_current_dsw0_categories_only_sgate_e15", 1857.0, False),  # beside others
        ]
    )
    assert "| looks: the whole recipe" in table and "| 676 s | 676 s (0) | yes |" in table
    assert "| looks with twenty epochs: the whole recipe" in table
    assert "| 975 s | 975 s (0) | no |" in table and "1857" not in table
