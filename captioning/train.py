"""Training: ``fit(cfg)`` reads top to bottom as set-up, ``train_one_epoch``, ``evaluate``.

Model selection uses metrics of generated (greedy) captions on the validation split, never
teacher-forced accuracy. Checkpoints (``last.pt`` every epoch, ``best.pt`` on improvement)
hold plain data and everything needed to continue exactly where a run stopped.
"""

from __future__ import annotations

import contextlib
import logging
import math
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Subset
from tqdm import tqdm

from captioning.checkpoint import load_checkpoint, rng_state, save_checkpoint, set_rng_state
from captioning.config import Config, config_from_dict, config_to_dict, save_config
from captioning.data import CaptionBatchSampler, CaptionDataset, collate, drop_bad_images
from captioning.data.build import load_splits
from captioning.data.records import ImageRecord
from captioning.decoding import Decoded, decode
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
from captioning.features import find_caches
from captioning.losses import LossTerms, MovingAverageBaseline, caption_loss
from captioning.models import Captioner, build_model
from captioning.vocab import Vocabulary

logger = logging.getLogger("captioning")


class TrainingError(CaptioningError):
    """Training cannot go on (for example a non-finite loss)."""


# --------------------------------------------------------------------------- set-up helpers


def resolve_device(name: str) -> torch.device:
    """``auto`` picks CUDA when present, else CPU; any other name is used as given."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise CaptioningError(f"train.device={name} but CUDA is not available; use cpu or auto")
    return device


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def autocast(device: torch.device, precision: str) -> contextlib.AbstractContextManager:
    """Mixed precision for the forward pass; fp32 is a no-op."""
    if precision == "fp32":
        return contextlib.nullcontext()
    dtype = torch.bfloat16 if precision == "bf16" else torch.float16
    return torch.autocast(device_type=device.type, dtype=dtype)


def build_vocab(records: list[ImageRecord], cfg: Config) -> Vocabulary:
    """The vocabulary of the training split only."""
    return Vocabulary.build(
        (c for r in records for c in r.captions), cfg.data.min_count, cfg.data.max_vocab
    )


def build_optimizer(model: Captioner, cfg: Config) -> torch.optim.Optimizer:
    """Adam with separate learning rates for encoder and decoder."""
    encoder_params = [p for p in model.encoder.parameters() if p.requires_grad]
    groups = [{"params": list(model.decoder.parameters()), "lr": cfg.train.lr, "name": "decoder"}]
    if encoder_params:
        groups.append({"params": encoder_params, "lr": cfg.train.encoder_lr, "name": "encoder"})
    return torch.optim.Adam(groups, weight_decay=cfg.train.weight_decay)


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: Config, steps_per_epoch: int) -> Any:
    """Plateau (on the validation metric) and step schedules act once per epoch; cosine decay
    (with optional linear warm-up) acts after every optimiser step."""
    if cfg.train.schedule == "cosine":
        total = max(cfg.train.epochs * steps_per_epoch, 1)
        warmup = cfg.train.warmup_steps

        def multiplier(step: int) -> float:
            if step < warmup:
                return (step + 1) / warmup
            progress = (step - warmup) / max(total - warmup, 1)
            return 0.5 * (1.0 + math.cos(math.pi * min(progress, 1.0)))

        return torch.optim.lr_scheduler.LambdaLR(optimizer, multiplier)
    if cfg.train.schedule == "plateau":
        return torch.optim.lr_scheduler.ReduceLROnPlateau(
            optimizer, mode="max", factor=cfg.train.lr_factor, patience=cfg.train.lr_patience
        )
    if cfg.train.schedule == "step":
        return torch.optim.lr_scheduler.StepLR(
            optimizer, step_size=cfg.train.lr_step, gamma=cfg.train.lr_factor
        )
    return None


def decode_dataset(
    model: Captioner,
    dataset: CaptionDataset,
    cfg: Config,
    device: torch.device,
    batch_size: int | None = None,
    progress: bool = False,
    desc: str = "decoding",
    world: World = SINGLE,
) -> tuple[dict[int, str], dict[int, Decoded]]:
    """Captions for every image of ``dataset`` with the config's decoding settings.

    Returns ``{image_id: caption}`` and, per image id, its single-image :class:`Decoded`
    slice (tokens, attention maps) for figures and grounding. With several processes each
    decodes every ``world.size``-th image, starting at its rank.
    """
    shard = dataset
    if world.enabled:
        shard = Subset(dataset, range(world.rank, len(dataset), world.size))
    loader = DataLoader(
        shard,
        batch_size=batch_size or cfg.train.batch_size,
        shuffle=False,
        collate_fn=collate,
        num_workers=cfg.data.num_workers,
        pin_memory=device.type == "cuda",
    )
    model.eval()
    captions: dict[int, str] = {}
    details: dict[int, Decoded] = {}
    with torch.no_grad(), autocast(device, cfg.train.precision):
        for batch in tqdm(loader, desc=desc, disable=not progress, leave=False):
            if batch is None:
                continue
            features = model.features(  # (B, L, D)
                images=batch["images"].to(device) if "images" in batch else None,
                grid=batch["grid"].to(device) if "grid" in batch else None,
            )
            decoded = decode(model.decoder, features, cfg.decode)
            texts = decoded.captions(dataset.vocab)
            for row, index in enumerate(batch["indices"].tolist()):
                image_id = dataset.records[index].image_id
                captions[image_id] = texts[row]
                details[image_id] = Decoded(
                    tokens=decoded.tokens[row].cpu(),
                    lengths=decoded.lengths[row].cpu(),
                    alphas=decoded.alphas[row].float().cpu(),
                    scores=decoded.scores[row].cpu(),
                    cells=None if decoded.cells is None else decoded.cells[row].cpu(),
                )
    return captions, details


def score_predictions(
    predictions: dict[int, str], records: list[ImageRecord], full: bool = False
) -> dict[str, float | None]:
    """Validation metrics of generated captions: BLEU, ROUGE-L, CIDEr-D and exact match
    (METEOR too with ``full``; it costs a Java process)."""
    from captioning.metrics import caption_metrics, exact_match

    references = {r.image_id: list(r.captions) for r in records if r.image_id in predictions}
    scores = caption_metrics(predictions, references, meteor=full)
    scores["exact_match"] = exact_match(predictions, references)
    return scores


# --------------------------------------------------------------------------- state


@dataclass
class TrainState:
    """Counters that a checkpoint carries besides the weights."""

    epoch: int = 0  # epochs completed
    step: int = 0
    best_score: float = -math.inf
    best_epoch: int = 0
    bad_epochs: int = 0
    history: list[dict[str, float]] = field(default_factory=list)


def make_checkpoint(
    model: Captioner,
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    baseline: MovingAverageBaseline,
    scaler: torch.amp.GradScaler | None,
    state: TrainState,
    cfg: Config,
    vocab: Vocabulary,
) -> dict[str, Any]:
    return {
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "scheduler": scheduler.state_dict() if scheduler is not None else None,
        "scaler": scaler.state_dict() if scaler is not None else None,
        "baseline": baseline.state_dict(),
        "epoch": state.epoch,
        "step": state.step,
        "best_score": state.best_score,
        "best_epoch": state.best_epoch,
        "bad_epochs": state.bad_epochs,
        "history": state.history,
        "config": config_to_dict(cfg),
        "vocab": vocab.to_list(),
        "rng": rng_state(),
    }


def load_model(
    path: str | Path, device: str | torch.device = "cpu"
) -> tuple[Captioner, Config, Vocabulary]:
    """A model rebuilt from nothing but its checkpoint, in eval mode."""
    payload = load_checkpoint(path)
    try:
        cfg = config_from_dict(payload["config"])
    except CaptioningError as exc:
        raise CheckpointError(f"{path}: its config does not load ({exc})") from exc
    vocab = Vocabulary(payload["vocab"])
    model = build_model(cfg.model, len(vocab))
    try:
        model.load_state_dict(payload["model"])
    except RuntimeError as exc:
        first = str(exc).splitlines()[0]
        raise CheckpointError(f"{path}: weights do not fit its own config ({first})") from exc
    return model.to(device).eval(), cfg, vocab


# --------------------------------------------------------------------------- one epoch


def semi_sampling_kwargs(
    p: float,
    granularity: str,
    batch_size: int,
    device: torch.device,
    generator: torch.Generator | None = None,
) -> dict[str, Any]:
    """The paper's mix of hard and soft minibatches: with probability ``p`` a minibatch
    (``granularity="batch"``, as the authors) or each caption (``"sample"``) is trained with
    sampled cells, otherwise with the expected context. p=0 never samples, p=1 always does.
    The minibatch coin uses ``generator`` when given (training seeds it with the step, so
    every DDP process makes the same choice for its slice of the global batch).
    """
    if granularity == "batch":
        coin = float(torch.rand((), generator=generator))
        return {"mode": "sample" if coin < p else "expectation"}
    use_expectation = torch.rand(batch_size) >= p  # (B,)
    return {"mode": "sample", "use_expectation": use_expectation.to(device)}


def train_one_epoch(
    model: Captioner,
    loader: DataLoader,
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    baseline: MovingAverageBaseline,
    scaler: torch.amp.GradScaler | None,
    cfg: Config,
    device: torch.device,
    state: TrainState,
    writer: Any = None,
    world: World = SINGLE,
) -> dict[str, float]:
    """One pass over the training data; returns the epoch's mean loss terms (averaged over
    the processes when there are several).

    ``model`` may be wrapped in DistributedDataParallel; its gradients are then averaged
    over the processes during ``backward``.
    """
    model.train()
    hard = cfg.model.attention == "hard"
    totals: dict[str, float] = {"loss": 0.0, "nll_per_token": 0.0, "penalty": 0.0}
    batches = 0
    bar = tqdm(
        loader,
        desc=f"epoch {state.epoch + 1}",
        disable=cfg.train.quiet or not world.is_main,
        leave=False,
        ncols=100,
    )
    for batch in bar:
        if batch is None:
            continue
        images = batch["images"].to(device, non_blocking=True) if "images" in batch else None
        grid = batch["grid"].to(device, non_blocking=True) if "grid" in batch else None
        tokens = batch["tokens"].to(device, non_blocking=True)
        kwargs = {}
        if hard:
            coin = torch.Generator().manual_seed(cfg.train.seed * 1_000_003 + state.step)
            kwargs = semi_sampling_kwargs(
                cfg.train.semi_sampling_p, cfg.train.semi_sampling, tokens.shape[0], device, coin
            )
        with autocast(device, cfg.train.precision):
            output = model(images, tokens, grid=grid, **kwargs)
        terms: LossTerms = caption_loss(
            output,
            tokens[:, 1:],
            Vocabulary.pad_id,
            penalty_weight=cfg.train.doubly_stochastic,
            baseline=baseline,
            reinforce_weight=cfg.train.reinforce_weight,
            entropy_weight=cfg.train.entropy_weight,
        )
        if any_rank(world, not bool(torch.isfinite(terms.total)), device):
            message = (
                f"non-finite loss at step {state.step + 1} (epoch {state.epoch + 1}); "
                f"the last good checkpoint is kept; try a lower train.lr or train.precision=fp32"
            )
            if cfg.train.stop_on_nonfinite:
                raise TrainingError(message)
            logger.warning("skipping batch: %s", message)
            optimizer.zero_grad(set_to_none=True)
            continue
        optimizer.zero_grad(set_to_none=True)
        if scaler is not None:
            scaler.scale(terms.total).backward()
            scaler.unscale_(optimizer)
        else:
            terms.total.backward()
        params = [p for group in optimizer.param_groups for p in group["params"]]
        grad_norm = torch.nn.utils.clip_grad_norm_(
            params, cfg.train.grad_clip if cfg.train.grad_clip > 0 else float("inf")
        )
        if scaler is not None:
            scaler.step(optimizer)
            scaler.update()
        else:
            optimizer.step()
        if isinstance(scheduler, torch.optim.lr_scheduler.LambdaLR):
            scheduler.step()
        state.step += 1
        batches += 1
        totals["loss"] += float(terms.total.detach())
        totals["nll_per_token"] += float(terms.nll_per_token)
        totals["penalty"] += float(terms.penalty)
        if hard:
            totals["reward"] = totals.get("reward", 0.0) + float(terms.reward)
            totals["entropy"] = totals.get("entropy", 0.0) + float(terms.entropy)
        bar.set_postfix(
            loss=f"{totals['loss'] / batches:.3f}", nll=f"{float(terms.nll_per_token):.3f}"
        )
        if writer is not None and state.step % cfg.train.log_every == 0:  # rank 0 only
            writer.add_scalar("train/loss", float(terms.total.detach()), state.step)
            writer.add_scalar("train/nll_per_token", float(terms.nll_per_token), state.step)
            writer.add_scalar("train/attention_penalty", float(terms.penalty), state.step)
            writer.add_scalar("train/grad_norm", float(grad_norm), state.step)
            for group in optimizer.param_groups:
                writer.add_scalar(f"lr/{group.get('name', 'group')}", group["lr"], state.step)
            if hard:
                writer.add_scalar("train/reward", float(terms.reward), state.step)
                writer.add_scalar("train/baseline", baseline.value, state.step)
                writer.add_scalar("train/attention_entropy", float(terms.entropy), state.step)
    return mean_over_ranks(world, {k: v / max(batches, 1) for k, v in totals.items()}, device)


def evaluate(
    model: Captioner,
    dataset: CaptionDataset,
    cfg: Config,
    device: torch.device,
    full: bool = False,
    world: World = SINGLE,
) -> tuple[dict[str, float | None], dict[int, str], dict[int, Decoded]]:
    """Decode ``dataset`` and score the generated captions against its references.

    With several processes each decodes its share; the captions are gathered and scored
    once, on rank 0, and every rank gets the same scores. ``details`` holds this process's
    share only.
    """
    predictions, details = decode_dataset(
        model,
        dataset,
        cfg,
        device,
        progress=not cfg.train.quiet and world.is_main,
        desc="validating",
        world=world,
    )
    if world.enabled:
        predictions = {k: v for part in gather_objects(world, predictions) for k, v in part.items()}
    if not predictions:
        raise TrainingError("no validation image could be decoded")
    scores = score_predictions(predictions, dataset.records, full=full) if world.is_main else None
    return broadcast_object(world, scores), predictions, details


def _attention_figure(
    model: Captioner, dataset: CaptionDataset, details: dict[int, Decoded], path: Path
) -> None:
    from captioning.data.images import load_image
    from captioning.viz import attention_grid_figure

    record = dataset.records[0]
    decoded = details.get(record.image_id)
    if decoded is None:
        return
    length = int(decoded.lengths)
    words = dataset.vocab.decode_tokens(decoded.tokens[:length].tolist()) + ["<end>"]
    alphas = decoded.alphas[: length + 1]
    words = words[: alphas.shape[0]]
    cells = None if decoded.cells is None else decoded.cells[: len(words)].tolist()
    attention_grid_figure(
        load_image(record.path), words, alphas, model.grid, path, chosen_cells=cells
    )


# --------------------------------------------------------------------------- fit


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


def _check_resume_config(cfg: Config, payload: dict[str, Any], path: str) -> None:
    saved = config_from_dict(payload["config"])
    if saved.model != cfg.model:
        diffs = [
            f"model.{k}: {v!r} (checkpoint) vs {getattr(cfg.model, k)!r}"
            for k, v in vars(saved.model).items()
            if getattr(cfg.model, k) != v
        ]
        raise CheckpointError(f"{path}: model config differs from this run's: {diffs[0]}")


def fit(
    cfg: Config, out_dir: str | Path | None = None, resume: str | None = None
) -> dict[str, Any]:
    """Train a model as ``cfg`` says; write ``config.yaml``, checkpoints, TensorBoard events
    and per-epoch attention figures into ``out_dir``. Returns a summary dict.

    Launched by ``torchrun`` with several processes, it trains data-parallel (see
    :mod:`captioning.distributed`); ``train.batch_size`` is then the batch of each process.
    """
    world, device = init_world(cfg.train.device)
    try:
        return _fit(cfg, out_dir, resume, world, device)
    finally:
        close_world(world)


def _fit(
    cfg: Config,
    out_dir: str | Path | None,
    resume: str | None,
    world: World,
    device: torch.device,
) -> dict[str, Any]:
    started = time.time()
    out_dir = Path(out_dir) if out_dir else Path("runs") / "run"
    _check_run_dir(out_dir, resume)
    if not world.is_main:
        logger.setLevel(logging.WARNING)  # one process speaks
    elif world.enabled:
        logger.info("data-parallel training: %d processes (%s), batch %d per process",
                    world.size, "nccl" if device.type == "cuda" else "gloo",
                    cfg.train.batch_size)  # fmt: skip
    if cfg.train.threads:
        torch.set_num_threads(cfg.train.threads)
    seed_everything(cfg.train.seed)
    payload = load_checkpoint(resume) if resume else None
    if payload is not None:
        _check_resume_config(cfg, payload, resume)

    # data
    splits = load_splits(cfg.data)
    for split in ("train", "val"):
        if not splits.get(split):
            raise CaptioningError(f"the {split} split has no images (check data.splits)")
    if cfg.data.check_images:
        drop_bad_images(splits, cfg.data, progress=not cfg.train.quiet and world.is_main)
    vocab = Vocabulary(payload["vocab"]) if payload else build_vocab(splits["train"], cfg)
    logger.info("vocabulary: %d words (from the training split)", len(vocab))

    # model
    model = build_model(cfg.model, len(vocab)).to(device)
    if world.enabled:
        model = _sync_batchnorm(model, device)
    num_params = sum(p.numel() for p in model.parameters() if p.requires_grad)
    logger.info(
        "model: %s encoder, %s attention (%s), grid %dx%d, %.2fM trainable parameters",
        cfg.model.encoder,
        cfg.model.attention,
        cfg.model.score,
        *model.grid,
        num_params / 1e6,
    )
    if cfg.train.val_max_images:
        splits["val"] = splits["val"][: cfg.train.val_max_images]
    caches = find_caches(cfg, model.encoder, ["train", "val"])
    datasets = {
        split: CaptionDataset(
            splits[split],
            vocab,
            model.encoder.transform,
            max_length=cfg.data.max_caption_length,
            skip_bad_images=cfg.data.on_bad_image == "skip",
            cache_images=cfg.data.cache_images,
            features=caches[split],
        )
        for split in ("train", "val")
    }
    val_dataset = datasets["val"]
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

    optimizer = build_optimizer(model, cfg)
    scheduler = build_scheduler(optimizer, cfg, len(sampler))
    scaler = torch.amp.GradScaler(device.type) if cfg.train.precision == "fp16" else None
    baseline = MovingAverageBaseline(cfg.train.baseline_decay)
    state = TrainState()
    if payload is not None:
        model.load_state_dict(payload["model"])
        optimizer.load_state_dict(payload["optimizer"])
        if scheduler is not None and payload.get("scheduler") is not None:
            scheduler.load_state_dict(payload["scheduler"])
        if scaler is not None and payload.get("scaler") is not None:
            scaler.load_state_dict(payload["scaler"])
        baseline.load_state_dict(payload["baseline"])
        state = TrainState(
            epoch=payload["epoch"],
            step=payload["step"],
            best_score=payload["best_score"],
            best_epoch=payload["best_epoch"],
            bad_epochs=payload["bad_epochs"],
            history=list(payload["history"]),
        )
        ranks = payload.get("rng_ranks")
        set_rng_state(ranks[world.rank] if ranks and len(ranks) == world.size else payload["rng"])
        logger.info("resumed from %s after epoch %d (step %d)", resume, state.epoch, state.step)

    trained = model  # what the loop calls: the model itself, or its DDP wrapper
    if world.enabled:
        trained = DistributedDataParallel(
            model, device_ids=[device.index] if device.type == "cuda" else None
        )
    writer = None
    if world.is_main:
        out_dir.mkdir(parents=True, exist_ok=True)
        save_config(cfg, out_dir / "config.yaml")
        from torch.utils.tensorboard import SummaryWriter

        writer = SummaryWriter(str(out_dir))
    metric = cfg.train.select_metric
    try:
        while state.epoch < cfg.train.epochs:
            if cfg.train.early_stop_patience and state.bad_epochs >= cfg.train.early_stop_patience:
                logger.info("early stop: %s has not improved for %d epochs", metric,
                            state.bad_epochs)  # fmt: skip
                break
            epoch_start = time.time()
            sampler.set_epoch(state.epoch)
            train_terms = train_one_epoch(
                trained,
                loader,
                optimizer,
                scheduler,
                baseline,
                scaler,
                cfg,
                device,
                state,
                writer,
                world,
            )
            scores, _, details = evaluate(model, val_dataset, cfg, device, world=world)
            state.epoch += 1
            score = float(scores[metric] or 0.0)
            improved = score > state.best_score
            if improved:
                state.best_score, state.best_epoch, state.bad_epochs = score, state.epoch, 0
            else:
                state.bad_epochs += 1
            if isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau):
                scheduler.step(score)
            elif isinstance(scheduler, torch.optim.lr_scheduler.StepLR):
                scheduler.step()
            seconds = time.time() - epoch_start
            record = {"epoch": state.epoch, "seconds": seconds, **train_terms}
            record.update({f"val_{k}": float(v) for k, v in scores.items() if v is not None})
            state.history.append(record)
            # Every rank's RNG goes into the checkpoint, so a resumed run continues exactly.
            rng_ranks = gather_objects(world, rng_state())
            if world.is_main:
                for key, value in scores.items():
                    if value is not None:
                        writer.add_scalar(f"val/{key}", float(value), state.step)
                if cfg.train.figure_every_epoch:
                    figure = out_dir / "figures" / f"epoch_{state.epoch:03d}.png"
                    _attention_figure(model, val_dataset, details, figure)
                checkpoint = make_checkpoint(
                    model, optimizer, scheduler, baseline, scaler, state, cfg, vocab
                )
                if world.enabled:
                    checkpoint["rng_ranks"] = rng_ranks
                save_checkpoint(checkpoint, out_dir / "last.pt")
                if improved:
                    save_checkpoint(checkpoint, out_dir / "best.pt")
            logger.info(
                "epoch %d/%d  loss %.3f  nll/word %.3f  val %s %.3f  BLEU-4 %.3f  exact %.3f  "
                "lr %.2g  %.0fs%s",
                state.epoch,
                cfg.train.epochs,
                train_terms["loss"],
                train_terms["nll_per_token"],
                metric,
                score,
                scores.get("Bleu_4") or 0.0,
                scores.get("exact_match") or 0.0,
                optimizer.param_groups[0]["lr"],
                seconds,
                "  *best*" if improved else "",
            )
    finally:
        if writer is not None:
            writer.close()
    summary = {
        "out_dir": str(out_dir),
        "best_score": state.best_score,
        "best_epoch": state.best_epoch,
        "select_metric": metric,
        "epochs": state.epoch,
        "steps": state.step,
        "seconds": time.time() - started,
        "history": state.history,
    }
    logger.info(
        "done in %.0fs: best %s %.3f at epoch %d; checkpoints in %s",
        summary["seconds"],
        metric,
        state.best_score,
        state.best_epoch,
        out_dir,
    )
    return summary
