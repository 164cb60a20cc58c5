"""The Python API: a checkpoint loaded once, and captions with their attention in one call.

.. code-block:: python

    import captioning

    model = captioning.load("runs/shapes_soft/best.pt", device="cpu")
    result = model.caption("photo.jpg", beam_size=3)  # a path, PIL image, tensor, or a list
    result.caption, result.words, result.alphas  # alphas: (words, rows, cols)
    result.plot()  # a matplotlib figure of the per-word heatmaps
    result.heads, result.centres  # multi-head: (words, H, rows, cols); local: (words, 2)

The ``caption`` verb, ``evaluate``, the quickstart, the notebook and the web demo all load
and caption through this module, on top of :mod:`captioning.inference.caption`.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Iterator, Sequence
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image

from captioning.config import Config
from captioning.data.images import ImageLimits, as_rgb, load_image
from captioning.data.vocab import Vocabulary
from captioning.errors import DataError
from captioning.inference.caption import (
    Caption,
    Failed,
    ImageSource,
    caption_inputs,
    caption_read,
    load_model,
    read_images,
    with_decoding,
)
from captioning.models import Captioner
from captioning.runtime import resolve_device

__all__ = ["Caption", "CaptionModel", "Failed", "ImageInput", "load"]

# What ``CaptionModel.caption`` accepts as one image.
ImageInput = str | Path | Image.Image | torch.Tensor | np.ndarray


class CaptionModel:
    """A trained captioning model with its vocabulary and decoding settings. Made by
    :func:`load`; safe to share between threads (one caption batch runs at a time).

    Args:
        model: the network, in eval mode on ``device``.
        config: the run's resolved config (decoding settings, image limits, data).
        vocab: the run's vocabulary.
        device: where the network runs.
        checkpoint: the file it was loaded from, for messages.
    """

    def __init__(
        self,
        *,
        model: Captioner,
        config: Config,
        vocab: Vocabulary,
        device: torch.device,
        checkpoint: str | None = None,
    ) -> None:
        self.model = model
        self.config = config
        self.vocab = vocab
        self.device = device
        self.checkpoint = checkpoint
        self.limits = ImageLimits.from_config(config.data)
        self._lock = threading.Lock()

    @property
    def grid_shape(self) -> tuple[int, int]:
        """The attention grid, ``(rows, cols)``."""
        return self.model.grid_shape

    @property
    def hard_attention(self) -> bool:
        """True for a hard (stochastic) attention model: ``hard_context`` applies."""
        return self.model.hard_attention

    @property
    def heads(self) -> int:
        """H, the attention heads (1 but for multi-head models, whose captions carry
        ``heads``)."""
        return self.model.attention_heads

    def caption(
        self,
        images: ImageInput | Sequence[ImageInput],
        *,
        beam_size: int | None = None,
        hard_context: str | None = None,
        batch_size: int = 16,
    ) -> Caption | list[Caption]:
        """Caption one image, or a list of them (then a list comes back, in order).

        Args:
            images: a file path, a PIL image, a uint8 (3, H, W) tensor in 0..255 or a float
                one in 0..1, an (H, W, 3) uint8 array, a (B, 3, H, W) tensor, or a list.
            beam_size: beam search with this many beams, 1 greedy; None keeps the
                checkpoint's decoding settings.
            hard_context: hard attention only: ``expectation``, ``argmax``, ``sample`` or
                ``marginal`` (see ``decode.hard_context``); soft models ignore it.
            batch_size: images decoded together.

        Raises:
            DataError: an image cannot be read (the message names it).
            ConfigError: the decoding asked for is invalid for this model.
        """
        single = not _is_many(images)
        results = []
        for item in self.caption_each(
            [images] if single else images,
            beam_size=beam_size,
            hard_context=hard_context,
            batch_size=batch_size,
        ):
            if isinstance(item, Failed):
                raise DataError(item.error)
            results.append(item)
        return results[0] if single else results

    def caption_each(
        self,
        images: Iterable[ImageInput],
        *,
        beam_size: int | None = None,
        hard_context: str | None = None,
        batch_size: int = 16,
    ) -> Iterator[Caption | Failed]:
        """:meth:`caption` one image at a time: a :class:`Failed` for each unreadable input,
        in its place, and the others are still captioned. Arguments as :meth:`caption`."""
        cfg = self.decoding(beam_size, hard_context)
        sources = (self._source(index, item) for index, item in enumerate(_flatten(images)))
        # Images are opened, converted and resized outside the lock, and the lock covers one
        # batch's decoding, never the caller's use of a result: other threads wait only for
        # the model.
        for batch in read_images(sources, self.model.encoder.transform, batch_size):
            if isinstance(batch, Failed):
                yield batch
                continue
            with self._lock:
                results = caption_read(batch, self.model, self.vocab, cfg, self.device)
            yield from results

    @property
    def input_size(self) -> int:
        """S: the side of the square that every image is resized to (not cropped) for the
        encoder."""
        return self.model.encoder.image_size

    def prepare(self, picture: Image.Image) -> torch.Tensor:
        """An RGB picture as the encoder's input: uint8 ``(3, S, S)``."""
        return self.model.encoder.transform(picture)

    def caption_inputs(
        self,
        inputs: torch.Tensor,
        *,
        beam_size: int | None = None,
        hard_context: str | None = None,
        encode_batch: int | None = None,
    ) -> list[Caption]:
        """Caption inputs made by :meth:`prepare`, ``(B, 3, S, S)``, in one batched decoding
        (the web demo gathers concurrent requests into one call). Each caption's ``image`` is
        its input as the model saw it, S x S. Decoding arguments as :meth:`caption`;
        ``encode_batch`` encodes that many images at a time (None: all at once).

        Raises:
            ConfigError: the decoding asked for is invalid for this model.
        """
        cfg = self.decoding(beam_size, hard_context)
        names = [f"image {index}" for index in range(len(inputs))]
        with self._lock:
            results = caption_inputs(
                inputs.to(self.device), names, self.model, self.vocab, cfg, encode_batch
            )
        for result, pixels in zip(results, inputs):
            result.image = Image.fromarray(pixels.permute(1, 2, 0).contiguous().numpy())
        return results

    def decoding(self, beam_size: int | None = None, hard_context: str | None = None) -> Config:
        """The config with these decoding settings (None keeps the checkpoint's;
        ``hard_context`` means nothing to a soft-attention model and is ignored)."""
        return with_decoding(self.config, beam_size, hard_context)

    def _source(self, index: int, item: ImageInput) -> ImageSource:
        if isinstance(item, str | Path):
            return str(item), partial(load_image, item, self.limits)
        return f"image {index}", partial(_to_picture, item, self.limits)

    def __repr__(self) -> str:
        kind = "hard" if self.hard_attention else "soft"
        return (
            f"CaptionModel({self.checkpoint!r}, {kind} attention, grid "
            f"{self.grid_shape[0]}x{self.grid_shape[1]}, {len(self.vocab)} words)"
        )


