"""Inference: a model from its checkpoint, and the one path from images to captions.

:func:`caption_batch` is the only place where a batch is encoded and decoded: validation
during training, ``evaluate``, ``caption``, the quickstart and the benchmark all go through
it, so all of them decode under the same precision and the same decoding settings.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch
from PIL import Image
from torch import nn
from torch.utils.data import DataLoader, Subset

from captioning.checkpoint import load_checkpoint
from captioning.config import Config, DecodeConfig, config_from_dict, replace_section
from captioning.data import CaptionDataset, collate
from captioning.data.images import DEFAULT_LIMITS, ImageLimits, load_image
from captioning.decoding import Decoded, decode
from captioning.distributed import SINGLE, World
from captioning.errors import CaptioningError, CheckpointError, DataError
from captioning.models import Captioner, build_model
from captioning.progress import progress_bar
from captioning.runtime import autocast
from captioning.vocab import Vocabulary


def load_model(
    path: str | Path, device: str | torch.device = "cpu"
) -> tuple[Captioner, Config, Vocabulary]:
    """A model rebuilt from nothing but its checkpoint, in eval mode, with its config and
    vocabulary."""
    payload = load_checkpoint(path)
    cfg, vocab = checkpoint_config(payload, path)
    model = build_model(cfg.model, len(vocab), cfg.runtime)
    load_weights(model, payload, path)
    return model.to(device).eval(), cfg, vocab


def checkpoint_config(payload: dict[str, Any], path: str | Path) -> tuple[Config, Vocabulary]:
    """The config and vocabulary a checkpoint was trained with. The config's
    ``model.weights`` is cleared: the weights are in the checkpoint, and a checkpoint must
    never make the loader read another file."""
    values = dict(payload["config"])
    if isinstance(values.get("model"), dict):
        values["model"] = {**values["model"], "weights": None}
    try:
        cfg = config_from_dict(values)
        vocab = Vocabulary(payload["vocab"])
    except CaptioningError as exc:
        raise CheckpointError(f"{path}: its config or vocabulary does not load ({exc})") from exc
    return cfg, vocab


def load_weights(model: nn.Module, payload: dict[str, Any], path: str | Path) -> None:
    """Load a checkpoint's weights into ``model``, with a one-line error when they do not
    fit (another vocabulary size, another architecture)."""
    try:
        model.load_state_dict(payload["model"])
    except RuntimeError as exc:
        first = " ".join(str(exc).split())[:300]
        raise CheckpointError(
            f"{path}: its weights do not fit the model its config and vocabulary describe ({first})"
        ) from exc


def with_decoding(
    cfg: Config, beam_size: int | None = None, hard_context: str | None = None
) -> Config:
    """``cfg`` with the decoding asked for on a command line: ``beam_size`` 1 is greedy and
    more is beam search; ``hard_context`` is how a hard-attention model forms its context.
    None keeps the config's own setting."""
    if beam_size is not None:
        strategy = "greedy" if beam_size == 1 else "beam"
        cfg = replace_section(cfg, "decode", strategy=strategy, beam_size=beam_size)
    return replace_section(cfg, "decode", hard_context=hard_context)


@torch.no_grad()
def caption_batch(
    model: Captioner,
    decode_cfg: DecodeConfig,
    precision: str = "fp32",
    images: torch.Tensor | None = None,
    grid: torch.Tensor | None = None,
    encode_batch: int | None = None,
) -> Decoded:
    """Captions for a batch of ``images`` (B, 3, S, S), or of cached backbone grids
    (B, L, D), under ``precision`` (``runtime.precision`` of the run) and ``decode_cfg``.
    ``encode_batch`` encodes the images that many at a time (the decoding still runs on the
    whole batch; each image's features do not depend on the others'). The model should be
    in eval mode."""
    device = (images if images is not None else grid).device
    with autocast(device, precision):
        if images is not None and encode_batch is not None and encode_batch < len(images):
            features = torch.cat([model.encode(part) for part in images.split(encode_batch)])
        else:
            features = model.encode(images, grid)  # (B, L, D)
        return decode(model.decoder, features, decode_cfg)


