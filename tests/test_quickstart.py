"""The quickstart (what `make demo` runs), on a tiny config: every step runs and writes."""

import json
from pathlib import Path

import pytest

from captioning.cli import main
from captioning.metrics.captions import java_available

TINY = str(Path(__file__).resolve().parent.parent / "configs" / "test_tiny.yaml")


@pytest.mark.parametrize(
    "meteor",
    [False, pytest.param(True, marks=pytest.mark.slow)],  # METEOR: a Java run
)
def test_quickstart_trains_evaluates_and_draws(tiny_shapes, tmp_path, capsys, meteor):
    if meteor and not java_available():
        pytest.skip("METEOR needs java")
    out = tmp_path / "quick"
    args = [
        "quickstart",
        "--out",
        str(out),
        "--data-root",
        str(tiny_shapes),
        "--config",
        TINY,
        "--set",
        "train.epochs=1",
    ]
    assert main([*args, "--meteor"] if meteor else args) == 0
    summary = json.loads((out / "quickstart.json").read_text())
    assert Path(summary["checkpoint"]).is_file()
    assert summary["total_seconds"] >= summary["train_seconds"] > 0
    assert len(summary["examples"]) == 3
    for example in summary["examples"]:
        assert example["attention"] is None or Path(example["attention"]).is_file()
    metrics = json.loads((out / "eval" / "metrics.json").read_text())
    assert metrics["num_images"] == 6
    printed = capsys.readouterr().out
    # METEOR only when asked for; then it is a number, not "missing"
    assert ("METEOR" in printed) == meteor
    assert (metrics["METEOR"] is not None) == meteor


def test_the_quickstart_trains_the_shipped_soft_config_as_it_is(tiny_shapes, tmp_path, monkeypatch):
    """The seed study's ten seeds of configs/shapes_soft.yaml speak for the quickstart only
    while it changes nothing but where the data lives."""
    import captioning.quickstart as quick
    from captioning.config import load_config

    seen = {}

    def stop(cfg, *args):
        seen["cfg"] = cfg
        raise KeyboardInterrupt  # no training: the config is all this test reads

    monkeypatch.setattr(quick, "_run", stop)
    with pytest.raises(KeyboardInterrupt):
        quick.quickstart(out_dir=tmp_path / "quick", data_root=tiny_shapes)
    shipped = Path(__file__).resolve().parent.parent / "configs" / "shapes_soft.yaml"
    assert seen["cfg"] == load_config(shipped, [f"data.root={tiny_shapes}"])
