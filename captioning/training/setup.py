"""What a training run starts from: the config's precisions resolved, the splits and the
vocabulary, the model (wrapped for data-parallel training), the loaders and the
:class:`~captioning.training.run_state.Run`, fresh, resumed or started from another run's
weights."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader

from captioning.checkpoint import load_checkpoint
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
    World,
)
from captioning.errors import CaptioningError
from captioning.inference.caption import load_weights
from captioning.metrics.words import load_category_words
from captioning.models import Captioner, build_model
from captioning.models.word_maps import category_classes, category_words_mask
from captioning.runtime import resolve_precision, seed_everything
from captioning.training.run_state import Run, check_resume_config, load_init, resume_run

logger = logging.getLogger("captioning")


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
    if cfg.model.word_map_classes == "categories":
        words = load_category_words(cfg.model.word_map_categories)
        model.word_maps.tie(category_classes(vocab.itos, words).to(device))
        if cfg.model.word_attention_words == "categories":
            score = model.decoder.attention.score
            score.look_at(category_words_mask(vocab.itos, words).to(device))
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
