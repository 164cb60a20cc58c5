"""Data-parallel training under torchrun (gloo on CPU)."""

import os
import re
import socket
import subprocess
import sys

import pytest
import torch

from captioning.checkpoint import load_checkpoint
from captioning.config import load_config
from captioning.data.shapes import generate_shapes
from captioning.training.train import fit

CONFIG = os.path.join(os.path.dirname(__file__), "..", "configs", "test_tiny.yaml")
# Dropout off and a frozen encoder: with dropout each process draws its own masks, and a
# training BatchNorm sees per-process batch statistics (SyncBatchNorm needs CUDA), so
# neither could match one process exactly. fp32 keeps rounding small.
SETTINGS = ["model.dropout=0", "model.fine_tune=none", "train.epochs=2", "train.precision=fp32"]


@pytest.fixture(scope="module")
def shapes(tmp_path_factory):
    root = tmp_path_factory.mktemp("shapes")
    # 32 images: 4 global batches of 8, split evenly over 2 processes.
    generate_shapes(root, num_train=32, num_val=6, num_test=6, seed=0, image_size=48)
    return root


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def torchrun(nproc: int, *args: str) -> subprocess.CompletedProcess:
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc_per_node={nproc}",
        f"--master_port={free_port()}",
        "-m",
        "captioning",
        *args,
    ]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    return result


def overrides(shapes, *extra):
    return [arg for item in (f"data.root={shapes}", *SETTINGS, *extra) for arg in ("--set", item)]


# Hard attention with every estimator that samples: the cells of every caption come from one
# stream for the global batch, and the baseline from rewards summed over the processes.
VARIANTS = {
    "soft": [],
    "hard": ["model.attention=hard"],
    "hard-loo": ["model.attention=hard", "train.hard_estimator=reinforce_loo"],
    "hard-vimco": [
        "model.attention=hard",
        "train.hard_estimator=vimco",
        "train.semi_sampling=sample",
    ],
    "hard-gumbel": ["model.attention=hard", "train.hard_estimator=gumbel"],
}
# The attention family: each has parameters of its own (the centre's MLP, the values, one
# score per head, a logit per cell, the grid's Transformer layers) that must be averaged too.
# About 25 s each on 2 cores, so they run with the slow tests.
FAMILY = {
    "local": ["model.attention=local"],
    "key-value": ["model.values=projected", "model.value_dim=8"],
    "multi-head": ["model.heads=2"],
    "location": ["model.score=location"],
    "grid": ["model.grid_layers=1"],
}
VARIANTS.update(FAMILY)


# Each run starts torchrun twice (8 to 20 s on 2 cores): they run with the slow tests.
@pytest.mark.slow
@pytest.mark.parametrize("variant", VARIANTS)
def test_two_processes_match_one_with_the_global_batch(shapes, tmp_path, variant):
    extra = VARIANTS[variant]
    result = torchrun(
        2,
        "train",
        "--config",
        CONFIG,
        "--out",
        str(tmp_path / "two"),
        *overrides(shapes, "train.batch_size=4", *extra),
    )
    assert "data-parallel training: 2 processes (gloo), batch 4 per process" in result.stderr
    # one process speaks: each epoch is logged once
    assert result.stderr.count("epoch 1/2") == 1
    start = {}  # the weights after epoch 1 of 2 (4 steps of 8 of the 32 images)

    def keep_epoch_1(run):
        if run.progress.step == 4:
            start["model"] = {k: v.clone() for k, v in run.model.state_dict().items()}

    fit(
        load_config(CONFIG, [f"data.root={shapes}", *SETTINGS, "train.batch_size=8", *extra]),
        out_dir=tmp_path / "one",
        on_step=keep_epoch_1,
    )
    one = load_checkpoint(tmp_path / "one" / "last.pt")
    two = load_checkpoint(tmp_path / "two" / "last.pt")
    assert one["step"] == two["step"] == 8
    # The summed losses of each epoch agree to float32 rounding.
    for a, b in zip(one["history"], two["history"]):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5)
    # Parameters: the two runs differ only by the order of float32 sums (each process sums
    # its half of the batch, then the halves are averaged), which Adam's normalised steps
    # carry into the weights. Bound the difference by 0.1% of how far each tensor moved in
    # the second epoch; without gradient averaging each process would follow its own half
    # of the data and miss this by two orders of magnitude.
    for name, weights in one["model"].items():
        if re.search(r"attention\.(score|heads\.\d+)\.out\.bias$", name):
            # Adds the same amount to every cell's score (of a head): softmax ignores it,
            # its true gradient is zero and Adam turns the rounding noise into full-size
            # steps.
            continue
        if not weights.is_floating_point():
            continue
        theirs, before = two["model"][name], start["model"][name]
        if name.endswith("self_attn.in_proj_bias"):
            # Its middle third is the keys' bias, which adds the same amount to every key's
            # score for a query: the same case as above. The queries' and values' count.
            third = len(weights) // 3
            keep = torch.cat([torch.arange(third), torch.arange(2 * third, 3 * third)])
            weights, theirs, before = weights[keep], theirs[keep], before[keep]
        moved = (weights - before).norm()
        gap = (weights - theirs).norm()
        assert gap <= 1e-3 * moved + 1e-7, (name, float(gap), float(moved))
    # rank 0 writes every process's RNG state, so a resumed run continues exactly
    assert len(two["rng"]) == 2 and len(one["rng"]) == 1
    # the objective's state (the baseline: a mean over every sampled caption of each step)
    if variant.startswith("hard"):
        baseline = one["objective"]["baseline"]
        assert baseline["value"] == pytest.approx(two["objective"]["baseline"]["value"], rel=1e-5)
    if variant == "hard":
        assert baseline["initialized"] and baseline["value"] < 0  # rewards are log-likelihoods
    if variant == "hard-gumbel":
        assert one["objective"]["temperature"] == two["objective"]["temperature"] < 1.0


# Self-critical training: each process samples and rewards its own images (no strings are
# gathered); the samples come from each process's RNG, which the checkpoint restores.
RESUMED = {**VARIANTS, "scst": ["train.objective=scst", "train.scst_samples=2"]}


# about 20 s each on 2 cores: with the slow tests
@pytest.mark.parametrize(
    "variant", [pytest.param(v, marks=pytest.mark.slow) for v in ("soft", "hard", "scst")]
)
def test_resume_under_torchrun_is_exact(shapes, tmp_path, variant):
    args = [
        "train",
        "--config",
        CONFIG,
        *overrides(shapes, "train.batch_size=4", *RESUMED[variant]),
    ]
    torchrun(2, *args, "--out", str(tmp_path / "straight"))
    torchrun(2, *args, "--out", str(tmp_path / "half"), "--set", "train.epochs=1")
    torchrun(
        2, *args, "--out", str(tmp_path / "half"), "--resume", str(tmp_path / "half" / "last.pt")
    )
    straight = load_checkpoint(tmp_path / "straight" / "last.pt")["model"]
    resumed = load_checkpoint(tmp_path / "half" / "last.pt")["model"]
    for name, weights in straight.items():
        assert torch.equal(weights, resumed[name]), name
    assert (
        load_checkpoint(tmp_path / "straight" / "last.pt")["objective"]
        == load_checkpoint(tmp_path / "half" / "last.pt")["objective"]
    )
