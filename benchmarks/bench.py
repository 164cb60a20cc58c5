"""Speed benchmark: training steps and decoding, ours against a naive reference.

    python benchmarks/bench.py --sizes shapes,coco [--compile] [--out runs/bench/bench.json]
    python -m benchmarks.bench ...                    (the same, from the repository root)
    python benchmarks/bench.py --sizes tiny --quick   (a smoke run of seconds)
    python benchmarks/bench.py --help

What is timed, as medians over ``--repeats`` runs after ``--warmup`` runs:

- ``decoder_step``: one training step on cached backbone grids, a random (B, L, D) tensor:
  :func:`captioning.train.train_step` itself, the step training takes (forward under
  autocast of the measured precision, loss, backward, gradient clipping, Adam, schedule);
- ``full_step``: the same step on images (images → encoder → decoder). The size's
  ``fine_tune`` says whether the encoder trains (shapes: ``all``) or runs frozen under
  no_grad (coco: ``none``, a random-init ResNet-101 at 448 px, so nothing downloads);
- ``greedy``, ``beam3``, ``beam5``: captioning one batch of cached grids through
  :func:`captioning.inference.caption_batch`, in images/s and words/s. Every caption runs to
  the size's ``max_length`` (``<end>`` is masked through ``min_length``), so the work does not
  depend on where random weights happen to end a caption.

Each is timed for our code and for the reference of :mod:`benchmarks.reference`, written the
way popular tutorial code does it: the same weights, but the grid is re-projected at every
word, the output layer runs one step at a time, and decoding goes one image at a time. For the
decoder step the reference decoder takes our decoder's place in a captioner and goes through
the same ``train_step``. Before timing, the two are checked against each other
(:func:`benchmarks.reference.check_reference`); a failed check exits with status 1.

Peak memory is the high-water mark during set-up, warm-up and repeats minus the memory in
use just before: for a training step the copy of the model (encoder included), the
gradients, Adam's state and the activations; for decoding its working memory. See
:mod:`benchmarks.memory` for how it is measured on CPU and CUDA.

Beside them, ``cider``: the CIDEr-D reward of one self-critical batch (64 images x 5 samples
against an 8000-image training corpus), :class:`captioning.metrics.cider.CiderD` against
pycocoevalcap's scorer called per batch (see :mod:`benchmarks.cider_speed`).

Writes the JSON file and a Markdown table beside it, and prints the table. ``--results FILE``
also merges every measurement into a committed results file (``results/speed.json``), one
row each with the command, commit and machine (``--machine-busy``: not timed alone).
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: the repository root holds the benchmarks
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import argparse
import copy
import dataclasses
import json
import logging
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any, NoReturn

import torch

from benchmarks.cider_speed import bench_cider, format_cider
from benchmarks.memory import PeakMemory, environment
from benchmarks.provenance import add_result_options, record_rows
from benchmarks.reference import (
    DECODERS,
    ReferenceDecoder,
    captions_equal,
    check_reference,
    load_reference,
)
from captioning.config import Config, config_from_dict, config_to_dict, load_config, replace_section
from captioning.decoding import Decoded
from captioning.errors import CaptioningError
from captioning.inference import caption_batch
from captioning.models import Captioner, build_model
from captioning.runtime import autocast
from captioning.train import Run, train_step
from captioning.vocab import SPECIALS, Vocabulary

logger = logging.getLogger("benchmarks")

REPO_ROOT = Path(__file__).resolve().parent.parent
# Speed-ups to report (not assert), by (size, device, task).
TARGETS = {("coco", "cpu", "decoder_step"): 5.0, ("coco", "cpu", "beam5"): 20.0}
TASK_LABELS = {
    "decoder_step": "decoder train step (cached features)",
    "full_step": "full train step",
    "greedy": "greedy",
    "beam3": "beam k=3",
    "beam5": "beam k=5",
}


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


def coco_size() -> BenchSize:
    """COCO scale: a random-init ResNet-101 at 448 px (14x14x2048 grid, frozen), embedding,
    attention and LSTM of 512, 10 000 words, 20-token captions, 32 images."""
    config = config_from_dict({
        "model": {"encoder": "resnet101", "weights": None, "image_size": 448,
                  "fine_tune": "none", "attention_dim": 512, "embed_dim": 512,
                  "hidden_dim": 512},
        "train": {"batch_size": 32},
        "decode": {"max_length": 20},
    })  # fmt: skip
    return BenchSize(
        "coco", config, vocab_size=10_000, caption_length=20, batch_size=32,
        slow_repeats=2, check_images=8,
    )  # fmt: skip


def tiny_size() -> BenchSize:
    """A seconds-long size for tests and smoke runs (4x4x16 grid, 20 words)."""
    config = config_from_dict({
        "model": {"encoder": "small_cnn", "image_size": 16, "fine_tune": "all",
                  "cnn_channels": [8, 16, 16], "attention_dim": 16, "embed_dim": 16,
                  "hidden_dim": 32, "dropout": 0.1},
        "decode": {"max_length": 8},
    })  # fmt: skip
    return BenchSize("tiny", config, vocab_size=20, caption_length=8, batch_size=6)


SIZES: dict[str, Callable[[], BenchSize]] = {
    "shapes": shapes_size,
    "coco": coco_size,
    "tiny": tiny_size,
}


# --------------------------------------------------------------------------- options


@dataclass
class BenchOptions:
    """What :func:`run_benchmark` measures and where it writes.

    Attributes:
        sizes: preset names from ``SIZES``.
        device: ``cpu``, ``cuda`` or ``all`` (CPU, and CUDA when available).
        precisions: ``fp32`` and/or ``bf16`` (autocast).
        compile: also time ``torch.compile`` variants of our code; a failure is recorded.
        repeats: timed runs per measurement (the median is reported).
        warmup: untimed runs first.
        ref_repeats: timed runs of the reference (None: the size's ``slow_repeats``).
        full_repeats: timed runs of the full step (None: the size's ``slow_repeats``).
        skip_full: leave out the full step (the encoder is slow on a small CPU).
        batch_size: images per batch for every size (None: each size's own).
        check_images: images in the reference checks (None: each size's own).
        threads: ``torch.set_num_threads`` (None: torch's default).
        seed: seeds the weights and the random data.
        quick: one warm-up and one timed run of everything (smoke tests); the CIDEr-D
            comparison then uses a corpus of 200 images.
        skip_cider: leave out the CIDEr-D comparison (ours against pycocoevalcap per batch).
        cider_corpus: training images (5 references each) of the CIDEr-D comparison.
        quiet: no progress lines.
        out: the JSON file; the Markdown table goes beside it (``.md``).
    """

    sizes: list[str] = field(default_factory=lambda: ["shapes", "coco"])
    device: str = "all"
    precisions: list[str] = field(default_factory=lambda: ["fp32", "bf16"])
    compile: bool = False
    repeats: int = 5
    warmup: int = 1
    ref_repeats: int | None = None
    full_repeats: int | None = None
    skip_full: bool = False
    batch_size: int | None = None
    check_images: int | None = None
    threads: int | None = None
    seed: int = 0
    quick: bool = False
    skip_cider: bool = False
    cider_corpus: int = 8000
    quiet: bool = False
    out: str = "runs/bench/bench.json"


def _validate(options: BenchOptions) -> None:
    unknown = [s for s in options.sizes if s not in SIZES]
    if unknown or not options.sizes:
        raise BenchError(f"--sizes must name some of {', '.join(SIZES)}; got {unknown}")
    bad = [p for p in options.precisions if p not in ("fp32", "bf16")]
    if bad or not options.precisions:
        raise BenchError(f"--precisions must name fp32 and/or bf16; got {bad}")
    counts = {
        "--repeats": options.repeats,
        "--ref-repeats": options.ref_repeats,
        "--full-repeats": options.full_repeats,
        "--batch-size": options.batch_size,
        "--check-images": options.check_images,
        "--threads": options.threads,
        "--cider-corpus": options.cider_corpus,
    }
    for flag, value in counts.items():
        if value is not None and value < 1:
            raise BenchError(f"{flag} must be at least 1, got {value}")
    if options.warmup < 0:
        raise BenchError(f"--warmup must be at least 0, got {options.warmup}")


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


# --------------------------------------------------------------------------- jobs


@dataclass
class _Setup:
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


@dataclass
class _Job:
    """One measurement: ``make`` builds the timed callable (copies weights, compiles)."""

    task: str
    impl: str  # ours | reference
    make: Callable[[], Callable[[], Any]]
    repeats: int
    words: int | None  # teacher-forced words per call; None counts the decoded words


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _train_step(
    setup: _Setup, cfg: Config, model: Captioner, inputs: str, compiled: bool
) -> Callable[[], Any]:
    """``train_step`` of a fresh run of ``model`` (in train mode) on the batch's ``inputs``
    (``grid`` or ``images``) and tokens; ``compiled`` compiles the module it calls."""
    model.train()
    # the schedule's length changes the learning rate, not the work of a step
    run = Run.create(cfg, setup.vocab, model, steps_per_epoch=1, device=setup.device)
    module = torch.compile(model) if compiled else model
    batch = {inputs: setup.batch[inputs], "tokens": setup.batch["tokens"]}
    return partial(train_step, run, module, batch, setup.device)


def _decoder_step(setup: _Setup, cfg: Config, reference: bool, compiled: bool) -> Callable[[], Any]:
    """The training step on cached grids, of ours or of the reference decoder put in our
    decoder's place (with a copy of its weights)."""
    if reference:
        decoder = load_reference(cfg.model, setup.model.decoder.state_dict())
        model = Captioner(copy.deepcopy(setup.model.encoder), decoder)
    else:
        model = copy.deepcopy(setup.model)
    return _train_step(setup, cfg, model, "grid", compiled)


def _full_step(setup: _Setup, cfg: Config, compiled: bool) -> Callable[[], Any]:
    """The training step on images (images → encoder → decoder) of a copy of our model."""
    return _train_step(setup, cfg, copy.deepcopy(setup.model), "images", compiled)


def _decode(setup: _Setup, task: str, precision: str, compiled: bool) -> Callable[[], Decoded]:
    """Our decoding of the batch's grids, as every caption is made (``caption_batch``);
    ``compiled`` decodes with a copy of the model whose ``decoder.step`` is compiled."""
    max_length = setup.size.config.decode.max_length
    settings = dataclasses.replace(DECODERS[task][0], max_length=max_length, min_length=max_length)
    model = setup.model
    if compiled:
        model = copy.deepcopy(model, {id(model.encoder): model.encoder})  # shares the encoder
        model.decoder.step = torch.compile(model.decoder.step)
    return partial(caption_batch, model, settings, precision, grid=setup.batch["grid"])


def _reference_decoding(setup: _Setup, task: str, precision: str) -> Callable[[], Decoded]:
    """The reference's decoding of the batch's grids, one image at a time."""
    return partial(_reference_decode, setup, task, precision)


def _reference_decode(setup: _Setup, task: str, precision: str) -> Decoded:
    """The reference decodes the features our model makes of the grids, as
    ``caption_batch`` makes them."""
    max_length = setup.size.config.decode.max_length
    decode_fn = DECODERS[task][1]
    with torch.no_grad(), autocast(setup.device, precision):
        features = setup.model.encode(grid=setup.batch["grid"])  # (B, L, D)
        return decode_fn(setup.reference, features, max_length=max_length, min_length=max_length)


def _jobs(setup: _Setup, precision: str, compiled: bool, options: BenchOptions) -> list[_Job]:
    """The measurements of one (size, device, precision, compiled) variant: for each task
    the reference first (uncompiled variants only), then ours."""
    size = setup.size
    cfg = replace_section(size.config, "train", precision=precision)  # autocast of the step
    words = int(setup.batch["tokens"][:, 1:].numel())  # teacher-forced words
    repeats, slow = _repeats(size, options)
    jobs = []
    if not compiled:
        reference_step = partial(_decoder_step, setup, cfg, True, False)
        jobs.append(_Job("decoder_step", "reference", reference_step, slow, words))
    ours_step = partial(_decoder_step, setup, cfg, False, compiled)
    jobs.append(_Job("decoder_step", "ours", ours_step, repeats, words))
    if not options.skip_full:
        full = 1 if options.quick else options.full_repeats or slow
        full_step = partial(_full_step, setup, cfg, compiled)
        jobs.append(_Job("full_step", "ours", full_step, full, words))
    for task in DECODERS:
        if not compiled:
            reference_decode = partial(_reference_decoding, setup, task, precision)
            jobs.append(_Job(task, "reference", reference_decode, slow, None))
        ours_decode = partial(_decode, setup, task, precision, compiled)
        jobs.append(_Job(task, "ours", ours_decode, repeats, None))
    return jobs


def _repeats(size: BenchSize, options: BenchOptions) -> tuple[int, int]:
    """(repeats of ours, repeats of the reference)."""
    if options.quick:
        return 1, 1
    slow = options.ref_repeats or min(size.slow_repeats or options.repeats, options.repeats)
    return options.repeats, slow


# --------------------------------------------------------------------------- measuring


def _first_lines(exc: BaseException) -> str:
    """The error in one line: compiler errors put the cause on their second or third line."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()][:3]
    return f"{type(exc).__name__}: {' / '.join(lines)}"[:300]


def measure(job: _Job, warmup: int, device: torch.device) -> tuple[dict[str, Any], Decoded | None]:
    """Time ``job``: ``warmup`` untimed runs, then ``job.repeats`` timed ones. A failure
    (a compiler that is missing, an unsupported op) is recorded, not raised.

    Args:
        job: the measurement.
        warmup: untimed runs first.
        device: where it runs (synchronised after every run; its memory is measured).

    Returns:
        The measurement's row, and the last result when it is a :class:`Decoded`.
    """
    memory = PeakMemory(device)
    warm_times: list[float] = []
    times: list[float] = []
    result = None
    error = None
    memory.start()
    try:
        fn = job.make()
        for runs in (warm_times, times):
            for _ in range(warmup if runs is warm_times else job.repeats):
                start = time.perf_counter()
                result = fn()
                _synchronize(device)
                runs.append(time.perf_counter() - start)
    except Exception as exc:  # recorded in the results; the benchmark goes on
        error = _first_lines(exc)
        logger.warning("%s %s failed: %s", job.task, job.impl, error)
    fn = None  # drop the copies before the next measurement
    peak_delta, peak = memory.stop()
    median = statistics.median(times) if times and error is None else None
    decoded = result if isinstance(result, Decoded) and error is None else None
    words = job.words if job.words is not None else (
        int(decoded.lengths.sum()) if decoded is not None else None
    )  # fmt: skip
    return {
        "task": job.task,
        "impl": job.impl,
        "warmup_seconds": warm_times,
        "seconds": times,
        "median_s": median,
        "images_per_s": None,
        "tokens_per_s": words / median if median and words is not None else None,
        "peak_memory_mb": peak_delta if error is None else None,
        "peak_memory_total_mb": peak if error is None else None,
        "error": error,
    }, decoded


def speedups(measurements: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Ours against the reference of the same size, device, precision and task (the
    uncompiled reference for compiled variants): reference time / our time.

    Args:
        measurements: the rows of :func:`run_benchmark`'s ``measurements``.
    """
    references = {
        (m["size"], m["device"], m["precision"], m["task"]): m
        for m in measurements
        if m["impl"] == "reference" and m["median_s"]
    }
    ratios = []
    for m in measurements:
        key = (m["size"], m["device"], m["precision"], m["task"])
        if m["impl"] != "ours" or not m["median_s"] or key not in references:
            continue
        speedup = references[key]["median_s"] / m["median_s"]
        target = TARGETS.get((m["size"], m["device"], m["task"]))
        ratios.append({
            "size": m["size"], "device": m["device"], "precision": m["precision"],
            "compiled": m["compiled"], "task": m["task"], "speedup": speedup,
            "target": target, "target_met": None if target is None else speedup >= target,
        })  # fmt: skip
    return ratios


# --------------------------------------------------------------------------- run


def run_benchmark(options: BenchOptions) -> dict[str, Any]:
    """Check and time every size, device, precision and compile setting of ``options``;
    write the JSON file and the Markdown table beside it.

    Args:
        options: what to measure and where to write.

    Returns:
        The results: ``environment``, ``settings``, ``sizes``, ``checks``,
        ``measurements``, ``speedups`` and ``passed`` (every check passed).

    Raises:
        BenchError: for options that cannot run.
    """
    _validate(options)
    if options.threads:
        torch.set_num_threads(options.threads)
    devices = resolve_devices(options.device)
    warmup = 1 if options.quick else options.warmup
    compile_modes = [False, True] if options.compile else [False]
    results: dict[str, Any] = {
        "environment": environment(devices),
        "settings": dataclasses.asdict(options) | {"warmup": warmup},
        "sizes": {},
        "checks": [],
        "measurements": [],
    }
    for name in options.sizes:
        size = SIZES[name]()
        if options.batch_size:
            size = dataclasses.replace(size, batch_size=options.batch_size)
        torch.manual_seed(options.seed)
        model = build_model(size.config.model, size.vocab_size)
        batch = random_batch(size, model, options.seed)
        results["sizes"][name] = _describe(size, model)
        checked = options.check_images or size.check_images or size.batch_size
        for device in devices:
            _progress(options, "%s %s: checking ours against the reference on %d images",
                      name, device.type, min(checked, size.batch_size))  # fmt: skip
            check = check_reference(model.decoder, size.config.model, batch["grid"][:checked],
                                    batch["tokens"][:checked], size.config.decode.max_length,
                                    device)  # fmt: skip
            results["checks"].append({"size": name, "device": device.type, **check})
            if not check["passed"]:
                logger.warning("%s %s: ours and the reference disagree: %s", name,
                               device.type, json.dumps(check["captions"]))  # fmt: skip
            setup = _set_up(size, model, batch, device)
            results["measurements"] += _time_device(setup, warmup, compile_modes, options)
    results["speedups"] = speedups(results["measurements"])
    if not options.skip_cider:
        corpus = min(options.cider_corpus, 200) if options.quick else options.cider_corpus
        _progress(options, "CIDEr-D: ours against pycocoevalcap per batch, corpus %d", corpus)
        results["cider"] = bench_cider(corpus, repeats=1 if options.quick else options.repeats,
                                       seed=options.seed)  # fmt: skip
    results["passed"] = all(check["passed"] for check in results["checks"])
    _write(results, Path(options.out))
    return results


def _set_up(
    size: BenchSize, model: Captioner, batch: dict[str, torch.Tensor], device: torch.device
) -> _Setup:
    model = model if device.type == "cpu" else copy.deepcopy(model).to(device)
    model.eval()
    return _Setup(
        size=size,
        model=model,
        reference=load_reference(size.config.model, model.decoder.state_dict()).eval(),
        batch={key: value.to(device) for key, value in batch.items()},
        vocab=bench_vocabulary(size.vocab_size),
        device=device,
    )


def _time_device(
    setup: _Setup, warmup: int, compile_modes: list[bool], options: BenchOptions
) -> list[dict[str, Any]]:
    """Every measurement of one size on one device, as rows of the results."""
    size, device = setup.size, setup.device
    rows = []
    for precision in options.precisions:
        reference_captions: dict[str, Decoded] = {}
        for compiled in compile_modes:
            for job in _jobs(setup, precision, compiled, options):
                impl = "ours (compiled)" if compiled and job.impl == "ours" else job.impl
                label = f"{size.name} {device.type} {precision} {job.task} {impl}"
                _progress(options, "%s: %d + %d runs", label, warmup, job.repeats)
                row, decoded = measure(job, warmup, device)
                row = {"size": size.name, "device": device.type, "precision": precision,
                       "compiled": compiled, **row}  # fmt: skip
                if row["median_s"]:
                    row["images_per_s"] = size.batch_size / row["median_s"]
                    _progress(options, "%s: median %.4g s", label, row["median_s"])
                if job.task == "full_step":
                    row["fine_tune"] = size.config.model.fine_tune
                if decoded is not None and job.impl == "reference":
                    reference_captions[job.task] = decoded
                elif decoded is not None and job.task in reference_captions:
                    # informational: in fp32/bf16 batched and per-image arithmetic differ
                    # in the last bits, which can flip a near-tie
                    equal = captions_equal(decoded, reference_captions[job.task])
                    row["captions_agree_with_reference"] = sum(equal) / len(equal)
                rows.append(row)
    return rows


def _describe(size: BenchSize, model: Captioner) -> dict[str, Any]:
    return {
        "model": config_to_dict(size.config)["model"],
        "grid": list(model.encoder.grid_shape),
        "feature_dim": model.encoder.out_channels,
        "vocab_size": size.vocab_size,
        "caption_length": size.caption_length,
        "batch_size": size.batch_size,
        "max_length": size.config.decode.max_length,
        "decoder_parameters": sum(p.numel() for p in model.decoder.parameters()),
        "encoder_parameters": sum(p.numel() for p in model.encoder.parameters()),
    }


def _progress(options: BenchOptions, message: str, *args: object) -> None:
    if not options.quiet:
        logger.info("bench " + message, *args)


# --------------------------------------------------------------------------- output


def _number(value: float | None, digits: int = 3) -> str:
    if value is None:
        return "–"
    return f"{value:.{digits}g}" if abs(value) < 10**digits else f"{value:,.0f}"


def _checks_table(results: dict[str, Any]) -> list[str]:
    lines = [
        "| size | device | images | logits max diff | task | same captions (random) "
        "| same captions (end raised) | ended (random / end raised) | passed |",
        "|" + " --- |" * 9,
    ]
    for check in results["checks"]:
        captions = check["captions"]
        for task in DECODERS:
            random, biased = captions["random"][task], captions["end_biased"][task]
            lines.append(
                f"| {check['size']} | {check['device']} | {check['images']} "
                f"| {check['logits_max_abs_diff']:.2g} | {TASK_LABELS[task]} "
                f"| {random['equal_share']:.2f} | {biased['equal_share']:.2f} "
                f"| {random['ended_share']:.2f} / {biased['ended_share']:.2f} "
                f"| {'yes' if check['passed'] else 'NO'} |"
            )
    return lines


def _timing_line(m: dict[str, Any], ratio: dict[str, Any] | None) -> str:
    target = "–"
    if ratio and ratio["target"] is not None:
        met = "met" if ratio["target_met"] else "not met"
        target = f"≥{ratio['target']:g}x {met}"
    task = TASK_LABELS[m["task"]]
    if m["task"] == "full_step":
        frozen = ", frozen encoder under no_grad" if m["fine_tune"] == "none" else ""
        task += f" (fine_tune={m['fine_tune']}{frozen})"
    notes = []
    if m.get("captions_agree_with_reference") is not None:
        notes.append(f"same captions as reference: {m['captions_agree_with_reference']:.2f}")
    if m["error"]:
        notes.append(m["error"].replace("|", "/"))
    impl = "ours (compiled)" if m["compiled"] else m["impl"]
    speedup = f"{ratio['speedup']:.1f}x" if ratio else "–"
    return (
        f"| {m['size']} | {m['device']} | {m['precision']} | {task} | {impl} "
        f"| {_number(m['median_s'])} | {_number(m['images_per_s'])} "
        f"| {_number(m['tokens_per_s'])} | {_number(m['peak_memory_mb'])} "
        f"| {speedup} | {target} "
        f"| {'; '.join(notes)} |"
    )


def format_markdown(results: dict[str, Any]) -> str:
    """The environment, the checks and every measurement as Markdown tables.

    Args:
        results: what :func:`run_benchmark` returns (or its JSON file holds).
    """
    env = results["environment"]
    lines = [
        "# Benchmark",
        "",
        f"torch {env['torch']}, Python {env['python']}, CPU {env['cpu']} "
        f"({env['threads']} threads of {env['cpu_count']} cores), GPU {env['gpu'] or 'none'}.",
        "",
        "## Ours against the reference",
        "",
        "Teacher-forced logits in fp32; captions in fp64, with random weights and with "
        "`<end>` raised (share of captions that ended: ours).",
        "",
        *_checks_table(results),
        "",
        "## Timings",
        "",
        "Medians. Decoding runs every caption to its size's max_length (`<end>` masked), so "
        "the work does not depend on the random weights. words/s counts teacher-forced words "
        "(training) or the words of the returned captions (decoding). Peak MB: above the "
        "memory in use before the measurement; for training steps it includes the copy of "
        f"the model, gradients and Adam's state (CPU: {env['cpu_memory']}).",
        "",
        "| size | device | precision | task | impl | median s | images/s | words/s | peak MB "
        "| speed-up | target | note |",
        "|" + " --- |" * 12,
    ]
    ratios = {
        (r["size"], r["device"], r["precision"], r["compiled"], r["task"]): r
        for r in results["speedups"]
    }
    for m in results["measurements"]:
        key = (m["size"], m["device"], m["precision"], m["compiled"], m["task"])
        lines.append(_timing_line(m, ratios.get(key) if m["impl"] == "ours" else None))
    if results.get("cider"):
        lines += ["", *format_cider(results["cider"])]
    return "\n".join(lines) + "\n"


TIMING_KEY = ("size", "device", "precision", "compiled", "task", "impl")


def record_timings(
    path: Path, results: dict[str, Any], argv: Sequence[str] | None, *, timed_alone: bool
) -> None:
    """Merge every measurement of ``results`` into the results file ``path``: one row each
    (``kind`` ``bench``), which replaces an earlier row of the same size, device, precision,
    compilation, task and implementation; the checks' verdict goes with each row."""
    rows = [{"kind": "bench", **m, "threads": results["environment"]["threads"],
             "checks_passed": results["passed"]} for m in results["measurements"]]  # fmt: skip
    argv = None if argv is None else list(argv)
    record_rows(path, rows, lambda r: (r["kind"], *(r.get(k) for k in TIMING_KEY)),
                script="benchmarks/bench.py", argv=argv, timed_alone=timed_alone)  # fmt: skip


def _write(results: dict[str, Any], out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2) + "\n")
    out.with_suffix(".md").write_text(format_markdown(results))


# --------------------------------------------------------------------------- command line


class _Parser(argparse.ArgumentParser):
    """Argument errors raise :class:`BenchError`, which :func:`main` prints on one line."""

    def error(self, message: str) -> NoReturn:
        raise BenchError(message)


def build_parser() -> argparse.ArgumentParser:
    """The command line of :func:`main`."""
    p = _Parser(
        prog="python benchmarks/bench.py",
        description="Time training steps and decoding against a naive reference.",
    )
    p.add_argument(
        "--sizes",
        default="shapes,coco",
        help="comma-separated: shapes, coco, tiny (seconds, for smoke runs)",
    )
    p.add_argument(
        "--device",
        choices=["cpu", "cuda", "all"],
        default="all",
        help="all: CPU, and CUDA when available (default)",
    )
    p.add_argument("--precisions", default="fp32,bf16", help="fp32 and/or bf16 autocast")
    p.add_argument(
        "--compile",
        action="store_true",
        help="also time torch.compile'd variants (slow to compile; off by default)",
    )
    p.add_argument("--repeats", type=int, default=5, help="timed runs, median reported")
    p.add_argument("--warmup", type=int, default=1, help="untimed runs first (default 1)")
    p.add_argument(
        "--ref-repeats",
        type=int,
        default=None,
        help="timed runs of the slow reference (default: --repeats; 2 at coco size)",
    )
    p.add_argument(
        "--full-repeats",
        type=int,
        default=None,
        help="timed runs of the full step (default as --ref-repeats)",
    )
    p.add_argument("--skip-full", action="store_true", help="leave out the full step")
    p.add_argument("--batch-size", type=int, default=None, help="override every size's batch")
    p.add_argument(
        "--check-images",
        type=int,
        default=None,
        help="images in the reference checks (default: shapes all, coco 8)",
    )
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="one warm-up and one run of each")
    p.add_argument(
        "--skip-cider", action="store_true", help="leave out the CIDEr-D reward comparison"
    )
    p.add_argument(
        "--cider-corpus",
        type=int,
        default=8000,
        help="training images of the CIDEr-D comparison (default 8000, as shapes)",
    )
    p.add_argument("--quiet", action="store_true", help="no progress lines")
    add_result_options(p, "every timing, one row each")
    p.add_argument(
        "--out",
        default="runs/bench/bench.json",
        help="JSON results; the Markdown table goes beside it (.md)",
    )
    return p


def options_from_args(args: argparse.Namespace) -> BenchOptions:
    """:class:`BenchOptions` from parsed arguments of :func:`build_parser`.

    Args:
        args: the parsed command line.
    """
    names = {f.name for f in dataclasses.fields(BenchOptions)} - {"sizes", "precisions"}
    return BenchOptions(
        sizes=[s.strip() for s in args.sizes.split(",") if s.strip()],
        precisions=[p.strip() for p in args.precisions.split(",") if p.strip()],
        **{name: getattr(args, name) for name in names},
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark from the command line; print the Markdown tables.

    Args:
        argv: the arguments (None: ``sys.argv[1:]``).

    Returns:
        0, 1 when ours and the reference disagree, 2 for options that cannot run (printed
        as one ``error:`` line), 130 when interrupted.
    """
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    try:
        args = build_parser().parse_args(argv)
        options = options_from_args(args)
        results = run_benchmark(options)
    except CaptioningError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    print(format_markdown(results))
    print(f"wrote {options.out} and {Path(options.out).with_suffix('.md')}")
    if args.results is not None:
        record_timings(args.results, results, argv, timed_alone=not args.machine_busy)
        print(f"merged {len(results['measurements'])} rows into {args.results}")
    if not results["passed"]:
        print("error: ours and the reference disagree (see the checks table)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
