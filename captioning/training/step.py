"""One training step and one epoch of them: the objective's loss of a batch, back-propagated
(scaled in fp16), clipped and applied, a non-finite loss or gradient skipped or stopped on;
the epoch's loop over the loader with its logging."""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from torch.utils.data import DataLoader

from captioning.distributed import (
    any_rank,
    mean_over_ranks,
)
from captioning.errors import CaptioningError
from captioning.objectives import Batch, LossTerms
from captioning.progress import progress_bar
from captioning.runtime import batches
from captioning.training.events import EventLog
from captioning.training.run_state import Run

logger = logging.getLogger("captioning")


class TrainingError(CaptioningError):
    """Training cannot go on (for example a non-finite loss)."""


@dataclass
class StepResult:
    """What one optimisation step reports: its loss terms and the gradient norm before
    clipping."""

    terms: LossTerms
    grad_norm: float


def train_step(
    run: Run, module: nn.Module, batch: dict[str, torch.Tensor], device: torch.device
) -> StepResult | None:
    """One optimisation step on ``batch``: forward, loss, backward, clipping, optimiser and
    schedule. ``module`` is what is called, ``run.model`` or its DDP wrapper.

    Returns None when the loss was not finite on some process and the step was skipped
    (``train.stop_on_nonfinite: false``); raises :class:`TrainingError` otherwise.
    """
    cfg = run.cfg.train
    images = batch["images"].to(device, non_blocking=True) if "images" in batch else None
    grid = batch["grid"].to(device, non_blocking=True) if "grid" in batch else None
    tokens = batch["tokens"].to(device, non_blocking=True)  # (B, T)
    terms = run.objective.loss(
        module, Batch(tokens, images, grid, run.progress.step, batch.get("indices"))
    )
    run.optimizer.zero_grad(set_to_none=True)
    if any_rank(run.world, not bool(torch.isfinite(terms.total)), device):
        return _skip_or_stop(run, "loss")
    scaler = run.scaler
    if scaler is not None:
        scaler.scale(terms.total).backward()
        scaler.unscale_(run.optimizer)
    else:
        terms.total.backward()
    params = [p for group in run.optimizer.param_groups for p in group["params"]]
    grad_norm = torch.nn.utils.clip_grad_norm_(
        params, cfg.grad_clip if cfg.grad_clip > 0 else float("inf")
    )
    if scaler is None and not math.isfinite(float(grad_norm)):
        # The step would make the weights NaN (the fp16 scaler skips such steps itself).
        # DDP has averaged the gradients, so every process sees the same norm.
        return _skip_or_stop(run, "gradient")
    if scaler is not None:
        scaler.step(run.optimizer)
        scaler.update()
    else:
        run.optimizer.step()
    run.objective.commit()
    run.schedule.after_step()
    run.progress.step += 1
    return StepResult(terms, float(grad_norm))


def _skip_or_stop(run: Run, what: str) -> None:
    """A step whose ``what`` (loss or gradient) is not finite: forget it, then stop the run
    (:class:`TrainingError`) or, with ``train.stop_on_nonfinite: false``, skip the batch."""
    message = (
        f"non-finite {what} at step {run.progress.step + 1} (epoch {run.progress.epoch + 1}); "
        f"the last good checkpoint is kept; try a lower train.lr or train.precision=fp32"
    )
    run.objective.discard()
    if run.cfg.train.stop_on_nonfinite:
        raise TrainingError(message)
    logger.warning("skipping batch: %s", message)


def train_one_epoch(
    run: Run,
    module: nn.Module,
    loader: DataLoader,
    device: torch.device,
    writer: EventLog | None = None,
    on_step: Callable[[Run], None] | None = None,
) -> dict[str, float]:
    """One pass over the training data; returns the epoch's mean loss terms (averaged over
    the processes when there are several). ``module`` is ``run.model`` or its DDP wrapper,
    which averages the gradients over the processes during ``backward``; ``on_step`` sees
    the run before each step (a study's probe of the weights as training goes)."""
    module.train()
    totals: dict[str, float] = {}
    counts: dict[str, int] = {}
    # No summary line: the epoch's own line (``_log_epoch``) carries the same figures.
    bar = progress_bar(
        batches(loader),
        total=len(loader),
        desc=f"epoch {run.progress.epoch + 1}",
        enabled=not run.cfg.train.quiet and run.world.is_main,
        summary=False,
        leave=False,
        ncols=100,
    )
    for batch in bar:
        if batch is None:
            continue
        if on_step is not None:
            on_step(run)
        result = train_step(run, module, batch, device)
        if result is None:
            continue
        for key, value in result.terms.scalars().items():
            totals[key] = totals.get(key, 0.0) + value
            counts[key] = counts.get(key, 0) + 1
        bar.set_postfix(
            loss=f"{totals['loss'] / counts['loss']:.3f}",
            nll=f"{float(result.terms.nll_per_token):.3f}",
        )
        if writer is not None and run.progress.step % run.cfg.train.log_every == 0:
            _log_step(writer, run, result)
    means = {key: totals[key] / counts[key] for key in totals}
    means.setdefault("loss", math.nan)
    means.setdefault("nll_per_token", math.nan)
    return mean_over_ranks(run.world, means, device)


def _log_step(writer: EventLog, run: Run, result: StepResult) -> None:
    """TensorBoard scalars of one step (rank 0 only)."""
    step = run.progress.step
    names = {
        "nll_per_token": "nll_per_token",
        "penalty": "attention_penalty",
        "entropy": "attention_entropy",
    }
    values = {
        f"train/{names.get(key, key)}": value
        for key, value in {**result.terms.scalars(), **run.objective.scalars()}.items()
    }
    values["train/grad_norm"] = result.grad_norm
    for group in run.optimizer.param_groups:
        values[f"lr/{group.get('name', 'group')}"] = group["lr"]
    writer.scalars(values, step)
