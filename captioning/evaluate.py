"""Evaluate a checkpoint on a split: caption metrics, exact match, attention grounding."""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from captioning.api import CaptionModel, load
from captioning.config import Config, replace_section
from captioning.data import CaptionDataset, load_splits
from captioning.data.images import ImageLimits
from captioning.data.records import ImageRecord
from captioning.data.shapes import SHAPES
from captioning.errors import CaptioningError
from captioning.inference import decode_dataset
from captioning.metrics import AttentionMaps, score_predictions
from captioning.runtime import Writer, claim_folder, holds_only, write_atomically

logger = logging.getLogger("captioning")

# The entries of grounding_scores(); all of them go when no word was grounded.
GROUNDING_KEYS = ("pointing_game", "attention_in_box", "centre_pointing_game", "grounded_words",
                  "grounding_by_word_type")  # fmt: skip
TABLE_KEYS = ("Bleu_1", "Bleu_2", "Bleu_3", "Bleu_4", "METEOR", "ROUGE_L", "CIDEr", "SPICE",
              "exact_match", "pointing_game", "attention_in_box",
              "centre_pointing_game")  # fmt: skip
EVALUATE = Writer("evaluate", holds_only(("metrics.json", "predictions.json"), "metrics.json"))


def evaluate_checkpoint(
    checkpoint: str | Path,
    split: str = "test",
    beam_size: int | None = None,
    out_dir: str | Path | None = None,
    data_root: str | None = None,
    hard_context: str | None = None,
    max_images: int | None = None,
    spice: bool = False,
    meteor: bool = True,
    progress: bool = True,
    device: str = "auto",
) -> dict[str, Any]:
    """Decode ``split`` with a checkpoint and score it.

    Returns the metrics dict (also written to ``out_dir/metrics.json``, with the captions in
    COCO results format in ``out_dir/predictions.json``), without the metrics the data cannot
    support (see :func:`applicable_metrics`).

    Args:
        checkpoint: a ``best.pt`` / ``last.pt`` file.
        split: ``train``, ``val`` or ``test``.
        beam_size: beam search with this many beams; None keeps the checkpoint's decoding
            settings (greedy by default), 1 is greedy.
        out_dir: where to write the two json files (nothing is written without it): a new
            or empty folder, or one an earlier evaluation wrote (see
            :func:`captioning.runtime.claim_folder`); it is locked while in use.
        data_root: read the data from here instead of the checkpoint's ``data.root``.
        hard_context: for hard-attention models, ``expectation``, ``argmax`` or ``sample``.
        max_images: score only the first this many images of the split.
        spice: also compute SPICE (downloads Stanford models on first use).
        meteor: compute METEOR (a Java process); False skips it, and so does a
            ``data.language`` other than English (the key is then left out).
    """
    claim = contextlib.nullcontext() if out_dir is None else claim_folder(out_dir, EVALUATE)
    with claim:
        loaded = load(checkpoint, device)
        cfg = replace_section(loaded.decoding(beam_size, hard_context), "data", root=data_root)
        records = _records(cfg, split, max_images)
        predictions, details = _decode(loaded, cfg, records, split, progress)
        metrics = _score(loaded, cfg, records, predictions, details, meteor, spice)
        if out_dir is not None:
            write_results(Path(out_dir), metrics, predictions)
    return metrics


def _records(cfg: Config, split: str, max_images: int | None) -> list[ImageRecord]:
    splits = load_splits(cfg.data)
    if not splits.get(split):
        raise CaptioningError(f"split {split!r} has no images under {cfg.data.root}")
    return splits[split][:max_images] if max_images else splits[split]


def _decode(
    loaded: CaptionModel, cfg: Config, records: list[ImageRecord], split: str, progress: bool
) -> tuple[dict[int, str], Any]:
    """The caption of every readable image of ``records`` (by image id), and the details
    that attention grounding reads."""
    dataset = CaptionDataset(
        records,
        loaded.vocab,
        loaded.model.encoder.transform,
        skip_bad_images=cfg.data.on_bad_image == "skip",
        limits=ImageLimits.from_config(cfg.data),
    )
    with torch.random.fork_rng():
        torch.manual_seed(cfg.runtime.seed)  # sampled decoding is reproducible
        return decode_dataset(loaded.model, dataset, cfg, loaded.device, progress=progress,
                              desc=f"decoding {split}")  # fmt: skip


