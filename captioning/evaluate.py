"""Evaluate a checkpoint on a split: caption metrics, exact match, attention grounding.

The data, decoding and runtime sections of the checkpoint's config may be overridden
(``--set data.root=...``), so a model is scored on another data set as well as its own: a
Flickr8k model on COCO files, with their object boxes. Data with instance boxes also gets
``grounding.json``: the pointing game and the attention mass in the boxes of every word that
names a category of the image, against baseline maps (:mod:`captioning.metrics.pointing`).
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader

from captioning.api import CaptionModel, load
from captioning.config import Config, config_from_dict, config_to_dict, parse_override, quote
from captioning.data import CaptionDataset, collate, load_splits
from captioning.data.images import ImageLimits
from captioning.data.records import ImageRecord
from captioning.data.shapes import SHAPES
from captioning.errors import CaptioningError, ConfigError
from captioning.files import write_atomically
from captioning.folders import Writer, claim_folder, holds_only
from captioning.inference.caption import decode_dataset
from captioning.metrics import AttentionMaps, score_predictions
from captioning.metrics.pointing import PointingTally, category_grounding
from captioning.metrics.words import load_category_words, shipped_category_words
from captioning.runtime import autocast

logger = logging.getLogger("captioning")

# The entries of grounding_scores(); all of them go when no word was grounded.
GROUNDING_KEYS = (
    "pointing_game",
    "attention_in_box",
    "centre_pointing_game",
    "grounded_words",
    "grounding_by_word_type",
)
TABLE_KEYS = (
    "Bleu_1",
    "Bleu_2",
    "Bleu_3",
    "Bleu_4",
    "METEOR",
    "ROUGE_L",
    "CIDEr",
    "SPICE",
    "exact_match",
    "pointing_game",
    "attention_in_box",
    "centre_pointing_game",
)
EVALUATE = Writer("evaluate", holds_only(("metrics.json", "predictions.json"), "metrics.json"))
# The config sections an evaluation may change: what is read, how it decodes, how it runs.
OVERRIDABLE = ("data", "decode", "runtime")


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
    overrides: Sequence[str] = (),
    category_words: str | Path | None = None,
) -> dict[str, Any]:
    """Decode ``split`` with a checkpoint and score it.

    Returns the metrics dict (also written to ``out_dir/metrics.json``, with the captions in
    COCO results format in ``out_dir/predictions.json``), without the metrics the data cannot
    support (see :func:`applicable_metrics`). When the split has instance boxes, the
    grounding against them (:func:`captioning.metrics.pointing.category_grounding`) is
    written to ``out_dir/grounding.json`` and returned under ``metrics["grounding"]``.

    Args:
        checkpoint: a ``best.pt`` / ``last.pt`` file.
        split: ``train``, ``val`` or ``test``.
        beam_size: beam search with this many beams; None keeps the checkpoint's decoding
            settings (greedy by default), 1 is greedy.
        out_dir: where to write the two json files (nothing is written without it): a new
            or empty folder, or one an earlier evaluation wrote (see
            :func:`captioning.folders.claim_folder`); it is locked while in use.
        data_root: read the data from here instead of the checkpoint's ``data.root``.
        hard_context: for hard-attention models, ``expectation``, ``argmax`` or ``sample``.
        max_images: score only the first this many images of the split.
        spice: also compute SPICE (downloads Stanford models on first use).
        meteor: compute METEOR (a Java process); False skips it, and so does a
            ``data.language`` other than English (the key is then left out).
        device: where the network runs.
        overrides: ``section.key=value`` settings of the ``data``, ``decode`` and
            ``runtime`` sections over the checkpoint's (``data_root``, ``beam_size`` and
            ``hard_context`` are applied after them).
        category_words: a JSON or YAML file of word: category entries over the shipped map
            (:mod:`captioning.metrics.words`).
    """
    words = load_category_words(category_words)
    claim = contextlib.nullcontext() if out_dir is None else claim_folder(out_dir, EVALUATE)
    with claim:
        loaded = load(checkpoint, device)
        loaded.config = with_overrides(loaded.config, overrides, data_root)
        cfg = loaded.decoding(beam_size, hard_context)
        records = _records(cfg, split, max_images)
        predictions, details = _decode(loaded, cfg, records, split, progress)
        metrics = _score(loaded, cfg, records, predictions, details, meteor, spice)
        grounding = _grounding(loaded, cfg, records, details, words)
        if out_dir is not None:
            write_results(Path(out_dir), metrics, predictions, grounding)
    return metrics if grounding is None else {**metrics, "grounding": grounding}


def with_overrides(cfg: Config, overrides: Sequence[str], data_root: str | None = None) -> Config:
    """``cfg`` with ``section.key=value`` overrides of the sections an evaluation may change
    (:data:`OVERRIDABLE`), then ``data.root`` set to ``data_root`` when given.

    Raises:
        ConfigError: an override of another section, or one the config refuses (an unknown
            key, a wrong type), in one line.
    """
    values = config_to_dict(cfg)
    for text in [*overrides, *([f"data.root={data_root}"] if data_root else [])]:
        path, value = parse_override(text)
        if path[0] not in OVERRIDABLE or len(path) < 2:
            raise ConfigError(
                f"--set {quote(text)}: evaluate takes keys of the "
                f"{', '.join(OVERRIDABLE)} sections only; the model and its "
                "training come from the checkpoint"
            )
        node = values[path[0]]
        for part in path[1:-1]:
            if not isinstance(node.get(part), dict):
                raise ConfigError(
                    f"--set {quote(text)}: {'.'.join(path[:-1])} is no section of keys"
                )
            node = node[part]
        node[path[-1]] = value
    return config_from_dict(values)


def _records(cfg: Config, split: str, max_images: int | None) -> list[ImageRecord]:
    """The images of ``split``; only its own files are read (another data set may have no
    train split)."""
    if split not in cfg.data.splits:
        raise CaptioningError(
            f"split {split!r} is not in data.splits "
            f"({', '.join(cfg.data.splits) or 'none'}); name its folder with "
            f"--set data.splits.{split}=NAME"
        )
    data = type(cfg.data)(**{**vars(cfg.data), "splits": {split: cfg.data.splits[split]}})
    splits = load_splits(data)
    if not splits.get(split):
        raise CaptioningError(f"split {split!r} has no images under {cfg.data.root}")
    return splits[split][:max_images] if max_images else splits[split]


def _decode(
    loaded: CaptionModel, cfg: Config, records: list[ImageRecord], split: str, progress: bool
) -> tuple[dict[int, str], Any]:
    """The caption of every readable image of ``records`` (by image id), and the details
    that attention grounding reads."""
    dataset = _images(loaded, cfg, records)
    with torch.random.fork_rng():
        torch.manual_seed(cfg.runtime.seed)  # sampled decoding is reproducible
        return decode_dataset(
            loaded.model, dataset, cfg, loaded.device, progress=progress, desc=f"decoding {split}"
        )


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


def _grounding(
    loaded: CaptionModel,
    cfg: Config,
    records: list[ImageRecord],
    details: Any,
    words: dict[str, str],
) -> dict[str, Any] | None:
    """The grounding against category boxes, or None when no scored image has objects; a
    model with a word localiser also has the localiser's maps of its words scored."""
    scored = [r for r in records if r.objects and r.image_id in details]
    if not scored:
        return None
    present = {o.category for r in scored for o in r.objects}
    unknown = set(words.values()) - present - set(shipped_category_words().values())
    if unknown:
        logger.info(
            "the category words name categories no scored image has: %s", ", ".join(sorted(unknown))
        )
    tally = PointingTally(loaded.model.grid_shape, words)
    extra: dict[int, dict[str, torch.Tensor]] = {}
    for record, features in _encoded(loaded, cfg, scored):  # each photo encoded once
        if loaded.model.word_maps is not None:
            extra[record.image_id] = _localiser_maps(
                loaded, cfg, features, details[record.image_id]
            )
        _add_references(tally, loaded, cfg, record, features)
    report = category_grounding(
        scored, details, loaded.vocab, loaded.model.grid_shape, words, extra_maps=extra
    )
    return {**report, "references": tally.report()}


