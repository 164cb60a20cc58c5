"""Training: :func:`fit` reads top to bottom as :func:`set_up`, then per epoch
:func:`train_one_epoch`, :func:`validate` and :func:`end_epoch`.

Model selection uses metrics of generated (greedy) captions on the validation split, never
teacher-forced accuracy. Everything a run carries from epoch to epoch lives in one
:class:`Run`, whose :meth:`Run.state_dict` is the checkpoint: ``last.pt`` every epoch,
``best.pt`` on improvement, enough to continue exactly where a run stopped.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import logging
import math
import os
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader

from captioning.checkpoint import (
    check_resumable,
    load_checkpoint,
    remove_partial_writes,
    rng_state,
    save_checkpoint,
    set_rng_state,
    signals_deferred,
    sigterm_raises,
)
from captioning.config import (
    Config,
    config_from_dict,
    config_to_dict,
    quote,
    replace_section,
    save_config,
)
from captioning.data import (
    CaptionBatchSampler,
    CaptionDataset,
    build_vocabulary,
    collate,
    drop_bad_images,
    load_splits,
)
from captioning.data.images import ImageLimits
from captioning.data.records import ImageRecord
from captioning.decoding import Decoded
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
from captioning.errors import CaptioningError, CheckpointError
from captioning.feature_cache import find_caches
from captioning.hard_attention import HardAttentionObjective
from captioning.inference import CaptionResult, decode_dataset, draw_attention, load_weights
from captioning.losses import CrossEntropyObjective, LossTerms
from captioning.metrics import score_predictions
from captioning.models import Captioner, build_model
from captioning.optim import LRSchedule, build_optimizer
from captioning.progress import progress_bar
from captioning.runtime import resolve_precision, seed_everything
from captioning.scst import CaptionReward, SelfCriticalObjective
from captioning.vocab import Vocabulary

logger = logging.getLogger("captioning")


class TrainingError(CaptioningError):
    """Training cannot go on (for example a non-finite loss)."""


Objective = CrossEntropyObjective | HardAttentionObjective | SelfCriticalObjective


# --------------------------------------------------------------------------- the run's state


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
            objective=build_objective(cfg, model, device, world, vocab, train_records),
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


# --------------------------------------------------------------------------- one step


def build_objective(
    cfg: Config,
    model: Captioner,
    device: torch.device,
    world: World = SINGLE,
    vocab: Vocabulary | None = None,
    train_records: Sequence[ImageRecord] = (),
) -> Objective:
    """The objective that trains ``model``: self-critical training (rewarding captions
    against ``train_records``, in ``vocab``'s words), hard attention's estimator, or
    cross-entropy."""
    if cfg.train.objective == "scst":
        if vocab is None or not train_records:
            raise CaptioningError("self-critical training needs the training images and vocabulary")
        reward = CaptionReward(train_records, vocab, cfg.train.scst_bleu_weight)
        return SelfCriticalObjective(cfg, reward, device, cfg.train.precision,
                                     hard=model.hard_attention)  # fmt: skip
    if model.hard_attention:
        cells = model.grid_shape[0] * model.grid_shape[1]
        return HardAttentionObjective(cfg, cells, device, cfg.train.precision, world)
    return CrossEntropyObjective(
        cfg.train.doubly_stochastic_weight,
        device,
        cfg.train.precision,
        label_smoothing=cfg.train.label_smoothing,
    )


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
    terms = run.objective.loss(module, images, grid, tokens, run.progress.step,
                               indices=batch.get("indices"))  # fmt: skip
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
    run: Run, module: nn.Module, loader: DataLoader, device: torch.device, writer: Any = None
) -> dict[str, float]:
    """One pass over the training data; returns the epoch's mean loss terms (averaged over
    the processes when there are several). ``module`` is ``run.model`` or its DDP wrapper,
    which averages the gradients over the processes during ``backward``."""
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
    names = {"nll_per_token": "nll_per_token", "penalty": "attention_penalty",
             "entropy": "attention_entropy"}  # fmt: skip
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
    bad = next((name for name, value in run.model.state_dict().items()
                if value.is_floating_point() and not bool(torch.isfinite(value).all())),
               None)  # fmt: skip
    if bad is None:
        return
    epoch, last = run.progress.epoch, out_dir / "last.pt"
    kept = (f"{last} keeps epoch {epoch - 1}: start a new run from its weights (--init {last})"
            if epoch > 1 and last.is_file() else "start again")  # fmt: skip
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
        logger.warning("no attention figure for epoch %d: the weights are not finite",
                       run.progress.epoch)  # fmt: skip
        return
    draw_attention(result, run.model.grid_shape, path.parent, path.stem,
                   limits=ImageLimits.from_config(run.cfg.data))  # fmt: skip


def _lock_run_dir(out_dir: Path) -> Any:
    """An exclusive lock on ``out_dir`` for as long as the returned file stays open, so that
    two trainings never write into one run folder."""
    import fcntl

    path = out_dir / ".lock"
    try:
        handle = open(path, "a+")  # noqa: SIM115 (held open for the whole run)
    except OSError as exc:
        raise CaptioningError(f"cannot write in run folder {out_dir} ({exc.strerror}); "
                              f"choose another --out") from exc  # fmt: skip
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        handle.close()
        if exc.errno not in (errno.EAGAIN, errno.EWOULDBLOCK):  # not "held by another"
            raise CaptioningError(
                f"cannot lock run folder {out_dir} ({exc.strerror or exc}): its file system "
                f"does not take file locks (some network mounts); choose an --out on a "
                f"local disk"
            ) from exc
        holder = path.read_text(errors="replace").strip()[:80] or "another process"
        raise CaptioningError(
            f"run folder {out_dir} is in use by another training ({holder}); wait for it "
            f"to finish, or choose another --out"
        ) from exc
    if not _same_file(handle, path):  # removed by a failed start (see _remove_if_empty)
        handle.close()
        raise CaptioningError(f"run folder {out_dir} was being given up by another training; "
                              f"run the command again")  # fmt: skip
    handle.seek(0)
    handle.truncate()
    handle.write(f"pid {os.getpid()}\n")
    handle.flush()
    return handle


def _same_file(handle: Any, path: Path) -> bool:
    """Whether the open ``handle`` is still the file at ``path``: a lock on a file no
    longer there would not keep out the next training."""
    try:
        there, held = os.stat(path), os.fstat(handle.fileno())
    except FileNotFoundError:
        return False
    return (there.st_dev, there.st_ino) == (held.st_dev, held.st_ino)


@contextlib.contextmanager
def _claim_run_dir(out_dir: Path, resume: str | None, world: World) -> Iterator[None]:
    """Hold ``out_dir`` for the block: the main process locks it, and only then checks that
    it holds no other run and removes what a killed checkpoint write left, so that of two
    trainings started together one is refused. A folder made here and still empty when the
    block fails is removed again."""
    lock, problem, made = None, None, False
    if world.is_main:
        try:
            try:
                out_dir.parent.mkdir(parents=True, exist_ok=True)
                with contextlib.suppress(FileExistsError):
                    out_dir.mkdir()
                    made = True
            except OSError as exc:
                raise CaptioningError(f"cannot make run folder {out_dir} ({exc.strerror}); "
                                      f"choose another --out") from exc  # fmt: skip
            lock = _lock_run_dir(out_dir)
            _check_run_dir(out_dir, resume)
            for tmp in remove_partial_writes(out_dir):
                logger.warning("removed %s, a checkpoint write that never finished", tmp)
        except CaptioningError as exc:
            problem = exc
    # Every process stops when the main one cannot have the folder.
    refused = broadcast_object(world, None if problem is None else str(problem))
    succeeded = False
    try:
        if refused is not None:
            raise problem if problem is not None else CaptioningError(refused)
        yield
        succeeded = True
    finally:
        if made and not succeeded and lock is not None:
            _remove_if_empty(out_dir)
        if lock is not None:
            lock.close()  # releases the lock


def _remove_if_empty(out_dir: Path) -> None:
    """Remove ``out_dir`` when it holds nothing but its lock file (still locked by the
    caller, so that no other training takes the file just before it goes)."""
    with contextlib.suppress(OSError):
        if [p.name for p in out_dir.iterdir()] == [".lock"]:
            (out_dir / ".lock").unlink()
            out_dir.rmdir()


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
    precision = resolve_precision(cfg.train.precision, device)
    if precision != cfg.train.precision:
        logger.info("train.precision=auto: %s on this %s", precision, device.type)
        cfg = replace_section(cfg, "train", precision=precision)
    if cfg.train.threads:
        torch.set_num_threads(cfg.train.threads)
    seed_everything(cfg.train.seed)
    payload = load_checkpoint(resume) if resume else None
    if payload is not None:
        _check_resume_config(cfg, payload, resume)
    initial = _load_init(cfg, init) if init else None
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

    model = build_model(cfg.model, len(vocab)).to(device)
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
        logger.info("weights from %s (epoch %d); fresh optimiser and schedule", init,
                    int(initial.get("epoch", 0)))  # fmt: skip
    if payload is not None:
        try:
            run.load_state_dict(payload, resume)
        except (RuntimeError, KeyError, ValueError, TypeError, IndexError) as exc:
            first = " ".join(str(exc).split())[:200] or type(exc).__name__
            raise CheckpointError(
                f"{resume}: its training state does not fit this run ({first})"
            ) from exc
        logger.info("resumed from %s after epoch %d (step %d)", resume, run.progress.epoch,
                    run.progress.step)  # fmt: skip
    module: nn.Module = model
    if world.enabled:
        module = DistributedDataParallel(
            model, device_ids=[device.index] if device.type == "cuda" else None
        )
    return Setup(run, module, loader, sampler, datasets["val"])


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


def _check_run_dir(out_dir: Path, resume: str | None) -> None:
    if resume is None and (out_dir / "last.pt").exists():
        raise CaptioningError(
            f"run folder {out_dir} already holds a run; continue it with "
            f"--resume {out_dir / 'last.pt'}, or choose another --out"
        )


# What may differ from the checkpoint's config when a run resumes: where the data is and how
# it is read, how long the run goes on, what it logs and how it validates. Everything else
# (the model, the data's content, the optimiser, the schedule, the objective, the seed) would
# not continue the same run, so a difference is refused by name.
SAFE_ON_RESUME = frozenset({
    "data.root", "data.num_workers", "data.check_images", "data.cache_images",
    "data.on_bad_image", "data.feature_cache", "data.max_image_pixels", "data.max_caption_length",
    "train.epochs", "train.early_stop_patience", "train.val_max_images", "train.val_every",
    "train.stop_on_nonfinite", "train.log_every", "train.figure_every_epoch", "train.quiet",
    "train.device", "train.threads",
})  # fmt: skip


# What --init may change in the model section: none of these changes a weight's shape or
# meaning (dropout, which layers train, where pretrained weights would have come from).
FREE_ON_INIT = frozenset({"model.dropout", "model.fine_tune", "model.weights"})


def _load_init(cfg: Config, path: str) -> dict[str, Any]:
    """The checkpoint ``--init`` starts from, refused in one line when its model section
    differs from ``cfg``'s (other than :data:`FREE_ON_INIT`)."""
    payload = load_checkpoint(path)
    try:
        saved = config_to_dict(config_from_dict(payload["config"]))["model"]
    except CaptioningError as exc:
        raise CheckpointError(f"{path}: its config does not load ({exc})") from exc
    ours = config_to_dict(cfg)["model"]
    changed = [k for k in saved if ours[k] != saved[k] and f"model.{k}" not in FREE_ON_INIT]
    if changed:
        key = changed[0]
        raise CheckpointError(
            f"{path}: model.{key} is {quote(saved[key])} in the checkpoint and "
            f"{quote(ours[key])} here; --init needs the same architecture (set "
            f"model.{key}={quote(saved[key])})"
        )
    return payload