def load(checkpoint: str | Path, device: str | torch.device = "auto") -> CaptionModel:
    """A model rebuilt from nothing but its checkpoint, ready to caption.

    Args:
        checkpoint: a ``best.pt`` / ``last.pt`` file of any run.
        device: ``auto`` (a GPU when there is one), ``cpu``, ``cuda``, ``cuda:1``, ...

    Raises:
        CheckpointError: the file is missing, unsafe, or not a checkpoint of this project.
    """
    torch_device = resolve_device(device) if isinstance(device, str) else device
    model, cfg, vocab = load_model(checkpoint, torch_device)
    model.encoder.fold_batch_norms()  # it only captions from here on: the same grid, faster
    return CaptionModel(
        model=model, config=cfg, vocab=vocab, device=torch_device, checkpoint=str(checkpoint)
    )


def _is_many(images: Any) -> bool:
    if isinstance(images, torch.Tensor):
        return images.dim() == 4  # (B, 3, H, W)
    return isinstance(images, list | tuple)


def _flatten(images: Iterable[ImageInput]) -> Iterator[ImageInput]:
    for item in images:
        if isinstance(item, torch.Tensor) and item.dim() == 4:
            yield from item  # (3, H, W) each
        else:
            yield item


def _to_picture(item: Any, limits: ImageLimits) -> Image.Image:
    """An in-memory image as 8-bit RGB; the message of a wrong one says what is accepted."""
    if isinstance(item, torch.Tensor):
        item = _tensor_to_array(item)
    if isinstance(item, np.ndarray):
        channels = item.shape[2] if item.ndim == 3 else 1
        if (
            item.dtype != np.uint8
            or item.ndim not in (2, 3)
            or channels not in (1, 3, 4)
            or (item.size == 0)
        ):
            raise DataError(
                f"an image array must be uint8 (H, W), (H, W, 3) or (H, W, 4) with "
                f"pixels, got {item.dtype} {tuple(item.shape)}"
            )
        item = Image.fromarray(item[:, :, 0] if channels == 1 and item.ndim == 3 else item)
    if not isinstance(item, Image.Image):
        raise DataError(
            f"cannot caption a {type(item).__name__}: give a file path, a PIL "
            "image, an image tensor or array, or a list of them"
        )
    return as_rgb(item, limits)


def _tensor_to_array(tensor: torch.Tensor) -> np.ndarray:
    """(3, H, W) or (1, H, W): uint8 in 0..255, or float in 0..1 (torchvision's convention)."""
    if tensor.dim() != 3 or tensor.shape[0] not in (1, 3) or tensor.numel() == 0:
        raise DataError(f"an image tensor must be (3, H, W) with pixels, got {tuple(tensor.shape)}")
    tensor = tensor.detach().cpu()
    if tensor.is_floating_point():
        tensor = (tensor.clamp(0, 1) * 255).round().to(torch.uint8)
    array = tensor.to(torch.uint8).permute(1, 2, 0).numpy()  # (H, W, C)
    return array[:, :, 0] if array.shape[2] == 1 else array
