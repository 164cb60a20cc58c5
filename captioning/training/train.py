"""Training: :func:`fit` reads top to bottom as :func:`~captioning.training.setup.set_up`,
then per epoch :func:`~captioning.training.step.train_one_epoch`, :func:`validate` and
:func:`end_epoch`.

Model selection uses metrics of generated (greedy) captions on the validation split, never
teacher-forced accuracy. Everything a run carries from epoch to epoch lives in one
:class:`~captioning.training.run_state.Run`, whose ``state_dict`` is the checkpoint:
``last.pt`` every epoch, ``best.pt`` on improvement, enough to continue exactly where a run
stopped. What a run may resume or start from is :mod:`captioning.training.run_state`'s; the
folder it writes into and its lock are :mod:`captioning.training.run_folder`'s.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import torch

from captioning.allocator import keep_freed_memory
from captioning.checkpoint import save_checkpoint
from captioning.config import Config
from captioning.data import (
    CaptionDataset,
)
from captioning.data.images import ImageLimits
from captioning.distributed import (
    SINGLE,
    World,
    broadcast_object,
    close_world,
    gather_objects,
    init_world,
)
from captioning.errors import CaptioningError
from captioning.inference.caption import CaptionResult, decode_dataset, draw_attention
from captioning.inference.decoding import Decoded
from captioning.metrics import score_predictions
from captioning.models import Captioner
from captioning.signals import signals_deferred, sigterm_raises
from captioning.training.events import EventLog
from captioning.training.run_folder import claim_run_dir, write_config
from captioning.training.run_state import Run
from captioning.training.setup import Setup, set_up
from captioning.training.step import TrainingError, train_one_epoch

logger = logging.getLogger("captioning")


def validate(
    model: Captioner,
    dataset: CaptionDataset,
    cfg: Config,
    device: torch.device,
    world: World = SINGLE,
) -> tuple[dict[str, Any], dict[int, str], dict[int, Decoded]]:
    """Decode ``dataset`` and score the generated captions against its references (without
    METEOR, which costs a Java process).

    With several processes each decodes its share; the captions are gathered and scored
    once, on rank 0, and every rank gets the same scores. The per-image details hold this
    process's share only. The random streams are left as they were (the loader draws from
    them), so how often a run validates does not change how it trains.
    """
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        predictions, details = decode_dataset(
            model,
            dataset,
            cfg,
            device,
            progress=not cfg.train.quiet and world.is_main,
            summary=False,  # the epoch's line reports the validation time
            desc="validating",
            world=world,
        )
    if world.enabled:
        predictions = {k: v for part in gather_objects(world, predictions) for k, v in part.items()}
    if not predictions:
        raise TrainingError("no validation image could be decoded")
    scores = None
    if world.is_main:
        scores = score_predictions(predictions, dataset.records, meteor=False)
    return broadcast_object(world, scores), predictions, details


def end_epoch(
    run: Run,
    train_terms: dict[str, float],
    scores: dict[str, Any] | None,
    seconds: float,
    out_dir: Path,
) -> bool:
    """Book an epoch that has been trained (and validated, unless ``scores`` is None):
    counters, the epoch-wise schedule, the history, and the checkpoints (``best.pt`` too on
    improvement). Returns whether the selection metric improved."""
    progress = run.progress
    progress.epoch += 1
    score, improved = None, False
    if scores is not None:
        score = float(scores[run.cfg.train.select_metric] or 0.0)
        improved = score > progress.best_score
        if improved:
            progress.best_score, progress.best_epoch = score, progress.epoch
            progress.bad_epochs = 0
        else:
            progress.bad_epochs += 1
    run.schedule.after_epoch(score)
    record = {"epoch": progress.epoch, "seconds": seconds, **train_terms}
    record.update({f"val_{k}": float(v) for k, v in (scores or {}).items() if v is not None})
    progress.history.append(record)
    _check_finite_weights(run, out_dir)  # every process: DDP keeps their weights equal
    checkpoint = run.state_dict()  # every process: it gathers their RNG states
    if run.world.is_main:
        save_checkpoint(checkpoint, out_dir / "last.pt")
        if improved:
            save_checkpoint(checkpoint, out_dir / "best.pt")
    return improved


def _check_finite_weights(run: Run, out_dir: Path) -> None:
    """Refuse to checkpoint weights (or buffers, such as BatchNorm statistics) that are not
    finite: a diverged model would overwrite ``last.pt``, and even become ``best.pt``."""
    bad = next(
        (
            name
            for name, value in run.model.state_dict().items()
            if value.is_floating_point() and not bool(torch.isfinite(value).all())
        ),
        None,
    )
    if bad is None:
        return
    epoch, last = run.progress.epoch, out_dir / "last.pt"
    kept = (
        f"{last} keeps epoch {epoch - 1}: start a new run from its weights (--init {last})"
        if epoch > 1 and last.is_file()
        else "start again"
    )
    raise TrainingError(
        f"the weights became non-finite in epoch {epoch} ({bad} holds NaN or inf), so they "
        f"were not saved; {kept} with a lower train.lr or train.precision=fp32"
    )


class EpochTiming(NamedTuple):
    """Steps and seconds of an epoch's training, and of the whole epoch with validation."""

    steps: int
    train_seconds: float
    total: float = 0.0


