"""The Flickr8k study's models and where their runs live (:mod:`benchmarks.flickr8k`): each
model's config file and overrides, the first stage a second stage starts from, the grids its
recipe extracts, and the run folders ``OUT/runs/KIND[/VARIANT]/MODEL-seedS``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

CONFIGS = {
    "none": ("configs/flickr8k_mobilenet.yaml", ["model.attention=none"]),
    "soft": ("configs/flickr8k_mobilenet.yaml", []),
    "best": ("configs/flickr8k_best.yaml", []),
    "hard": ("configs/flickr8k_hard.yaml", []),
    "hard_exact": ("configs/flickr8k_hard_exact.yaml", []),
    "scst": ("configs/flickr8k_scst.yaml", []),
    "finetune": ("configs/flickr8k_finetune.yaml", []),
    "best_scst": ("configs/flickr8k_best_scst.yaml", []),
    "best_finetune": ("configs/flickr8k_best_finetune.yaml", []),
    "best_exact": ("configs/flickr8k_best_exact.yaml", []),
    "best_hard": ("configs/flickr8k_best_hard.yaml", []),
}
MODELS = ("nn", *CONFIGS)
# a model trained from another's best.pt of the same seed
FIRST_STAGE = {
    "scst": "soft",
    "finetune": "soft",
    "best_scst": "best",
    "best_finetune": "best",
    "best_exact": "best",
    "best_hard": "best",
}
BEAMS = {"soft": (1, 3, 5), "best": (1, 3, 5)}  # other models: (3,)
# the model whose cached grids a model's recipe extracts: best's own (7 x 7), the others the
# recipe's (10 x 10); a fine-tuning stage reads photos, its recipe extracts its first stage's
GRID_OF = {
    "best": "best",
    "best_scst": "best",
    "best_finetune": "best",
    "best_exact": "best",
    "best_hard": "best",
}
RECIPE = "recipe"
OWN = ("train.seed", "data.root", "model.weights")  # the study sets these itself


def extract_stage(model: str) -> str:
    """The name under which the stages record the extraction of ``model``'s grids: the
    recipe's ``extract`` (every model extends its config); best's, whose grid is its own,
    ``extract flickr8k_best``, for best and the stages after it."""
    grid = grid_of(model)
    return "extract" if grid == "soft" else f"extract {Path(CONFIGS[grid][0]).stem}"


def grid_of(model: str) -> str:
    """The model whose config's grids ``model``'s recipe caches (:data:`GRID_OF`)."""
    return GRID_OF.get(model, "soft")


# --------------------------------------------------------------------------- run folders


KINDS = ("cpu", "gpu")  # run folders by the device that trained them


def device_kind() -> str:
    return "gpu" if torch.cuda.is_available() else "cpu"


def run_dir(out: Path, variant: str, model: str, seed: int, kind: str | None = None) -> Path:
    """``OUT/runs/KIND[/VARIANT]/MODEL-seedS``: runs of one device kind side by side."""
    runs = out / "runs" / (kind or device_kind())
    return (runs if variant == RECIPE else runs / variant) / f"{model}-seed{seed}"


def job_settings(out: Path, model: str, seed: int, overrides: list[str]) -> list[str]:
    """The overrides of one run: the data and weights in ``OUT``, the model's own, the
    study's ``--set`` lines and the seed."""
    data = [f"data.root={out / 'data'}", f"model.weights={out / 'weights' / 'mobilenet_v2.pt'}"]
    return [*data, *CONFIGS[model][1], *overrides, f"train.seed={seed}"]


def first_stage_folder(folder: Path, job: dict[str, Any]) -> Path | None:
    """The run folder of the first stage the second stage in ``folder`` (its ``job.json``
    read into ``job``) started from: of the variant it names, by default its own; None for a
    first stage."""
    first = FIRST_STAGE.get(job["model"])
    if first is None:
        return None
    runs = folder.parent if job["variant"] == RECIPE else folder.parent.parent  # OUT/runs/KIND
    variant = job.get("first_stage_variant", job["variant"])
    return run_dir(runs.parent.parent, variant, first, job["seed"], kind=runs.name)
