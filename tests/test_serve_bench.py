"""``python -m benchmarks.serve_load``: its rows and summary, and their table in
``python -m tools.tables``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.serve_load import counts, speedups
from tests.conftest import load_tool


def _row(max_batch: int, clients: int, rate: float) -> dict:
    return {
        "clients": clients,
        "max_batch": max_batch,
        "requests": 128,
        "refused": 0,
        "requests_per_s": rate,
        "p50_ms": 80.4,
        "p95_ms": 90.6,
        "p99_ms": 99.0,
        "mean_ms": 81.0,
        "command": "python -m benchmarks.serve_load --checkpoint C",
        "commit": "abcdef123",
        "beam_size": 3,
        "images": 293,
        "cores": 2,
        "cpu": "cpu",
    }


def test_the_summary_compares_batches_with_one_at_a_time():
    rows = [_row(1, 1, 10.0), _row(1, 32, 20.0), _row(16, 1, 9.0), _row(16, 32, 70.0)]
    assert speedups(rows) == [
        "1 clients: 0.90x the requests/s with --max-batch 16 as with 1",
        "32 clients: 3.50x the requests/s with --max-batch 16 as with 1",
    ]
    assert speedups(rows[2:]) == []  # nothing to compare with
    assert counts("1,8,32,128", "--clients") == [1, 8, 32, 128]
    with pytest.raises(SystemExit, match="--clients must be comma-separated whole numbers"):
        counts("1,x", "--clients")
    with pytest.raises(SystemExit, match="every --max-batch value must be at least 1"):
        counts("0,16", "--max-batch")


def test_the_table_shows_the_batch_limit_when_rows_have_one():
    tables = load_tool("tables")
    table = tables.serve_latency([_row(16, 32, 70.0), _row(1, 32, 20.0)])
    assert table.splitlines()[:4] == [
        "| max batch | clients | requests | requests/s | p50 (ms) | p95 (ms) | p99 (ms) "
        "| refused |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
        "| 1 | 32 | 128 | 20.00 | 80 | 91 | 99 | 0 |",
        "| 16 | 32 | 128 | 70.00 | 80 | 91 | 99 | 0 |",
    ]
    old = {k: v for k, v in _row(1, 1, 12.4).items() if k not in ("max_batch", "refused")}
    assert tables.serve_latency([old]).splitlines()[2] == "| 1 | 128 | 12.40 | 80 | 91 | 99 |"


def test_rows_of_two_models_share_the_file_and_the_table(tmp_path: Path):
    from benchmarks.serve_load import merge

    def named(name: str, max_batch: int, clients: int, rate: float) -> dict:
        row = _row(max_batch, clients, rate)
        row.update(
            name=name,
            model_encode_ms_batch1=23.0,
            model_encode_ms_batch16=22.6,
            model_caption_ms_batch1=41.0,
            model_caption_ms_batch16=30.2,
        )
        return row

    out = tmp_path / "rows.json"
    out.write_text(json.dumps([named("shapes", 1, 32, 40.0), named("photos", 1, 32, 9.0)]))
    rows = merge(out, [named("photos", 1, 32, 10.0), named("photos", 16, 32, 15.0)])
    assert json.loads(out.read_text()) == rows
    assert [(r["name"], r["requests_per_s"]) for r in rows] == [
        ("shapes", 40.0),  # another model's row stays
        ("photos", 10.0),  # this model's rows are replaced
        ("photos", 15.0),
    ]
    tables = load_tool("tables")
    table = tables.serve_latency(rows)
    assert "| photos | 16 | 32 | 128 | 15.00 |" in table
    assert "batches against one image at a time: 1.50x at 32 clients" in table
    assert "the encoder alone 23.0 / 22.6 at batch 1 / 16 ms per image" in table
    assert "encoder and beam search 41.0 / 30.2 at batch 1 / 16" in table
    assert "so at most 44 requests/s whatever the server does" in table
    rows[-1]["precision"] = rows[-2]["precision"] = "bf16"  # the photos rows
    assert "the encoder alone in bf16 23.0 / 22.6 at batch 1 / 16" in tables.serve_latency(rows)
    for row in rows[-2:]:  # with the upload's and the answer's own cost
        row.update(prepare_ms=1.5, answer_ms=1.0)
    table = tables.serve_latency(rows)
    assert "preparing an upload 1.5 ms and its answer's JSON 1.0 ms" in table
    assert "so at most 40 requests/s whatever the server does" in table  # 1000 / 25.1
    assert "at most 31 with the whole captioning at its cheapest batch size (16)" in table


def test_rows_of_other_settings_are_replaced_only_when_asked(tmp_path: Path):
    from benchmarks.serve_load import merge
    from lab.results import ResultsError

    out = tmp_path / "rows.json"
    committed = [{**_row(1, 32, 40.0), "name": "photos", "precision": "bf16", "threads": 2}]
    out.write_text(json.dumps(committed))
    same = [{**_row(1, 32, 41.0), "name": "photos", "precision": "bf16", "threads": 2}]
    assert merge(out, same) == same
    fp32 = [{**same[0], "precision": "fp32"}]
    with pytest.raises(ResultsError, match="row photos made with other precision"):
        merge(out, fp32)
    assert json.loads(out.read_text()) == same  # untouched
    assert merge(out, fp32, replace=True) == fp32
    shapes = [{**fp32[0], "name": "shapes"}]
    assert merge(out, shapes) == fp32 + shapes  # another model's rows stay


def test_ceilings_add_the_upload_and_the_answer_to_the_model():
    from benchmarks.serve_load import ceilings

    cost = {
        "prepare_ms": 1.5,
        "answer_ms": 1.0,
        "model_encode_ms_best": 2.5,
        "model_caption_ms_batch16": 7.5,
    }
    assert ceilings(cost, 16, 40.0) == {"batching_ceiling": 5.0, "model_ceiling": 2.5}
    cost["model_caption_ms_best"] = 2.5  # a larger batch was cheaper per image
    assert ceilings(cost, 16, 40.0)["model_ceiling"] == 5.0
    assert ceilings({"prepare_ms": 5.0, "model_encode_ms_best": 5.0}, 16, 10.0) == {
        "batching_ceiling": 10.0
    }


def test_model_cost_times_every_part_and_the_ceilings_follow(tiny_checkpoint, tiny_shapes):
    import captioning
    from benchmarks.serve_load import ceilings, model_cost
    from captioning.runtime import in_passing_thread

    model = in_passing_thread(captioning.load, tiny_checkpoint, device="cpu")
    files = sorted((tiny_shapes / "images").rglob("*.png"))[:6]
    cost = model_cost(model, files, largest=2, beam_size=2, repeats=2)
    assert set(cost) == {
        "prepare_ms",
        "answer_ms",
        "model_encode_ms_best",
        "model_caption_ms_best",
        *(f"model_encode_ms_batch{b}" for b in (1, 2, 4, 8)),
        *(f"model_caption_ms_batch{b}" for b in (1, 2, 4, 8)),
    }
    assert all(value >= 0 for value in cost.values())
    assert cost["model_caption_ms_best"] == min(
        cost[f"model_caption_ms_batch{b}"] for b in (2, 4, 8)
    )
    assert set(ceilings(cost, 2, rate=10.0)) == {"batching_ceiling", "model_ceiling"}