def _log_epoch(
    run: Run,
    train_terms: dict[str, float],
    scores: dict[str, Any] | None,
    timing: EpochTiming,
    best: bool,
) -> None:
    """The epoch's one line: the figures of its progress bar (loss, steps, rate, time) and
    the validation scores when it was validated, so that a log without bars (not a
    terminal) loses nothing."""
    metric = run.cfg.train.select_metric
    rate = timing.steps / timing.train_seconds if timing.train_seconds > 0 else 0.0
    validation = ""
    if scores is not None:
        validation = (
            f"  val {metric} {float(scores[metric] or 0.0):.3f}"
            f"  BLEU-4 {scores.get('Bleu_4') or 0.0:.3f}"
            f"  exact {scores.get('exact_match') or 0.0:.3f}"
        )
    logger.info(
        "epoch %d/%d  loss %.3f  nll/word %.3f%s  "
        "lr %.2g  %.0fs (%d steps in %.0fs, %.2f steps/s; validation %.0fs)%s",
        run.progress.epoch,
        run.cfg.train.epochs,
        train_terms["loss"],
        train_terms["nll_per_token"],
        validation,
        run.optimizer.param_groups[0]["lr"],
        timing.total,
        timing.steps,
        timing.train_seconds,
        rate,
        timing.total - timing.train_seconds,
        "  *best*" if best else "",
    )


def _epoch_figure(
    run: Run, dataset: CaptionDataset, details: dict[int, Decoded], path: Path
) -> None:
    """The per-word attention of the first validation image, as ``caption`` draws it (none,
    with a warning, when a diverged model's weights are not finite)."""
    record = dataset.records[0]
    decoded = details.get(record.image_id)
    if decoded is None:
        return
    result = CaptionResult.from_decoded(record.path, decoded, run.vocab)
    if result.alphas is not None and not bool(torch.isfinite(result.alphas).all()):
        logger.warning(
            "no attention figure for epoch %d: the weights are not finite", run.progress.epoch
        )
        return
    draw_attention(
        result,
        run.model.grid_shape,
        path.parent,
        path.stem,
        limits=ImageLimits.from_config(run.cfg.data),
    )


