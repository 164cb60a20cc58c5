"""Speed benchmark: training steps and decoding, ours against a naive reference.

    python -m benchmarks.bench --sizes shapes,coco [--compile] [--out runs/bench/bench.json]
    python -m benchmarks.bench --sizes tiny --quick   (a smoke run of seconds)
    python -m benchmarks.bench --help

Run from the repository root. The pieces: :mod:`benchmarks.workload` (sizes, data and the
timed callables), :mod:`benchmarks.timing` (one measurement), :mod:`benchmarks.bench_options`
(the options and command line) and :mod:`benchmarks.bench_report` (tables and rows).

What is timed, as medians over ``--repeats`` runs after ``--warmup`` runs:

- ``decoder_step``: one training step on cached backbone grids, a random (B, L, D) tensor:
  :func:`captioning.training.step.train_step` itself, the step training takes (forward under
  autocast of the measured precision, loss, backward, gradient clipping, Adam, schedule);
- ``full_step``: the same step on images (images → encoder → decoder). The size's
  ``fine_tune`` says whether the encoder trains (shapes: ``all``) or runs frozen under
  no_grad (coco: ``none``, a random-init ResNet-101 at 448 px, so nothing downloads);
- ``greedy``, ``beam3``, ``beam5``: captioning one batch of cached grids through
  :func:`captioning.inference.caption.caption_batch`, in images/s and words/s. Every caption runs to
  the size's ``max_length`` (``<end>`` is masked through ``min_length``), so the work does not
  depend on where random weights happen to end a caption.

Each is timed for our code and for the reference of :mod:`benchmarks.reference` and
:mod:`benchmarks.reference_decoding`, written the
way popular tutorial code does it: the same weights, but the grid is re-projected at every
word, the output layer runs one step at a time, and decoding goes one image at a time. For the
decoder step the reference decoder takes our decoder's place in a captioner and goes through
the same ``train_step``. Before timing, the two are checked against each other
(:func:`benchmarks.reference_check.check_reference`); a failed check exits with status 1.

Peak memory is the high-water mark during set-up, warm-up and repeats minus the memory in
use just before: for a training step the copy of the model (encoder included), the
gradients, Adam's state and the activations; for decoding its working memory. See
:mod:`benchmarks.memory` for how it is measured on CPU and CUDA.

Beside them, ``cider``: the CIDEr-D reward of one self-critical batch (64 images x 5 samples
against an 8000-image training corpus), :class:`captioning.metrics.cider.CiderD` against
pycocoevalcap's scorer called per batch (see :mod:`benchmarks.cider_speed`).

Writes the JSON file and a Markdown table beside it, and prints the table. ``--results FILE``
also merges every measurement into a committed results file (``results/speed.json``), one
row each with the command, commit and machine (``--machine-busy``: not timed alone); it
refuses to replace a row made with other threads or settings (exit 2).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import sys
from collections.abc import Sequence
from functools import partial
from pathlib import Path
from typing import Any

import torch

from benchmarks.bench_options import BenchOptions, build_parser, options_from_args, validate
from benchmarks.bench_report import format_markdown, record_timings, write_run_files
from benchmarks.cider_speed import bench_cider
from benchmarks.memory import environment
from benchmarks.reference_check import check_reference
from benchmarks.reference_decoding import DECODERS, captions_equal
from benchmarks.timing import Job, measure, speedups
from benchmarks.workload import (
    SIZES,
    BenchSize,
    Setup,
    decoder_step,
    full_step,
    our_decoding,
    random_batch,
    reference_decoding,
    resolve_devices,
    set_up,
)
from captioning.allocator import keep_freed_memory
from captioning.config import config_to_dict, replace_section
from captioning.errors import CaptioningError
from captioning.inference.decoding import Decoded
from captioning.models import Captioner, build_model
from lab.options import fail

logger = logging.getLogger("benchmarks")


def _jobs(setup: Setup, precision: str, compiled: bool, options: BenchOptions) -> list[Job]:
    """The measurements of one (size, device, precision, compiled) variant: for each task
    the reference first (uncompiled variants only), then ours."""
    size = setup.size
    cfg = replace_section(size.config, "train", precision=precision)  # autocast of the step
    words = int(setup.batch["tokens"][:, 1:].numel())  # teacher-forced words
    repeats, slow = _repeats(size, options)
    jobs = []
    if not compiled:
        reference_step = partial(decoder_step, setup, cfg, True, False)
        jobs.append(Job("decoder_step", "reference", reference_step, slow, words))
    ours_step = partial(decoder_step, setup, cfg, False, compiled)
    jobs.append(Job("decoder_step", "ours", ours_step, repeats, words))
    if not options.skip_full:
        full_repeats = 1 if options.quick else options.full_repeats or slow
        full = partial(full_step, setup, cfg, compiled)
        jobs.append(Job("full_step", "ours", full, full_repeats, words))
    for task in DECODERS:
        if not compiled:
            reference_decode = partial(reference_decoding, setup, task, precision)
            jobs.append(Job(task, "reference", reference_decode, slow, None))
        ours_decode = partial(our_decoding, setup, task, precision, compiled)
        jobs.append(Job(task, "ours", ours_decode, repeats, None))
    return jobs


def _repeats(size: BenchSize, options: BenchOptions) -> tuple[int, int]:
    """(repeats of ours, repeats of the reference)."""
    if options.quick:
        return 1, 1
    slow = options.ref_repeats or min(size.slow_repeats or options.repeats, options.repeats)
    return options.repeats, slow


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
    validate(options)
    keep_freed_memory()  # as the command line runs: ours and the reference alike
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
            _progress(
                options,
                "%s %s: checking ours against the reference on %d images",
                name,
                device.type,
                min(checked, size.batch_size),
            )
            check = check_reference(
                model.decoder,
                size.config.model,
                batch["grid"][:checked],
                batch["tokens"][:checked],
                size.config.decode.max_length,
                device,
            )
            results["checks"].append({"size": name, "device": device.type, **check})
            if not check["passed"]:
                logger.warning(
                    "%s %s: ours and the reference disagree: %s",
                    name,
                    device.type,
                    json.dumps(check["captions"]),
                )
            setup = set_up(size, model, batch, device)
            results["measurements"] += _time_device(setup, warmup, compile_modes, options)
    results["speedups"] = speedups(results["measurements"])
    if not options.skip_cider:
        corpus = min(options.cider_corpus, 200) if options.quick else options.cider_corpus
        _progress(options, "CIDEr-D: ours against pycocoevalcap per batch, corpus %d", corpus)
        results["cider"] = bench_cider(
            corpus, repeats=1 if options.quick else options.repeats, seed=options.seed
        )
    results["passed"] = all(check["passed"] for check in results["checks"])
    write_run_files(results, Path(options.out))
    return results


def _time_device(
    setup: Setup, warmup: int, compile_modes: list[bool], options: BenchOptions
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
                row = {
                    "size": size.name,
                    "device": device.type,
                    "precision": precision,
                    "compiled": compiled,
                    **row,
                }
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


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark from the command line; print the Markdown tables.

    Args:
        argv: the arguments (None: ``sys.argv[1:]``).

    Returns:
        0, 1 when ours and the reference disagree, 2 for options that cannot run or rows
        that would replace rows of other settings (printed as one ``error:`` line), 130 when
        interrupted.
    """
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    try:
        args = build_parser().parse_args(argv)
        options = options_from_args(args)
        results = run_benchmark(options)
    except CaptioningError as exc:
        return fail(exc)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    print(format_markdown(results))
    print(f"wrote {options.out} and {Path(options.out).with_suffix('.md')}")
    if args.results is not None:
        try:
            record_timings(
                args.results, results, argv, timed_alone=not args.machine_busy, replace=args.replace
            )
        except CaptioningError as exc:
            return fail(exc)
        print(f"merged {len(results['measurements'])} rows into {args.results}")
    if not results["passed"]:
        print("error: ours and the reference disagree (see the checks table)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
