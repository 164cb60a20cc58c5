"""The headline results, reproduced from scratch (slow: full shapes data, full schedules)."""

import pytest

from captioning.config import load_config
from captioning.data.shapes import generate_shapes
from captioning.evaluate import evaluate_checkpoint
from captioning.training.train import fit

from .test_train import CONFIG

CONFIGS = CONFIG.replace("test_tiny.yaml", "")


@pytest.fixture(scope="module")
def soft_metrics(tmp_path_factory):
    root = tmp_path_factory.mktemp("shapes_full")
    generate_shapes(root, num_train=8000, num_val=500, num_test=500, seed=0)
    run = tmp_path_factory.mktemp("soft")
    cfg = load_config(CONFIGS + "shapes_soft.yaml", [f"data.root={root}", "train.quiet=true"])
    fit(cfg, out_dir=run)
    return evaluate_checkpoint(run / "best.pt", split="test", progress=False)


@pytest.mark.slow
def test_shapes_soft_reaches_its_targets(soft_metrics):
    assert soft_metrics["exact_match"] >= 0.95
    assert soft_metrics["exact_match_by_objects"]["3"] >= 0.90
    grounding = soft_metrics["grounding_by_word_type"]
    for word_type in ("color", "size", "category"):  # category: the shape words
        assert grounding[f"pointing_game/{word_type}"] >= 0.90, word_type
