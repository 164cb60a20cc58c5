"""lab.runner, the runner every study is a spec of: one seeds parser, one row merge that
keeps rows of other settings, rows that name no machine's path, and threads shared out
among parallel jobs."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

import tools.colour_trace
from lab import options, provenance, runner
from lab.results import ResultsError, settings_of, write_results
from tests.conftest import ROOT, TINY_SETTINGS


def test_the_seeds_parser_reads_lists_and_ranges_and_refuses_the_rest() -> None:
    assert options.parse_seeds("0,1,2") == [0, 1, 2]
    assert options.parse_seeds("0-9") == list(range(10))
    assert options.parse_seeds("3") == [3]
    assert options.parse_seeds("5, 2-3,2") == [2, 3, 5]
    for bad in ("", "x", "3-1", "-1", "1,,a", "0-"):
        with pytest.raises(options.StudyError, match="^--seeds wants seeds >= 0") as caught:
            options.parse_seeds(bad)
        assert "\n" not in str(caught.value)


def _row(seed: int, exact: float, *overrides: str, **fields) -> dict:
    return {
        "variant": "v",
        "seed": seed,
        "config": "configs/shapes_soft.yaml",
        "overrides": list(overrides),
        "precision": "fp32",
        "epochs": 2,
        "exact": exact,
        **fields,
    }


def test_the_merge_refuses_a_row_of_other_settings_unless_asked(tmp_path: Path) -> None:
    path, key = tmp_path / "rows.json", lambda r: (r["variant"], r["seed"])
    write_results(path, [_row(0, 0.5, "model.heads=2"), _row(1, 0.6, "model.heads=2")], key)
    before = path.read_bytes()
    for other in (
        _row(0, 0.9, "model.heads=4"),
        _row(0, 0.9, "model.heads=2", precision="bf16"),
        _row(0, 0.9, "model.heads=2", epochs=3),
    ):
        with pytest.raises(ResultsError, match=r"made with other .*--replace") as caught:
            write_results(path, [other], key)
        assert "\n" not in str(caught.value)
        assert path.read_bytes() == before  # untouched
    # the same settings (threads, paths and the seed are not settings): replaced in place
    same = _row(0, 0.7, "model.heads=2", "train.threads=1", "data.root=/x", threads=1)
    assert [r["exact"] for r in write_results(path, [same], key)] == [0.6, 0.7]
    # other settings with --replace; a row without a settings field is not compared on it
    assert write_results(path, [_row(0, 0.9, "model.heads=4")], key, replace=True)[-1]["exact"]
    bare = {"variant": "v", "seed": 1, "exact": 0.1}
    assert write_results(path, [bare], key)[-1] == bare
    assert settings_of(same)["overrides"] == ["model.heads=2"]
    assert not list(tmp_path.glob(".*.tmp"))  # written atomically: no leftovers


def test_a_command_names_no_machine_path_and_is_in_module_form(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(ROOT)  # the lab runs from the checkout
    out, data = tmp_path / "out", tmp_path / "data"
    argv = [
        "--out",
        str(out),
        "--data-root",
        str(data),
        "--set",
        f"data.root={data / 'x'}",
        "--config",
        str(ROOT / "configs" / "shapes_soft.yaml"),
        "--results",
        str(tmp_path / "r.json"),
        "--adopt",
        f"2={tmp_path / 'old' / 'run'}",
        f"--init={provenance.SHARED / 'weights' / 'w.pt'}",
        "--seeds",
        "0-2",
        "--shared",
        os.path.relpath(provenance.SHARED, ROOT),  # ../shared: climbs out of the checkout
    ]
    command = provenance.module_command("tools.seed_study", argv, {"OUT": out, "DATA": data})
    assert command == (
        "python -m tools.seed_study --out OUT --data-root DATA --set data.root=DATA/x "
        "--config configs/shapes_soft.yaml --results OUT/r.json --adopt 2=DATA/run "
        "--init=SHARED/weights/w.pt --seeds 0-2 --shared SHARED"
    )


def test_parallel_jobs_share_the_cores_and_are_not_timed_alone(monkeypatch, tmp_path) -> None:
    cores = provenance.usable_cores()
    assert options.threads_for(2, None) == max(1, cores // 2)
    assert (
        options.threads_for(3, None, cores=8) == 2 and options.threads_for(16, None, cores=4) == 1
    )
    assert options.threads_for(1, None) is None and options.threads_for(1, 3) == 3
    with pytest.raises(options.StudyError, match="--threads 2 with --jobs 2 asks 4 threads of 2"):
        options.threads_for(2, 2, cores=2)
    specs = [
        runner.RunSpec("soft", "configs/test_tiny.yaml", seed=s, folder=tmp_path / str(s))
        for s in (0, 1)
    ]
    planned = runner.plan(specs, options.threads_for(2, None))
    for spec in planned:
        assert spec.load().train.threads == max(1, cores // 2)
        assert runner.run_fields(runner.Outcome(spec, None))["threads"] == max(1, cores // 2)
    recorder = runner.Recorder("tools.x", [], tmp_path, lambda r: r["seed"], jobs=2)
    assert recorder.stamp["timed_alone"] is False and recorder.stamp["jobs"] == 2
    busy = runner.Recorder("tools.x", [], tmp_path, lambda r: r["seed"], timed_alone=False)
    assert busy.stamp["timed_alone"] is False


def _results_folder() -> dict[str, float]:
    return {p.name: p.stat().st_mtime_ns for p in (ROOT / "results").iterdir()}


def test_without_results_a_study_writes_into_its_out_folder_only(tiny_shapes, tmp_path) -> None:
    before = _results_folder()
    sets = [w for s in TINY_SETTINGS for w in ("--set", s)]
    out = tmp_path / "trace"
    argv = [
        "--out",
        str(out),
        "--variant",
        "tiny",
        "--seeds",
        "0",
        "--steps",
        "0,1",
        "--data-root",
        str(tiny_shapes),
        "--threads",
        "1",
        *sets,
    ]
    assert tools.colour_trace.main(argv) == 0
    assert _results_folder() == before
    rows = json.loads((out / "rows.json").read_text())
    assert [(r["variant"], r["seed"], r["step"]) for r in rows] == [("tiny", 0, 0), ("tiny", 0, 1)]
    row = rows[0]
    assert row["command"].startswith("python -m tools.colour_trace --out OUT --variant tiny ")
    assert "--data-root DATA " in row["command"]
    assert not any(w.startswith(("/", "~")) or "=/" in w for w in row["command"].split())
    assert str(tmp_path) not in json.dumps(rows)
    # the precision resolved for this machine (auto: bf16 where the CPU computes it natively)
    assert row["precision"] in ("fp32", "bf16") and row["threads"] == 1 and row["device"]
    assert row["timed_alone"] is True and row["commit"] and row["cores"] >= 1


def test_a_users_error_in_a_lab_main_is_one_line_and_exit_2(capsys) -> None:
    @options.errors_in_one_line
    def main(argv=None) -> int:
        if argv == ["bad"]:
            raise ResultsError("results/x.json: a row of other settings; pass --replace")
        if argv == ["bug"]:
            raise ValueError("a bug, not a user's error")
        return 0

    assert main([]) == 0
    assert main(["bad"]) == 2
    assert capsys.readouterr().err == (
        "error: results/x.json: a row of other settings; pass --replace\n"
    )
    with pytest.raises(ValueError, match="a bug"):  # only a user's error is caught
        main(["bug"])


def test_a_lab_command_line_opens_with_its_modules_first_paragraph() -> None:
    parser = options.parser_for("tools.x", "Rows of x.\n\n    python -m tools.x --out OUT\n")
    assert parser.prog == "python -m tools.x"
    assert parser.description == "Rows of x."