def _check_resume_config(cfg: Config, payload: dict[str, Any], path: str) -> None:
    """Refuse to resume with a setting that differs from the checkpoint's, unless it is in
    :data:`SAFE_ON_RESUME` (or in the ``decode`` section, which only validation uses)."""
    check_resumable(payload, path)
    try:
        saved = config_to_dict(config_from_dict(payload["config"]))
    except CaptioningError as exc:
        raise CheckpointError(f"{path}: its config does not load ({exc})") from exc
    ours = config_to_dict(cfg)
    changed = [
        f"{section}.{key}"
        for section in ("data", "model", "train")
        for key, value in saved[section].items()
        if ours[section][key] != value and f"{section}.{key}" not in SAFE_ON_RESUME
    ]
    if changed:
        key = changed[0]
        section, name = key.split(".")
        raise CheckpointError(
            f"{path}: {key} is {quote(saved[section][name])} in the checkpoint and "
            f"{quote(ours[section][name])} here; a resumed run keeps it (start a new run to "
            f"change it){f'; also {len(changed) - 1} more' if len(changed) > 1 else ''}"
        )


# --------------------------------------------------------------------------- fit


def fit(
    cfg: Config, out_dir: str | Path, resume: str | None = None, init: str | None = None
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
            logger.info("data-parallel training: %d processes (%s), batch %d per process",
                        world.size, "nccl" if device.type == "cuda" else "gloo",
                        cfg.train.batch_size)  # fmt: skip
        with sigterm_raises(), _claim_run_dir(out_dir, resume, world):
            setup = set_up(cfg, resume, world, device, init)
            _train(setup, out_dir, device)
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
    logger.info("done in %.0fs: best %s %.3f at epoch %d; checkpoints in %s",
                summary["seconds"], cfg.train.select_metric, progress.best_score,
                progress.best_epoch, out_dir)  # fmt: skip
    return summary


def _validates(cfg: Config, epoch: int) -> bool:
    """Whether epoch number ``epoch`` (from 1) ends with a validation."""
    return epoch % cfg.train.val_every == 0 or epoch >= cfg.train.epochs


def _train(setup: Setup, out_dir: Path, device: torch.device) -> None:
    """The epoch loop, until ``train.epochs`` or early stopping."""
    run, cfg = setup.run, setup.run.cfg
    writer = None
    if run.world.is_main:
        save_config(cfg, out_dir / "config.yaml")
        from torch.utils.tensorboard import SummaryWriter

        writer = SummaryWriter(str(out_dir))
    patience = cfg.train.early_stop_patience
    try:
        while run.progress.epoch < cfg.train.epochs:
            if patience and run.progress.bad_epochs >= patience:
                logger.info("early stop: %s has not improved for %d validations",
                            cfg.train.select_metric, run.progress.bad_epochs)  # fmt: skip
                break
            epoch_start, first_step = time.time(), run.progress.step
            setup.sampler.set_epoch(run.progress.epoch)
            train_terms = train_one_epoch(run, setup.module, setup.loader, device, writer)
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