def fit(
    cfg: Config,
    out_dir: str | Path,
    resume: str | None = None,
    init: str | None = None,
    on_step: Callable[[Run], None] | None = None,
) -> dict[str, Any]:
    """Train a model as ``cfg`` says; write ``config.yaml``, checkpoints, TensorBoard events
    and per-epoch attention figures into ``out_dir``. Returns a summary dict.

    ``resume`` continues one run exactly where its checkpoint left it; ``init`` starts a new
    run from a checkpoint's weights (and vocabulary), with a fresh optimiser and schedule,
    as self-critical training starts from a cross-entropy model.

    Launched by ``torchrun`` with several processes, it trains data-parallel (see
    :mod:`captioning.distributed`); ``train.batch_size`` is then the batch of each process.
    """
    if resume and init:
        raise CaptioningError(
            "--init starts a new run from a checkpoint's weights and --resume continues one; "
            "give one of them"
        )
    started = time.time()
    keep_freed_memory()  # each step's tensors on the pages the last step freed
    out_dir = Path(out_dir)
    world, device = init_world(cfg.train.device)
    try:
        if not world.is_main:
            logger.setLevel(logging.WARNING)  # one process speaks
        elif world.enabled:
            logger.info(
                "data-parallel training: %d processes (%s), batch %d per process",
                world.size,
                "nccl" if device.type == "cuda" else "gloo",
                cfg.train.batch_size,
            )
        with sigterm_raises(), claim_run_dir(out_dir, resume, world):
            setup = set_up(cfg, resume, world, device, init)
            _train(setup, out_dir, device, on_step)
    finally:
        close_world(world)
    progress = setup.run.progress
    summary = {
        "out_dir": str(out_dir),
        "best_score": progress.best_score,
        "best_epoch": progress.best_epoch,
        "select_metric": cfg.train.select_metric,
        "epochs": progress.epoch,
        "steps": progress.step,
        "seconds": time.time() - started,
        "history": progress.history,
    }
    logger.info(
        "done in %.0fs: best %s %.3f at epoch %d; checkpoints in %s",
        summary["seconds"],
        cfg.train.select_metric,
        progress.best_score,
        progress.best_epoch,
        out_dir,
    )
    return summary


def _validates(cfg: Config, epoch: int) -> bool:
    """Whether epoch number ``epoch`` (from 1) ends with a validation: every
    ``train.val_every``-th from epoch ``train.val_from`` on, and the last."""
    train = cfg.train
    due = epoch >= train.val_from and epoch % train.val_every == 0
    return due or epoch >= train.epochs


def _train(
    setup: Setup, out_dir: Path, device: torch.device, on_step: Callable[[Run], None] | None
) -> None:
    """The epoch loop, until ``train.epochs`` or early stopping."""
    run, cfg = setup.run, setup.run.cfg
    writer: EventLog | None = None
    if run.world.is_main:
        write_config(cfg, out_dir)
        writer = EventLog(out_dir)
    patience = cfg.train.early_stop_patience
    try:
        while run.progress.epoch < cfg.train.epochs:
            if patience and run.progress.bad_epochs >= patience:
                logger.info(
                    "early stop: %s has not improved for %d validations",
                    cfg.train.select_metric,
                    run.progress.bad_epochs,
                )
                break
            epoch_start, first_step = time.time(), run.progress.step
            setup.sampler.set_epoch(run.progress.epoch)
            train_terms = train_one_epoch(run, setup.module, setup.loader, device, writer, on_step)
            timing = EpochTiming(run.progress.step - first_step, time.time() - epoch_start)
            scores, details = None, {}
            if _validates(cfg, run.progress.epoch + 1):
                scores, _, details = validate(run.model, setup.val_dataset, cfg, device, run.world)
            seconds = time.time() - epoch_start
            improved = end_epoch(run, train_terms, scores, seconds, out_dir)
            if writer is not None and scores is not None:
                values = {f"val/{key}": v for key, v in scores.items() if v is not None}
                writer.scalars(values, run.progress.step)
                if cfg.train.figure_every_epoch:
                    figure = out_dir / "figures" / f"epoch_{run.progress.epoch:03d}.png"
                    with signals_deferred():  # no half-written figure on Ctrl-C or SIGTERM
                        _epoch_figure(run, setup.val_dataset, details, figure)
            _log_epoch(run, train_terms, scores, timing._replace(total=seconds), improved)
    finally:
        if writer is not None:
            writer.close()
