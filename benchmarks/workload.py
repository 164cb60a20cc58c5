"""What the speed benchmark runs: its problem sizes, random data, and the timed callables
(training steps and decoding, ours and the reference's) of one size on one device.

:func:`set_up` gathers what one size's measurements on one device share (:class:`Setup`);
:func:`decoder_step`, :func:`full_step`, :func:`our_decoding` and
:func:`reference_decoding` each build the callable that one measurement times.
:mod:`benchmarks.beam_floor` times :func:`our_decoding` at the COCO size as well.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch

from benchmarks.reference import ReferenceDecoder, load_reference
from benchmarks.reference_decoding import DECODERS
from captioning.config import Config, config_from_dict, load_config
from captioning.data.vocab import SPECIALS, Vocabulary
from captioning.errors import CaptioningError
from captioning.inference.caption import caption_batch
from captioning.inference.decoding import Decoded
from captioning.models import Captioner, build_model
from captioning.runtime import autocast
from captioning.training.step import train_step
from captioning.training.train import Run

REPO_ROOT = Path(__file__).resolve().parent.parent


class BenchError(CaptioningError):
    """Options the benchmark cannot run with."""


# --------------------------------------------------------------------------- sizes


@dataclass
class BenchSize:
    """One problem size.

    Attributes:
        name: the preset's name.
        config: the model section builds the model; ``train`` gives the optimiser settings
            and ``decode.max_length`` the longest decoded caption.
        vocab_size: V.
        caption_length: tokens per training caption, ``<start>`` and ``<end>`` included.
        batch_size: images per training step and per decoded batch.
        slow_repeats: repeats of the reference and of the full step unless the command line
            sets them (None: ``--repeats``).
        check_images: images in the reference checks (None: the whole batch).
    """

    name: str
    config: Config
    vocab_size: int
    caption_length: int
    batch_size: int
    slow_repeats: int | None = None
    check_images: int | None = None


def shapes_size() -> BenchSize:
    """The shapes default: configs/shapes_soft.yaml (small CNN, 48 px → 6x6x128 grid)."""
    config = load_config(REPO_ROOT / "configs" / "shapes_soft.yaml")
    return BenchSize("shapes", config, vocab_size=35, caption_length=16, batch_size=64)


def _frozen_size(encoder: str, side: int, attention_embed: int) -> Config:
    """A random-init frozen ``encoder`` at ``side`` px, attention and embedding of
    ``attention_embed``, LSTM 512, batches of 32, captions of at most 20 words."""
    model = {"encoder": encoder, "weights": None, "image_size": side, "fine_tune": "none"}
    model |= {"attention_dim": attention_embed, "embed_dim": attention_embed, "hidden_dim": 512}
    return config_from_dict(
        {"model": model, "train": {"batch_size": 32}, "decode": {"max_length": 20}}
    )


def coco_size() -> BenchSize:
    """COCO scale: a random-init ResNet-101 at 448 px (14x14x2048 grid, frozen), embedding,
    attention and LSTM of 512, 10 000 words, 20-token captions, 32 images."""
    config = _frozen_size("resnet101", 448, attention_embed=512)
    return BenchSize(
        "coco",
        config,
        vocab_size=10_000,
        caption_length=20,
        batch_size=32,
        slow_repeats=2,
        check_images=8,
    )


def flickr8k_size(side: int = 224) -> BenchSize:
    """The Flickr8k recipe's shapes (configs/flickr8k_best.yaml: MobileNetV2, attention and
    embedding of 256, LSTM 512, its 3,489 words) with the paper's wiring, which the reference
    computes: a 7 x 7 x 1,280 grid at 224 px, 14 x 14 at ``side`` 448 (the stride-16 grid's
    cells); random weights, 20-token captions, 32 images."""
    config = _frozen_size("mobilenet_v2", side, attention_embed=256)
    name = "flickr8k" if side == 224 else f"flickr8k_{side // 32}x{side // 32}"
    return BenchSize(
        name, config, vocab_size=3489, caption_length=20, batch_size=32, check_images=8
    )


def tiny_size() -> BenchSize:
    """A seconds-long size for tests and smoke runs (4x4x16 grid, 20 words)."""
    config = config_from_dict(
        {
            "model": {
                "encoder": "small_cnn",
                "image_size": 16,
                "fine_tune": "all",
                "cnn_channels": [8, 16, 16],
                "attention_dim": 16,
                "embed_dim": 16,
                "hidden_dim": 32,
                "dropout": 0.1,
            },
            "decode": {"max_length": 8},
        }
    )
    return BenchSize("tiny", config, vocab_size=20, caption_length=8, batch_size=6)


SIZES: dict[str, Callable[[], BenchSize]] = {
    "shapes": shapes_size,
    "coco": coco_size,
    "flickr8k": flickr8k_size,
    "flickr8k_14x14": partial(flickr8k_size, 448),
    "tiny": tiny_size,
}


# the precisions a benchmark times: fp32, and bf16 under autocast
PRECISIONS = ("fp32", "bf16")


def sizes_and_precisions(
    parser: argparse.ArgumentParser, sizes: str, precisions: str
) -> tuple[list[str], list[str]]:
    """A benchmark's comma-separated ``--sizes`` (of :data:`SIZES`) and ``--precisions``
    (fp32, bf16) as lists; an unknown or missing one is the parser's error (exit 2)."""
    names, kinds = ([n.strip() for n in v.split(",") if n.strip()] for v in (sizes, precisions))
    unknown = [s for s in names if s not in SIZES] + [p for p in kinds if p not in PRECISIONS]
    if unknown or not names or not kinds:
        parser.error(f"unknown or no size or precision: {', '.join(unknown) or 'none given'}")
    return names, kinds


