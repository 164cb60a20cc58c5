"""What a training run carries, what its checkpoints hold, and what a run may start from.

:class:`Run` is everything training carries from step to step; :meth:`Run.state_dict` is
the checkpoint schema and :meth:`Run.load_state_dict` the only code that reads it back
(:mod:`captioning.checkpoint` writes and reads the files and upgrades older formats). The
resume and init policy lives beside it: which settings a resumed run may change
(:data:`SAFE_ON_RESUME`), which model settings ``--init`` may change (:data:`FREE_ON_INIT`),
and what a checkpoint must hold to be resumed (:data:`TRAINING_KEYS`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from captioning.checkpoint import load_checkpoint, rng_state, set_rng_state
from captioning.config import Config, config_from_dict, config_to_dict, quote
from captioning.data.records import ImageRecord
from captioning.data.vocab import Vocabulary
from captioning.distributed import SINGLE, World, gather_objects
from captioning.errors import CaptioningError, CheckpointError
from captioning.inference.caption import load_weights
from captioning.models import Captioner
from captioning.objectives import Objective, ObjectiveContext, build_objective
from captioning.training.optim import LRSchedule, build_optimizer


@dataclass
class Progress:
    """The counters of a run."""

    epoch: int = 0  # epochs completed
    step: int = 0  # optimiser steps taken
    best_score: float = -math.inf
    best_epoch: int = 0
    bad_epochs: int = 0  # validations since the last improvement
    history: list[dict[str, float]] = field(default_factory=list)


@dataclass
class Run:
    """Everything a training run carries from step to step, and so everything its
    checkpoints hold: :meth:`state_dict` is the checkpoint schema, and
    :meth:`load_state_dict` the only code that reads it back.

    Attributes:
        cfg: the resolved config.
        vocab: the training split's vocabulary.
        model: the captioner (not its DDP wrapper).
        optimizer: Adam over the trainable weights.
        schedule: the learning-rate schedule.
        scaler: the fp16 loss scaler, else None.
        objective: what the model is trained to minimise, and its state (for hard
            attention: the estimator, its baseline and temperature): cross-entropy, hard
            attention's estimator, or self-critical training.
        progress: the counters.
        world: this process's place among the training processes.
    """

    cfg: Config
    vocab: Vocabulary
    model: Captioner
    optimizer: torch.optim.Optimizer
    schedule: LRSchedule
    scaler: torch.amp.GradScaler | None
    objective: Objective
    progress: Progress = field(default_factory=Progress)
    world: World = SINGLE

    @classmethod
    def create(
        cls,
        cfg: Config,
        vocab: Vocabulary,
        model: Captioner,
        steps_per_epoch: int,
        device: torch.device,
        world: World = SINGLE,
        train_records: Sequence[ImageRecord] = (),
    ) -> Run:
        """A fresh run of ``model``: its optimiser, schedule, scaler and objective from
        ``cfg`` (self-critical training rewards captions against ``train_records``, the
        training dataset's images in dataset order)."""
        optimizer = build_optimizer(model, cfg.train)
        return cls(
            cfg=cfg,
            vocab=vocab,
            model=model,
            optimizer=optimizer,
            schedule=LRSchedule(optimizer, cfg.train, steps_per_epoch),
            scaler=torch.amp.GradScaler(device.type) if cfg.train.precision == "fp16" else None,
            objective=build_objective(
                ObjectiveContext(cfg, model, device, world, vocab, train_records)
            ),
            world=world,
        )

    def state_dict(self) -> dict[str, Any]:
        """The checkpoint: plain data only. Every process must call it (it gathers each
        process's RNG state, so that a resumed run continues exactly)."""
        return {
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.schedule.state_dict(),
            "scaler": self.scaler.state_dict() if self.scaler is not None else None,
            "objective": self.objective.state_dict(),
            **dataclasses.asdict(self.progress),
            "config": config_to_dict(self.cfg),
            "vocab": self.vocab.to_list(),
            "rng": gather_objects(self.world, rng_state()),  # one per process, rank order
        }

    def load_state_dict(self, payload: dict[str, Any], source: str = "checkpoint") -> None:
        """Continue from a checkpoint written by :meth:`state_dict` (see
        :func:`captioning.checkpoint.load_checkpoint`, which upgrades older formats);
        ``source`` names it in the error when its weights do not fit."""
        load_weights(self.model, payload, source)
        self.optimizer.load_state_dict(payload["optimizer"])
        self.schedule.load_state_dict(payload["scheduler"])
        if self.scaler is not None and payload.get("scaler") is not None:
            self.scaler.load_state_dict(payload["scaler"])
        self.objective.load_state_dict(payload["objective"])
        self.progress = Progress(**{f.name: payload[f.name] for f in dataclasses.fields(Progress)})
        self.progress.history = list(self.progress.history)
        ranks = payload["rng"]
        set_rng_state(ranks[self.world.rank] if len(ranks) == self.world.size else ranks[0])


# What resuming needs beyond the weights, of what :meth:`Run.state_dict` writes (a checkpoint
# cut down to weights cannot resume).
TRAINING_KEYS = ("optimizer", "scheduler", "objective", "rng")


def check_resumable(payload: dict[str, Any], path: str | Path) -> None:
    """Refuse to resume from a checkpoint that lacks a training-state key."""
    missing = [key for key in TRAINING_KEYS if not isinstance(payload.get(key), dict | list)]
    if missing:
        raise CheckpointError(
            f"{path}: holds no training state ({', '.join(missing)} missing), so it cannot be "
            f"resumed; evaluate or caption with it, or start a new run"
        )


def resume_run(run: Run, payload: dict[str, Any], path: str) -> None:
    """Continue ``run`` from the checkpoint ``payload`` read from ``path`` (checked first
    with :func:`check_resume_config`); one line when its training state does not fit."""
    try:
        run.load_state_dict(payload, path)
    except (RuntimeError, KeyError, ValueError, TypeError, IndexError) as exc:
        first = " ".join(str(exc).split())[:200] or type(exc).__name__
        raise CheckpointError(
            f"{path}: its training state does not fit this run ({first})"
        ) from exc


# What may differ from the checkpoint's config when a run resumes: where the data is and how
# it is read, how long the run goes on, what it logs and how it validates. Everything else
# (the model, the data's content, the optimiser, the schedule, the objective, the seed) would
# not continue the same run, so a difference is refused by name.
SAFE_ON_RESUME = frozenset(
    {
        "data.root",
        "data.num_workers",
        "data.check_images",
        "data.cache_images",
        "data.on_bad_image",
        "data.feature_cache",
        "data.max_image_pixels",
        "data.max_caption_length",
        "train.epochs",
        "train.early_stop_patience",
        "train.val_max_images",
        "train.val_every",
        "train.val_from",
        "train.stop_on_nonfinite",
        "train.log_every",
        "train.figure_every_epoch",
        "train.quiet",
        "train.device",
        "train.threads",
    }
)


# What --init may change in the model section: none of these changes a weight's shape or
# meaning (dropout, which layers train, where pretrained weights would have come from).
FREE_ON_INIT = frozenset({"model.dropout", "model.fine_tune", "model.weights"})
# Attention kinds --init may swap for one another: soft and hard attention score the cells
# with the same weights and differ only in how the context is formed from the map, so a hard
# model may start from a soft model's weights (and back).
SAME_WEIGHTS_ATTENTION = frozenset({"soft", "hard"})
# Parts that only add a term to the training loss, by the model key that builds them and the
# prefix of their weights: captions never read them. A model without one (a hard stage, say)
# may start from one with it, and its weights are left out.
TRAINING_ONLY = {"context_words": "decoder.context_words.", "word_maps": "word_maps."}


# Model keys that build only the small CNN: with another encoder they shape nothing, so a
# checkpoint that differs in them (an older format's default, say) is the same architecture.
SMALL_CNN_ONLY = frozenset({"cnn_channels", "cnn_block"})


def _builds_nothing(model: dict[str, Any]) -> frozenset[str]:
    """The keys of a model section that its encoder does not use."""
    return SMALL_CNN_ONLY if model.get("encoder") != "small_cnn" else frozenset()


def load_init(cfg: Config, path: str) -> dict[str, Any]:
    """The checkpoint ``--init`` starts from, refused in one line when its model section
    differs from ``cfg``'s (other than :data:`FREE_ON_INIT`)."""
    payload = load_checkpoint(path)
    saved = _saved_config(payload, path)["model"]
    ours = config_to_dict(cfg)["model"]
    unused = _builds_nothing(saved) & _builds_nothing(ours)
    swapped = {saved.get("attention"), ours["attention"]} <= SAME_WEIGHTS_ATTENTION
    dropped = {k for k in TRAINING_ONLY if saved.get(k) and not ours[k]}
    changed = [
        k
        for k in saved
        if ours[k] != saved[k]
        and f"model.{k}" not in FREE_ON_INIT
        and k not in unused
        and not (k == "attention" and swapped)
        and k not in dropped
        and not (k == "word_map_rank" and "word_maps" in dropped)
    ]
    if changed:
        key = changed[0]
        raise CheckpointError(
            f"{path}: model.{key} is {quote(saved[key])} in the checkpoint and "
            f"{quote(ours[key])} here; --init needs the same architecture (set "
            f"model.{key}={quote(saved[key])})"
        )
    if dropped:
        prefixes = tuple(TRAINING_ONLY[k] for k in dropped)
        payload["model"] = {k: v for k, v in payload["model"].items() if not k.startswith(prefixes)}
    return payload


def check_resume_config(cfg: Config, payload: dict[str, Any], path: str) -> None:
    """Refuse to resume with a setting that differs from the checkpoint's, unless it is in
    :data:`SAFE_ON_RESUME` (or in the ``decode`` and ``runtime`` sections, which change
    how it decodes and runs, never what it trains)."""
    check_resumable(payload, path)
    saved = _saved_config(payload, path)
    ours = config_to_dict(cfg)
    unused = {
        f"model.{k}" for k in _builds_nothing(saved["model"]) & _builds_nothing(ours["model"])
    }
    changed = [
        f"{section}.{key}"
        for section in ("data", "model", "train")
        for key, value in saved[section].items()
        if ours[section][key] != value and f"{section}.{key}" not in SAFE_ON_RESUME | unused
    ]
    if changed:
        key = changed[0]
        section, name = key.split(".")
        raise CheckpointError(
            f"{path}: {key} is {quote(saved[section][name])} in the checkpoint and "
            f"{quote(ours[section][name])} here; a resumed run keeps it (start a new run to "
            f"change it){f'; also {len(changed) - 1} more' if len(changed) > 1 else ''}"
        )


def _saved_config(payload: dict[str, Any], path: str) -> dict[str, Any]:
    """A checkpoint's config as a full plain dict (every key, defaults included)."""
    try:
        return config_to_dict(config_from_dict(payload["config"]))
    except CaptioningError as exc:
        raise CheckpointError(f"{path}: its config does not load ({exc})") from exc