def _score(
    loaded: CaptionModel,
    cfg: Config,
    records: list[ImageRecord],
    predictions: dict[int, str],
    details: Any,
    meteor: bool,
    spice: bool,
) -> dict[str, Any]:
    attention = AttentionMaps(details, loaded.vocab, loaded.model.grid_shape)
    english = _is_english(cfg.data.language, meteor)
    metrics = score_predictions(
        predictions, records, meteor=meteor and english, spice=spice, attention=attention
    )
    if not english:
        metrics.pop("METEOR", None)
    metrics = applicable_metrics(metrics, [r for r in records if r.image_id in predictions])
    metrics["num_images"] = len(predictions)
    metrics["decoding"] = {
        "strategy": cfg.decode.strategy,
        "beam_size": cfg.decode.beam_size if cfg.decode.strategy == "beam" else 1,
        "hard_context": cfg.decode.hard_context if loaded.model.hard_attention else None,
        "precision": cfg.runtime.precision,
    }
    return metrics


def write_results(out: Path, metrics: dict[str, Any], predictions: dict[int, str]) -> None:
    """``metrics.json`` and ``predictions.json`` (COCO results format) in ``out``, each
    written atomically: a kill or a full disk never leaves half of one."""
    # UTF-8 with the letters themselves: a Vietnamese caption stays readable in the file.
    write_atomically(out / "metrics.json", json.dumps(metrics, indent=2, ensure_ascii=False)
                     + "\n")  # fmt: skip
    results = [{"image_id": i, "caption": c} for i, c in sorted(predictions.items())]
    write_atomically(out / "predictions.json", json.dumps(results, indent=1, ensure_ascii=False)
                     + "\n")  # fmt: skip


def _is_english(language: str, meteor: bool) -> bool:
    """Whether captions in ``language`` (``data.language``) are English, which METEOR needs;
    says so once when METEOR was asked for and does not apply."""
    english = language.split("-")[0].lower() == "en"
    if meteor and not english:
        logger.info("METEOR is English-only: not computed for data.language=%s", language)
    return english


def is_shapes(records: Sequence[ImageRecord]) -> bool:
    """Whether ``records`` are synthetic shapes images: every object a shape with the colour
    and size the generator annotates. Only their captions say how many objects there are."""
    objects = [o for r in records for o in r.objects]
    return bool(objects) and all(
        o.category in SHAPES and {"color", "size"} <= o.attributes.keys() for o in objects
    )


def applicable_metrics(metrics: dict[str, Any], records: Sequence[ImageRecord]) -> dict[str, Any]:
    """``metrics`` without the entries that the data ``records`` cannot support.

    Exact match by object count stays only for shapes data (see :func:`is_shapes`); the
    grounding scores (pointing game, attention in the box, per word type) stay only when some
    generated word named an annotated object, which needs instance boxes and captions in the
    words the grounding knows (COCO's English category names and synonyms, the shapes words).

    Args:
        metrics: the dict of :func:`captioning.metrics.score_predictions` for ``records``.
        records: the scored images.
    """
    kept = dict(metrics)
    if not is_shapes(records):
        kept.pop("exact_match_by_objects", None)
    if not kept.get("grounded_words"):
        if any(r.objects for r in records):
            logger.info(
                "no generated word named an annotated object: no attention grounding scores"
            )
        for key in GROUNDING_KEYS:
            kept.pop(key, None)
    elif "grounding_by_word_type" in kept:
        by_type = {k: v for k, v in kept["grounding_by_word_type"].items() if v is not None}
        kept["grounding_by_word_type"] = by_type
    return {k: v for k, v in kept.items() if k not in GROUNDING_KEYS or v is not None}


def format_table(metrics: dict[str, Any]) -> str:
    """The metrics as an aligned two-column table."""
    lines = [f"{'images':<22}{metrics['num_images']}"]
    for key in TABLE_KEYS:
        if key in metrics:
            value = metrics[key]
            lines.append(f"{key:<22}{'missing' if value is None else f'{value:.4f}'}")
    for count, value in metrics.get("exact_match_by_objects", {}).items():
        lines.append(f"{'exact_match ' + count + ' obj':<22}{value:.4f}")
    for key, value in sorted(metrics.get("grounding_by_word_type", {}).items()):
        shown = "missing" if value is None else value if isinstance(value, int) else f"{value:.4f}"
        lines.append(f"{key:<28}{shown}")
    return "\n".join(lines)