def resolve_devices(name: str) -> list[torch.device]:
    """The devices to benchmark.

    Args:
        name: ``cpu``, ``cuda`` or ``all`` (CPU, and CUDA when available).

    Raises:
        BenchError: for ``cuda`` without CUDA, or another name.
    """
    cuda = torch.cuda.is_available()
    if name == "cpu":
        return [torch.device("cpu")]
    if name == "cuda":
        if not cuda:
            raise BenchError("--device cuda but CUDA is not available; use cpu or all")
        return [torch.device("cuda")]
    if name == "all":
        return [torch.device("cpu")] + ([torch.device("cuda")] if cuda else [])
    raise BenchError(f"--device must be cpu, cuda or all, got {name!r}")


# --------------------------------------------------------------------------- data


def random_batch(size: BenchSize, model: Captioner, seed: int) -> dict[str, torch.Tensor]:
    """Random data of ``size`` for ``model``.

    Args:
        size: the batch size, vocabulary and caption length.
        model: its encoder gives the grid and the image side.
        seed: seeds the generator.

    Returns:
        ``grid`` (B, L, D), cached backbone grids; uint8 ``images`` (B, 3, S, S); caption
        ``tokens`` (B, T): ``<start>``, random words, ``<end>``.
    """
    generator = torch.Generator().manual_seed(seed)
    encoder = model.encoder
    batch, side = size.batch_size, encoder.image_size
    grid = torch.randn(
        batch, encoder.num_cells, encoder.out_channels, generator=generator
    )  # (B, L, D)
    images = torch.randint(
        0, 256, (batch, 3, side, side), dtype=torch.uint8, generator=generator
    )  # (B, 3, S, S)
    tokens = torch.randint(
        len(SPECIALS), size.vocab_size, (batch, size.caption_length), generator=generator
    )  # (B, T)
    tokens[:, 0] = Vocabulary.start_id
    tokens[:, -1] = Vocabulary.end_id
    return {"grid": grid, "images": images, "tokens": tokens}


def bench_vocabulary(vocab_size: int) -> Vocabulary:
    """A vocabulary of ``vocab_size`` words: the specials, then ``w0``, ``w1``, ...

    Args:
        vocab_size: V, the specials included.
    """
    return Vocabulary(list(SPECIALS) + [f"w{i}" for i in range(vocab_size - len(SPECIALS))])


# --------------------------------------------------------------------------- timed callables


@dataclass
class Setup:
    """What the measurements of one size on one device share.

    Attributes:
        size: the size.
        model: the model on the device, in eval mode (ours decodes with it; training steps
            copy it).
        reference: a reference decoder with its decoder's weights, in eval mode (the
            reference decodes with it).
        batch: :func:`random_batch` on the device.
        vocab: the run's vocabulary.
        device: the device.
    """

    size: BenchSize
    model: Captioner
    reference: ReferenceDecoder
    batch: dict[str, torch.Tensor]
    vocab: Vocabulary
    device: torch.device


