"""The optimiser and the learning-rate schedule of a training run."""

from __future__ import annotations

import math
from typing import Any

import torch

from captioning.config import TrainConfig
from captioning.models import Captioner


def build_optimizer(model: Captioner, cfg: TrainConfig) -> torch.optim.Optimizer:
    """Adam with separate learning rates for the encoder's trainable part (``encoder_lr``)
    and everything after it (``lr``: the decoder, and the grid self-attention).

    Torch's fused Adam where the weights lie on the CPU or a CUDA device: one pass over each
    weight for the whole update instead of one per operation of the update (a fifth of the
    time of a COCO-size decoder's update on a 2-core CPU, docs/speed.md)."""
    encoder_params = [p for p in model.encoder.parameters() if p.requires_grad]
    in_encoder = {id(p) for p in model.encoder.parameters()}
    rest = [p for p in model.parameters() if id(p) not in in_encoder]
    groups = [{"params": rest, "lr": cfg.lr, "name": "decoder"}]
    if encoder_params:
        groups.append({"params": encoder_params, "lr": cfg.encoder_lr, "name": "encoder"})
    fused = all(p.device.type in ("cpu", "cuda") for p in model.parameters())
    return torch.optim.Adam(groups, weight_decay=cfg.weight_decay, fused=fused or None)


class LRSchedule:
    """``train.schedule``, and the one place that decides when it acts: ``cosine`` (with
    optional linear warm-up) after every optimiser step, ``plateau`` (on the validation
    metric) and ``step`` after every epoch, ``none`` never.

    Args:
        optimizer: the optimiser whose learning rates change.
        cfg: the ``train`` section (schedule, epochs, warm-up, factors).
        steps_per_epoch: optimiser steps in one epoch (for the cosine length).
    """

    def __init__(
        self, optimizer: torch.optim.Optimizer, cfg: TrainConfig, steps_per_epoch: int
    ) -> None:
        self.kind = cfg.schedule
        self.scheduler: Any = None
        if cfg.schedule == "cosine":
            total = max(cfg.epochs * steps_per_epoch, 1)
            self.scheduler = torch.optim.lr_scheduler.LambdaLR(
                optimizer, _cosine(cfg.warmup_steps, total)
            )
        elif cfg.schedule == "plateau":
            self.scheduler = torch.optim.lr_scheduler.ReduceLROnPlateau(
                optimizer, mode="max", factor=cfg.lr_factor, patience=cfg.lr_patience
            )
        elif cfg.schedule == "step":
            self.scheduler = torch.optim.lr_scheduler.StepLR(
                optimizer, step_size=cfg.lr_step, gamma=cfg.lr_factor
            )

    def after_step(self) -> None:
        """Called after every optimiser step."""
        if self.kind == "cosine":
            self.scheduler.step()

    def after_epoch(self, score: float | None) -> None:
        """Called after every epoch, with the selection metric's ``score`` (None when the
        epoch was not validated: the plateau schedule then waits for the next score)."""
        if self.kind == "plateau" and score is not None:
            self.scheduler.step(score)
        elif self.kind == "step":
            self.scheduler.step()

    def state_dict(self) -> dict[str, Any] | None:
        return None if self.scheduler is None else self.scheduler.state_dict()

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        if self.scheduler is not None and state is not None:
            self.scheduler.load_state_dict(state)


def _cosine(warmup: int, total: int) -> Any:
    """The learning-rate multiplier at each optimiser step: linear warm-up over ``warmup``
    steps, then cosine decay to zero at step ``total``."""

    def multiplier(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(total - warmup, 1)
        return 0.5 * (1.0 + math.cos(math.pi * min(progress, 1.0)))

    return multiplier