def _images(loaded: CaptionModel, cfg: Config, records: list[ImageRecord]) -> CaptionDataset:
    """The images of ``records`` as the model reads them (a bad one skipped or an error, as
    ``data.on_bad_image`` says)."""
    return CaptionDataset(
        records,
        loaded.vocab,
        loaded.model.encoder.transform,
        skip_bad_images=cfg.data.on_bad_image == "skip",
        limits=ImageLimits.from_config(cfg.data),
    )


def _encoded(
    loaded: CaptionModel, cfg: Config, records: list[ImageRecord]
) -> Iterator[tuple[ImageRecord, torch.Tensor]]:
    """Each readable record of ``records`` with its decoder features (1, L, D), encoded
    ``runtime.batch_size`` images at a time under ``runtime.precision``, without gradients."""
    dataset = _images(loaded, cfg, records)
    loader = DataLoader(dataset, batch_size=cfg.runtime.batch_size, collate_fn=collate)
    for batch in loader:
        if batch is None:
            continue
        with torch.no_grad(), autocast(loaded.device, cfg.runtime.precision):
            features = loaded.model.encode(batch["images"].to(loaded.device))  # (B, L, D)
        for row, index in enumerate(batch["indices"].tolist()):
            yield dataset.records[index], features[row : row + 1]


