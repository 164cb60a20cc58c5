"""The headline results, reproduced from scratch (slow: full shapes data, full schedules)."""

import pytest

from captioning.config import load_config
from captioning.data.shapes import generate_shapes
from captioning.evaluate import evaluate_checkpoint
from captioning.train import fit

from .test_train import CONFIG

CONFIGS = CONFIG.replace("test_tiny.yaml", "")


@pytest.fixture(scope="module")
def shapes(tmp_path_factory):
    root = tmp_path_factory.mktemp("shapes_full")
    generate_shapes(root, num_train=8000, num_val=500, num_test=500, seed=0)
    return root


@pytest.mark.slow
def test_shapes_soft_reaches_its_targets(shapes, tmp_path):
    cfg = load_config(CONFIGS + "shapes_soft.yaml", [f"data.root={shapes}", "train.quiet=true"])
    fit(cfg, out_dir=tmp_path / "soft")
    metrics = evaluate_checkpoint(tmp_path / "soft" / "best.pt", split="test", progress=False)
    assert metrics["exact_match"] >= 0.95
    assert metrics["exact_match_by_objects"]["3"] >= 0.90
    by_type = metrics["grounding_by_word_type"]
    assert by_type["pointing_game/color"] >= 0.90
    assert by_type["pointing_game/category"] >= 0.90
