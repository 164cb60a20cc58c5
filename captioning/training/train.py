"""Training: :func:`fit` reads top to bottom as :func:`set_up`, then per epoch
:func:`train_one_epoch`, :func:`validate` and :func:`end_epoch`.

Model selection uses metrics of generated (greedy) captions on the validation split, never
teacher-forced accuracy. Everything a run carries from epoch to epoch lives in one
:class:`~captioning.training.run_state.Run`, whose ``state_dict`` is the checkpoint: ``last.pt``
every epoch, ``best.pt`` on improvement, enough to continue exactly where a run stopped. What a run
may resume or start from is :mod:`captioning.training.run_state`'s; the folder it writes into and
its lock are :mod:`captioning.training.run_folder`'s.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader

from captioning.checkpoint import load_checkpoint, save_checkpoint
from captioning.config import Config, replace_section
from captioning.data import (
    CaptionBatchSampler,
    CaptionDataset,
    build_vocabulary,
    collate,
    drop_bad_images,
    load_splits,
)
from captioning.data.feature_cache import find_caches
from captioning.data.images import ImageLimits
from captioning.data.vocab import Vocabulary
from captioning.distributed import (
    SINGLE,
    World,
    any_rank,
    broadcast_object,
    close_world,
    gather_objects,
    init_world,
    mean_over_ranks,
)
from captioning.errors import CaptioningError
from captioning.inference.caption import CaptionResult, decode_dataset, draw_attention, load_weights
from captioning.inference.decoding import Decoded
from captioning.metrics import score_predictions
from captioning.models import Captioner, build_model
from captioning.objectives import Batch, LossTerms
from captioning.progress import progress_bar
from captioning.runtime import resolve_precision, seed_everything
from captioning.signals import signals_deferred, sigterm_raises
from captioning.training.run_folder import claim_run_dir, write_config
from captioning.training.run_state import Run, check_resume_config, load_init, resume_run

logger = logging.getLogger("captioning")


class TrainingError(CaptioningError):
    """Training cannot go on (for example a non-finite loss)."""


# --------------------------------------------------------------------------- one step


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


# --------------------------------------------------------------------------- one epoch


def train_one_epoch(
    run: Run,
    module: nn.Module,
    loader: DataLoader,
    device: torch.device,
    writer: Any = None,
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
        loader,
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


def _log_step(writer: Any, run: Run, result: StepResult) -> None:
    """TensorBoard scalars of one step (rank 0 only)."""
    step = run.progress.step
    names = {
        "nll_per_token": "nll_per_token",
        "penalty": "attention_penalty",
        "entropy": "attention_entropy",
    }
    for key, value in {**result.terms.scalars(), **run.objective.scalars()}.items():
        writer.add_scalar(f"train/{names.get(key, key)}", value, step)
    writer.add_scalar("train/grad_norm", result.grad_norm, step)
    for group in run.optimizer.param_groups:
        writer.add_scalar(f"lr/{group.get('name', 'group')}", group["lr"], step)


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


# --------------------------------------------------------------------------- set-up


@dataclass
class Setup:
    """What :func:`set_up` makes: the run, the training data and the validation split.

    Attributes:
        run: the run (resumed from the checkpoint, if one was given).
        module: what training calls: ``run.model``, or its DDP wrapper.
        loader: the training batches.
        sampler: their sampler (one order per epoch).
        val_dataset: the validation images.
    """

    run: Run
    module: nn.Module
    loader: DataLoader
    sampler: CaptionBatchSampler
    val_dataset: CaptionDataset


def set_up(
    cfg: Config, resume: str | None, world: World, device: torch.device, init: str | None = None
) -> Setup:
    """Data, vocabulary, model, optimiser and state: from scratch, from ``resume`` (the
    whole training state), or from ``init`` (a checkpoint's weights and vocabulary only)."""
    cfg = _resolve_precisions(cfg, device)
    if cfg.train.threads:
        torch.set_num_threads(cfg.train.threads)
    seed_everything(cfg.train.seed)
    payload = load_checkpoint(resume) if resume else None
    if payload is not None:
        check_resume_config(cfg, payload, resume)
    initial = load_init(cfg, init) if init else None
    splits = load_splits(cfg.data)
    for split in ("train", "val"):
        if not splits.get(split):
            raise CaptioningError(f"the {split} split has no images (check data.splits)")
    if cfg.data.check_images:
        drop_bad_images(splits, cfg.data, progress=not cfg.train.quiet and world.is_main)
    known = payload or initial  # a checkpoint's model needs its own vocabulary
    vocab = Vocabulary(known["vocab"]) if known else build_vocabulary(splits, cfg.data)
    logger.info("vocabulary: %d words (from the training split)", len(vocab))
    if cfg.train.val_max_images:
        splits["val"] = splits["val"][: cfg.train.val_max_images]

    model = build_model(cfg.model, len(vocab), cfg.runtime).to(device)
    if world.enabled:
        model = _sync_batchnorm(model, device)
    _log_model(model, cfg)
    datasets = _datasets(cfg, splits, vocab, model)
    sampler = CaptionBatchSampler(
        datasets["train"].caption_lengths(),
        cfg.train.batch_size,
        seed=cfg.train.seed,
        bucket=cfg.data.bucket_by_length,
        num_replicas=world.size,
        rank=world.rank,
    )
    loader = DataLoader(
        datasets["train"],
        batch_sampler=sampler,
        collate_fn=collate,
        num_workers=cfg.data.num_workers,
        persistent_workers=cfg.data.num_workers > 0,
        pin_memory=device.type == "cuda",
    )
    run = Run.create(cfg, vocab, model, len(sampler), device, world, datasets["train"].records)
    if initial is not None:
        load_weights(run.model, initial, init)
        logger.info(
            "weights from %s (epoch %d); fresh optimiser and schedule",
            init,
            int(initial.get("epoch", 0)),
        )
    if payload is not None:
        resume_run(run, payload, resume)
        logger.info(
            "resumed from %s after epoch %d (step %d)",
            resume,
            run.progress.epoch,
            run.progress.step,
        )
    module: nn.Module = model
    if world.enabled:
        module = DistributedDataParallel(
            model, device_ids=[device.index] if device.type == "cuda" else None
        )
    return Setup(run, module, loader, sampler, datasets["val"])


def _resolve_precisions(cfg: Config, device: torch.device) -> Config:
    """``cfg`` with ``auto`` precisions (``train.precision`` and ``runtime.precision``)
    resolved once for ``device``, so that config.yaml and the checkpoints record what ran."""
    resolved = {
        section: resolve_precision(getattr(cfg, section).precision, device)
        for section in ("train", "runtime")
    }
    for section, precision in resolved.items():
        if precision != getattr(cfg, section).precision:
            logger.info("%s.precision=auto: %s on this %s", section, precision, device.type)
            cfg = replace_section(cfg, section, precision=precision)
    return cfg


def _datasets(
    cfg: Config, splits: dict[str, list], vocab: Vocabulary, model: Captioner
) -> dict[str, CaptionDataset]:
    """The training and validation datasets, reading cached grids where the frozen encoder
    has them."""
    caches = find_caches(cfg, model.encoder, ["train", "val"])
    return {
        split: CaptionDataset(
            splits[split],
            vocab,
            model.encoder.transform,
            max_length=cfg.data.max_caption_length,
            skip_bad_images=cfg.data.on_bad_image == "skip",
            cache_images=cfg.data.cache_images,
            feature_cache=caches[split],
            limits=ImageLimits.from_config(cfg.data),
        )
        for split in ("train", "val")
    }


def _log_model(model: Captioner, cfg: Config) -> None:
    num_params = sum(p.numel() for p in model.parameters() if p.requires_grad)
    logger.info(
        "model: %s encoder, %s attention (%s), grid %dx%d, %.2fM trainable parameters",
        cfg.model.encoder,
        cfg.model.attention,
        cfg.model.score,
        *model.grid_shape,
        num_params / 1e6,
    )


def _sync_batchnorm(model: Captioner, device: torch.device) -> Captioner:
    """BatchNorm layers that train see one process's slice of the batch; on CUDA they are
    made to share batch statistics across processes (SyncBatchNorm needs a GPU)."""
    training_bn = [
        m
        for m in model.encoder.modules()
        if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)
        and any(p.requires_grad for p in m.parameters())
    ]
    if not training_bn:
        return model
    if device.type == "cuda":
        logger.info("BatchNorm layers synchronised across processes")
        return torch.nn.SyncBatchNorm.convert_sync_batchnorm(model)
    logger.warning(
        "the encoder's %d training BatchNorm layers use per-process batch statistics on CPU; "
        "results match one process with the global batch only with model.fine_tune=none",
        len(training_bn),
    )
    return model


# --------------------------------------------------------------------------- fit


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
    """Whether epoch number ``epoch`` (from 1) ends with a validation."""
    return epoch % cfg.train.val_every == 0 or epoch >= cfg.train.epochs


def _train(
    setup: Setup, out_dir: Path, device: torch.device, on_step: Callable[[Run], None] | None
) -> None:
    """The epoch loop, until ``train.epochs`` or early stopping."""
    run, cfg = setup.run, setup.run.cfg
    writer = None
    if run.world.is_main:
        write_config(cfg, out_dir)
        from torch.utils.tensorboard import SummaryWriter

        writer = SummaryWriter(str(out_dir))
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
                for key, value in scores.items():
                    if value is not None:
                        writer.add_scalar(f"val/{key}", float(value), run.progress.step)
                if cfg.train.figure_every_epoch:
                    figure = out_dir / "figures" / f"epoch_{run.progress.epoch:03d}.png"
                    with signals_deferred():  # no half-written figure on Ctrl-C or SIGTERM
                        _epoch_figure(run, setup.val_dataset, details, figure)
            _log_epoch(run, train_terms, scores, timing._replace(total=seconds), improved)
    finally:
        if writer is not None:
            writer.close()