def _train_step(
    setup: Setup, cfg: Config, model: Captioner, inputs: str, compiled: bool
) -> Callable[[], Any]:
    """``train_step`` of a fresh run of ``model`` (in train mode) on the batch's ``inputs``
    (``grid`` or ``images``) and tokens; ``compiled`` compiles the module it calls."""
    model.train()
    # the schedule's length changes the learning rate, not the work of a step
    run = Run.create(cfg, setup.vocab, model, steps_per_epoch=1, device=setup.device)
    module = torch.compile(model) if compiled else model
    batch = {inputs: setup.batch[inputs], "tokens": setup.batch["tokens"]}
    return partial(train_step, run, module, batch, setup.device)


def decoder_step(setup: Setup, cfg: Config, reference: bool, compiled: bool) -> Callable[[], Any]:
    """The training step on cached grids, of ours or of the reference decoder put in our
    decoder's place (with a copy of its weights)."""
    if reference:
        decoder = load_reference(cfg.model, setup.model.decoder.state_dict())
        model = Captioner(copy.deepcopy(setup.model.encoder), decoder)
    else:
        model = copy.deepcopy(setup.model)
    return _train_step(setup, cfg, model, "grid", compiled)


def full_step(setup: Setup, cfg: Config, compiled: bool) -> Callable[[], Any]:
    """The training step on images (images → encoder → decoder) of a copy of our model."""
    return _train_step(setup, cfg, copy.deepcopy(setup.model), "images", compiled)


def our_decoding(setup: Setup, task: str, precision: str, compiled: bool) -> Callable[[], Decoded]:
    """Our decoding of the batch's grids, as every caption is made (``caption_batch``);
    ``compiled`` decodes with a copy of the model whose ``decoder.step`` is compiled."""
    max_length = setup.size.config.decode.max_length
    settings = dataclasses.replace(DECODERS[task][0], max_length=max_length, min_length=max_length)
    model = setup.model
    if compiled:
        model = copy.deepcopy(model, {id(model.encoder): model.encoder})  # shares the encoder
        model.decoder.step = torch.compile(model.decoder.step)
    return partial(caption_batch, model, settings, precision, grid=setup.batch["grid"])


def reference_decoding(setup: Setup, task: str, precision: str) -> Callable[[], Decoded]:
    """The reference's decoding of the batch's grids, one image at a time."""
    return partial(_reference_decode, setup, task, precision)


def _reference_decode(setup: Setup, task: str, precision: str) -> Decoded:
    """The reference decodes the features our model makes of the grids, as
    ``caption_batch`` makes them."""
    max_length = setup.size.config.decode.max_length
    decode_fn = DECODERS[task][1]
    with torch.no_grad(), autocast(setup.device, precision):
        features = setup.model.encode(grid=setup.batch["grid"])  # (B, L, D)
        return decode_fn(setup.reference, features, max_length=max_length, min_length=max_length)


def seeded_setup(size: BenchSize) -> Setup:
    """What a CPU benchmark times: ``size``'s model drawn from seed 0 and its random batch
    of seed 0 (:func:`set_up` on the CPU)."""
    torch.manual_seed(0)
    model = build_model(size.config.model, size.vocab_size)
    return set_up(size, model, random_batch(size, model, 0), torch.device("cpu"))


def set_up(
    size: BenchSize, model: Captioner, batch: dict[str, torch.Tensor], device: torch.device
) -> Setup:
    """What the measurements of ``size`` on ``device`` share: ``model`` (on the CPU: itself,
    elsewhere a copy) in eval mode, a reference decoder with its decoder's weights, and
    ``batch`` (:func:`random_batch`) on the device."""
    model = model if device.type == "cpu" else copy.deepcopy(model).to(device)
    model.eval()
    return Setup(
        size=size,
        model=model,
        reference=load_reference(size.config.model, model.decoder.state_dict()).eval(),
        batch={key: value.to(device) for key, value in batch.items()},
        vocab=bench_vocabulary(size.vocab_size),
        device=device,
    )