@dataclass
class CaptionResult:
    """The outcome for one image: a caption (with its attention) or an error message."""

    image: str
    caption: str | None = None
    words: list[str] | None = None
    alphas: torch.Tensor | None = None  # (T, L), one map per word
    cells: list[int] | None = None  # hard attention: the chosen cell per word
    heads: torch.Tensor | None = None  # (T, H, L) multi-head attention: each head's maps
    centres: torch.Tensor | None = None  # (T, 2) local attention: (row, column) in cells
    figure: str | None = None
    gif: str | None = None
    error: str | None = None
    picture: Image.Image | None = None  # the RGB image as captioned, when it was kept

    @classmethod
    def from_decoded(cls, image: str, decoded: Decoded, vocab: Vocabulary) -> CaptionResult:
        """The result of one image from its single-image ``decoded`` (see
        :meth:`Decoded.row`): the caption's words, each with the map that produced it.
        ``<end>`` is no word of the caption, so its map is not shown."""
        length = int(decoded.lengths)
        words = vocab.decode_tokens(decoded.tokens[:length].tolist())
        cells = None if decoded.cells is None else decoded.cells[:length].tolist()

        def per_word(values: torch.Tensor | None) -> torch.Tensor | None:
            return None if values is None else values[:length].float().cpu()

        return cls(
            image=image,
            caption=" ".join(words),
            words=words,
            alphas=per_word(decoded.alphas),  # (T, L)
            cells=cells,
            heads=per_word(decoded.heads),  # (T, H, L)
            centres=per_word(decoded.centres),  # (T, 2)
        )


def decode_dataset(
    model: Captioner,
    dataset: CaptionDataset,
    cfg: Config,
    device: torch.device,
    batch_size: int | None = None,
    progress: bool = False,
    desc: str = "decoding",
    world: World = SINGLE,
    summary: bool = True,
) -> tuple[dict[int, str], dict[int, Decoded]]:
    """Captions for every image of ``dataset`` with the config's decoding settings, in
    batches of ``batch_size`` images (None: ``runtime.batch_size``) under
    ``runtime.precision``.

    ``progress`` shows a bar of images on a terminal, and elsewhere logs one line when the
    decoding ends (unless ``summary`` is False: training's epoch line reports validation).

    Returns ``{image_id: caption}`` and, per image id, its single-image :class:`Decoded`
    (tokens, attention maps) for figures and grounding. With several processes each
    decodes every ``world.size``-th image, starting at its rank.
    """
    shard = dataset
    if world.enabled:
        shard = Subset(dataset, range(world.rank, len(dataset), world.size))
    loader = DataLoader(
        shard,
        batch_size=batch_size or cfg.runtime.batch_size,
        shuffle=False,
        collate_fn=collate,
        num_workers=cfg.data.num_workers,
        pin_memory=device.type == "cuda",
    )
    model.eval()
    captions: dict[int, str] = {}
    details: dict[int, Decoded] = {}
    bar = progress_bar(desc=desc, total=len(shard), unit="img", enabled=progress,
                       summary=summary, leave=False)  # fmt: skip
    for batch in loader:
        if batch is None:
            continue
        decoded = caption_batch(
            model,
            cfg.decode,
            cfg.runtime.precision,
            images=batch["images"].to(device) if "images" in batch else None,
            grid=batch["grid"].to(device) if "grid" in batch else None,
        )
        texts = decoded.captions(dataset.vocab)
        for row, index in enumerate(batch["indices"].tolist()):
            image_id = dataset.records[index].image_id
            captions[image_id] = texts[row]
            details[image_id] = decoded.row(row)
        bar.update(len(texts))
    bar.close()
    return captions, details


# One image to caption: a name for messages and results, and how to get its RGB pixels
# (a callable that may raise DataError, so that a bad image fails on its own).
ImageSource = tuple[str, Callable[[], Image.Image]]