def reference_grounding(
    loaded: CaptionModel, cfg: Config, records: list[ImageRecord], words: dict[str, str]
) -> dict[str, Any]:
    """The grounding of the reference captions' words, teacher-forced: every reference of
    each image of ``records`` (with objects) is fed to the decoder word by word, and each
    word that names a category of the image is scored with the map the decoder attended
    with before saying it (and the localiser's map of it, for a model with one), against
    the same baselines as the generated words'. Every model is then scored on the same
    words, five captions an image rather than the one it chose to say.

    Returns :func:`captioning.metrics.pointing.category_grounding`'s report."""
    tally = PointingTally(loaded.model.grid_shape, words)
    for record, features in _encoded(loaded, cfg, records):
        _add_references(tally, loaded, cfg, record, features)
    return tally.report()


def _add_references(
    tally: PointingTally,
    loaded: CaptionModel,
    cfg: Config,
    record: ImageRecord,
    features: torch.Tensor,
) -> None:
    """Score the references of ``record``, teacher-forced on its ``features`` (1, L, D)."""
    model, vocab = loaded.model, loaded.vocab
    limit = cfg.data.max_caption_length
    captions = [vocab.encode(c)[1:-1][:limit] for c in record.captions]
    captions = [c for c in captions if c]
    if not captions:
        return
    tokens = torch.full((len(captions), max(map(len, captions)) + 2), vocab.pad_id)
    for k, caption in enumerate(captions):
        full = [vocab.start_id, *caption, vocab.end_id]
        tokens[k, : len(full)] = torch.tensor(full)
    tokens = tokens.to(loaded.device)
    with torch.no_grad(), autocast(loaded.device, cfg.runtime.precision):
        trace = model.decoder(features, tokens[:, :-1]).trace
        found = None
        if model.word_maps is not None:
            found = model.localiser_maps(features.expand(len(captions), -1, -1), tokens[:, 1:])
    for k, caption in enumerate(captions):
        n = len(caption)
        extra = None if found is None else {"localiser": found[k, :n].float().cpu()}
        tally.add_caption(vocab.decode_tokens(caption), trace[k, :n].portable(), record, extra)


def _localiser_maps(
    loaded: CaptionModel, cfg: Config, features: torch.Tensor, result: Any
) -> dict[str, torch.Tensor]:
    """The word localiser's map of each word ``result`` (a single image's decoding) said,
    over the image's ``features`` (1, L, D): ``{"localiser": (T, L)}``."""
    tokens = result.tokens[: int(result.lengths)].to(loaded.device)
    with torch.no_grad(), autocast(loaded.device, cfg.runtime.precision):
        found = loaded.model.localiser_maps(features, tokens[None])
    return {"localiser": found[0].float().cpu()}


def write_results(
    out: Path,
    metrics: dict[str, Any],
    predictions: dict[int, str],
    grounding: dict[str, Any] | None = None,
) -> None:
    """``metrics.json``, ``predictions.json`` (COCO results format) and, when given,
    ``grounding.json`` in ``out``, each written atomically: a kill or a full disk never
    leaves half of one."""
    # UTF-8 with the letters themselves: a Vietnamese caption stays readable in the file.
    write_atomically(out / "metrics.json", json.dumps(metrics, indent=2, ensure_ascii=False) + "\n")
    results = [{"image_id": i, "caption": c} for i, c in sorted(predictions.items())]
    write_atomically(
        out / "predictions.json", json.dumps(results, indent=1, ensure_ascii=False) + "\n"
    )
    if grounding is not None:
        write_atomically(out / "grounding.json", json.dumps(grounding, indent=1) + "\n")


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