def caption_images(
    sources: Iterable[ImageSource],
    model: Captioner,
    vocab: Vocabulary,
    cfg: Config,
    device: torch.device,
    batch_size: int = 16,
) -> Iterator[CaptionResult]:
    """Caption every image of ``sources`` in order, ``batch_size`` at a time; one whose
    loader raises :class:`DataError` yields an error result (and never stops the others).
    Each result keeps the RGB image it was captioned from in ``picture``."""
    model.eval()
    pending: list[tuple[str, Image.Image, torch.Tensor]] = []

    def flush() -> Iterator[CaptionResult]:
        images = torch.stack([tensor for *_, tensor in pending]).to(device)  # (B, 3, S, S)
        names = [name for name, *_ in pending]
        for result, (_, picture, _) in zip(caption_inputs(images, names, model, vocab, cfg),
                                           pending):  # fmt: skip
            result.picture = picture
            yield result
        pending.clear()

    for name, load in sources:
        try:
            picture = load()
        except DataError as exc:
            yield from flush() if pending else ()
            yield CaptionResult(image=name, error=str(exc))
            continue
        pending.append((name, picture, model.encoder.transform(picture)))
        if len(pending) == batch_size:
            yield from flush()
    if pending:
        yield from flush()


def caption_inputs(
    images: torch.Tensor,
    names: Sequence[str],
    model: Captioner,
    vocab: Vocabulary,
    cfg: Config,
    encode_batch: int | None = None,
) -> list[CaptionResult]:
    """Caption a batch of encoder inputs in one decoding (one batched beam search).

    Args:
        images: uint8 (B, 3, S, S), as ``model.encoder.transform`` makes them, on the
            model's device.
        names: what each result calls its image.
        model: the network, in eval mode.
        vocab: its vocabulary.
        cfg: the config whose ``decode`` settings and ``runtime.precision`` apply.
        encode_batch: images encoded at once (None: all); see :func:`caption_batch`.
    """
    decoded = caption_batch(model, cfg.decode, cfg.runtime.precision, images=images,
                            encode_batch=encode_batch)  # fmt: skip
    return [CaptionResult.from_decoded(name, decoded.row(row), vocab)
            for row, name in enumerate(names)]  # fmt: skip


def caption_files(
    paths: Sequence[str],
    model: Captioner,
    vocab: Vocabulary,
    cfg: Config,
    device: torch.device,
    batch_size: int = 16,
) -> Iterator[CaptionResult]:
    """Caption every readable file in ``paths``, in order; unreadable ones yield an error
    result (and never stop the others)."""
    limits = ImageLimits.from_config(cfg.data)
    sources = ((str(path), partial(load_image, path, limits)) for path in paths)
    return caption_images(sources, model, vocab, cfg, device, batch_size)


def figure_stem(path: str, used: set[str]) -> str:
    """A file-name stem for ``path`` that no earlier image took (photos often share names)."""
    stem = Path(path).stem or "image"
    candidate, n = stem, 1
    while candidate in used:
        n += 1
        candidate = f"{stem}_{n}"
    used.add(candidate)
    return candidate


def draw_attention(
    result: CaptionResult,
    grid_shape: tuple[int, int],
    out_dir: str | Path,
    stem: str,
    smooth: bool = True,
    gif: bool = False,
    limits: ImageLimits = DEFAULT_LIMITS,
) -> CaptionResult:
    """Write the per-word attention grid (and optionally a GIF) of a captioned image, with
    local attention's centres marked."""
    from captioning.viz import attention_gif, attention_grid_figure

    if not result.words:  # an empty caption has nothing to show
        return result
    image = result.picture if result.picture is not None else load_image(result.image, limits)
    out_dir = Path(out_dir)
    drawing = dict(smooth=smooth, chosen_cells=result.cells, centres=result.centres)
    result.figure = str(
        attention_grid_figure(
            image,
            result.words,
            result.alphas,
            grid_shape,
            out_dir / f"{stem}.png",
            title=result.caption,
            **drawing,
        )  # fmt: skip
    )
    if gif:
        result.gif = str(
            attention_gif(
                image, result.words, result.alphas, grid_shape, out_dir / f"{stem}.gif", **drawing
            )
        )
    return result
