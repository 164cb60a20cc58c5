"""Where a training epoch's time goes, phase by phase, for a config as it trains.

    python -m benchmarks.profile_epoch --config configs/shapes_soft.yaml [--set KEY=VALUE ...]
        [--steps 20] [--ops] [--out runs/profile/shapes_soft.json]

It builds the run exactly as ``captioning train`` does (:func:`captioning.training.setup.set_up`)
and times ``--steps`` calls of :func:`captioning.training.step.train_step` after two warm-up steps,
split with hooks into: waiting for the batch (the data loader), the encoder's forward, the rest of
the forward and the loss (positions, grid layers, decoder), the decoder's backward (until the
gradient reaches the encoder's output), the encoder's backward, and what follows (clipping, Adam,
schedule). Then it times one validation as training runs it: decoding the split and scoring the
captions. The epoch estimate is steps per epoch x the median step plus one validation, scaled by ``1
/ train.val_every``. With ``data.cache_images`` the images are decoded into the cache first (timed
apart: the first epoch's extra cost), so the data phase is that of every later epoch.

``--step-loop`` makes teacher forcing run word by word even where all words could run at once
(``runtime.parallel_decoder=false``), and ``--no-channels-last`` runs the encoder's
convolutions on plain NCHW tensors (``runtime.channels_last=false``): what the code did
before those two changes, for before/after tables.
``--ops`` adds torch.profiler's table of the operators with the most self time over the timed
steps. ``--compile`` calls the model through ``torch.compile`` (the whole forward, and through
AOTAutograd the backward): phases are not split then (hooks would break the graph), the first
steps' compilation is timed apart (``compile_warmup_seconds``: the warm-up steps, each
caption length a new shape until the compiler marks it dynamic) and the loss of one batch is
compared with the eager model's (``compiled_loss_difference``). Prints a Markdown table;
``--out`` also writes the numbers as JSON, and ``--results FILE`` merges them into a results
file as one row (``results/speed.json``); a row of other threads, precision or batch size
is replaced only with ``--replace``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from captioning.allocator import keep_freed_memory
from captioning.config import load_config
from captioning.inference.caption import decode_dataset
from captioning.metrics.scoring import score_predictions
from captioning.objectives import Batch
from captioning.runtime import resolve_device, resolve_precision
from captioning.training.setup import Setup, set_up
from captioning.training.step import train_step
from captioning.training.train import SINGLE
from lab.options import errors_in_one_line
from lab.provenance import add_replace_option, add_result_options, portable, record

PHASES = (
    "data",
    "encoder forward",
    "decoder forward + loss",
    "decoder backward",
    "encoder backward",
    "clip + optimiser",
)


class _Clock:
    """Time stamps taken by hooks during one training step."""

    def __init__(self) -> None:
        self.marks: dict[str, float] = {}

    def mark(self, name: str) -> None:
        self.marks.setdefault(name, time.perf_counter())


def _instrument(setup: Setup, clock: _Clock) -> None:
    """Hooks that stamp the end of the encoder's forward, the arrival of the gradient at its
    output, and the end of its backward (the gradient of its first parameter)."""
    encoder = setup.run.model.encoder

    def after_forward(_module: Any, _inputs: Any, output: torch.Tensor) -> None:
        clock.mark("encoder forward")
        if output.requires_grad:
            output.register_hook(lambda grad: clock.mark("decoder backward"))

    encoder.register_forward_hook(after_forward)
    first = next((p for p in encoder.parameters() if p.requires_grad), None)
    if first is not None:
        first.register_post_accumulate_grad_hook(lambda _p: clock.mark("encoder backward"))
    loss = setup.run.objective.loss

    def timed_loss(*args: Any, **kwargs: Any) -> Any:
        terms = loss(*args, **kwargs)
        clock.mark("decoder forward + loss")
        return terms

    setup.run.objective.loss = timed_loss


def _step_phases(setup: Setup, clock: _Clock, batches: Any, device: torch.device) -> dict:
    clock.marks = {"start": time.perf_counter()}
    batch = next(batches)
    clock.mark("data")
    train_step(setup.run, setup.module, batch, device)
    clock.mark("clip + optimiser")
    order = ["start", *PHASES]
    times = [clock.marks.get(name) for name in order]
    phases = {}
    previous = times[0]
    for name, stamp in zip(order[1:], times[1:]):
        if stamp is None:  # a frozen encoder has no backward of its own
            phases[name] = 0.0
            continue
        phases[name] = stamp - previous
        previous = stamp
    return phases


def _batches(setup: Setup) -> Any:
    epoch = 0
    while True:
        setup.sampler.set_epoch(epoch)
        yield from setup.loader
        epoch += 1


def profile_epoch(
    config: str,
    overrides: Sequence[str],
    steps: int,
    ops: bool = False,
    step_loop: bool = False,
    channels_last: bool = True,
    compile: bool = False,
    warmup: int = 2,
    backend: str = "inductor",
) -> dict[str, Any]:
    """Median phase times of ``steps`` training steps (after ``warmup`` untimed ones) and
    one validation's decode and scoring, for ``config`` with ``overrides``; with
    ``compile``, of the model called through ``torch.compile``."""
    switches = [
        f"runtime.parallel_decoder={not step_loop}",
        f"runtime.channels_last={channels_last}",
    ]
    cfg = load_config(config, [*overrides, *switches, "train.quiet=true"])
    device = resolve_device(cfg.train.device)
    setup = set_up(cfg, None, SINGLE, device)
    setup.run.model.train()
    dataset = setup.loader.dataset
    started = time.perf_counter()
    if cfg.data.cache_images and cfg.data.num_workers == 0 and hasattr(dataset, "image"):
        for index in range(len(dataset)):  # what the first epoch does once, on the side
            dataset.image(index)
    first_epoch_loading = time.perf_counter() - started
    clock = _Clock()
    batches = _batches(setup)
    loss_difference = None
    if compile:
        batch = next(batches)
        eager = setup.module
        setup.module = torch.compile(eager, backend=backend)
        images = batch["images"].to(device) if "images" in batch else None
        grid = batch["grid"].to(device) if "grid" in batch else None
        with torch.no_grad():
            losses = [
                setup.run.objective.loss(
                    module, Batch(batch["tokens"].to(device), images, grid)
                ).total.item()
                for module in (eager, setup.module)
            ]
        loss_difference = abs(losses[0] - losses[1])
    else:
        _instrument(setup, clock)
    started = time.perf_counter()
    for _ in range(warmup):
        _step_phases(setup, clock, batches, device)
    warmup_seconds = time.perf_counter() - started
    profiler = torch.profiler.profile() if ops else None
    samples: list[dict[str, float]] = []
    if profiler is not None:
        profiler.__enter__()
    for _ in range(steps):
        samples.append(_step_phases(setup, clock, batches, device))
    if profiler is not None:
        profiler.__exit__(None, None, None)
    step = {name: statistics.median(s[name] for s in samples) for name in PHASES}
    if compile:  # no hooks: everything after the data is one phase
        step = {
            "data": step["data"],
            "forward, backward, optimiser": statistics.median(
                sum(s.values()) - s["data"] for s in samples
            ),
        }
    started = time.perf_counter()
    predictions, _ = decode_dataset(setup.run.model, setup.val_dataset, cfg, device)
    decode_seconds = time.perf_counter() - started
    started = time.perf_counter()
    score_predictions(predictions, setup.val_dataset.records, meteor=False)
    score_seconds = time.perf_counter() - started
    steps_per_epoch = len(setup.loader)
    step_seconds = statistics.median(sum(s.values()) for s in samples)
    validation = (decode_seconds + score_seconds) / cfg.train.val_every
    return {
        "config": config,
        "overrides": list(overrides),
        "step_loop": step_loop,
        "channels_last": channels_last,
        "compiled": compile,
        "compile_warmup_seconds": warmup_seconds if compile else None,
        "compiled_loss_difference": loss_difference,
        "threads": torch.get_num_threads(),
        "precision": resolve_precision(cfg.train.precision, device),
        "device": device.type,
        "batch_size": cfg.train.batch_size,
        "steps_per_epoch": steps_per_epoch,
        "step_seconds": step_seconds,
        "phases": step,
        "first_epoch_image_loading_seconds": first_epoch_loading,
        "validation_decode_seconds": decode_seconds,
        "validation_score_seconds": score_seconds,
        "epoch_seconds": steps_per_epoch * step_seconds + validation,
        "ops": None
        if profiler is None
        else profiler.key_averages().table(sort_by="self_cpu_time_total", row_limit=15),
    }


def format_markdown(result: dict[str, Any]) -> str:
    steps = result["steps_per_epoch"]
    epoch = result["epoch_seconds"]
    lines = [
        f"{result['config']} {' '.join(result['overrides'])}".rstrip()
        + f": batch {result['batch_size']}, {steps} steps per epoch, "
        f"{result['threads']} threads"
        + (", step loop" if result["step_loop"] else "")
        + ("" if result["channels_last"] else ", NCHW convolutions")
        + (", torch.compile" if result.get("compiled") else ""),
        "",
        "| phase | per step | per epoch | share |",
        "| --- | --- | --- | --- |",
    ]
    for name, seconds in result["phases"].items():
        lines.append(
            f"| {name} | {seconds * 1e3:.0f} ms | {seconds * steps:.1f} s | "
            f"{seconds * steps / epoch:.0%} |"
        )
    for name in ("decode", "score"):
        seconds = result[f"validation_{name}_seconds"]
        lines.append(f"| validation: {name} | | {seconds:.1f} s | {seconds / epoch:.0%} |")
    lines.append(f"| **epoch** | {result['step_seconds'] * 1e3:.0f} ms | {epoch:.1f} s | |")
    if result["first_epoch_image_loading_seconds"] > 0:
        lines += [
            "",
            f"The first epoch also decodes every image once into the cache "
            f"(`data.cache_images`): {result['first_epoch_image_loading_seconds']:.1f} s; "
            f"the table is for the epochs after it.",
        ]
    if result.get("compiled"):
        lines += [
            "",
            f"Compiled: the warm-up steps took {result['compile_warmup_seconds']:.1f} s "
            f"(compilation); one batch's loss differs from the eager model's by "
            f"{result['compiled_loss_difference']:.2g}.",
        ]
    if result["ops"]:
        lines += ["", "```", result["ops"].rstrip(), "```"]
    return "\n".join(lines)


@errors_in_one_line
def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.profile_epoch", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--config", required=True, help="YAML config, as for train")
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a config value (repeatable)",
    )
    parser.add_argument("--steps", type=int, default=20, help="timed steps (default 20)")
    parser.add_argument("--ops", action="store_true", help="add torch.profiler's top operators")
    parser.add_argument(
        "--step-loop",
        action="store_true",
        help="teacher forcing word by word (the code before all-at-once)",
    )
    parser.add_argument(
        "--no-channels-last",
        action="store_true",
        help="NCHW convolutions (the code before channels-last)",
    )
    parser.add_argument(
        "--compile",
        action="store_true",
        help="call the model through torch.compile (whole steps, not phases)",
    )
    parser.add_argument(
        "--backend",
        default="inductor",
        help="torch.compile's backend with --compile (default inductor)",
    )
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first (default 2)")
    parser.add_argument("--out", help="also write the numbers as JSON here")
    add_result_options(parser, "the numbers, as one row")
    add_replace_option(parser)
    args = parser.parse_args(argv)
    keep_freed_memory()  # as the command line runs
    if args.steps < 1:
        parser.error("--steps must be at least 1")
    result = profile_epoch(
        args.config,
        args.set,
        args.steps,
        args.ops,
        args.step_loop,
        not args.no_channels_last,
        args.compile,
        args.warmup,
        args.backend,
    )
    print(format_markdown(result))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    if args.results is not None:
        row = {"kind": "profile", **{k: v for k, v in result.items() if k != "ops"}}
        # the row names the config and the overrides' paths as the command does
        row["config"] = portable(row["config"])
        row["overrides"] = [portable(o) for o in row["overrides"]]
        key = ("kind", "device", "config", "overrides", "step_loop", "channels_last", "compiled")
        record(
            args.results,
            [row],
            lambda r: tuple(str(r.get(k)) for k in key),
            module="benchmarks.profile_epoch",
            argv=argv,
            timed_alone=not args.machine_busy,
            device=row["device"],
            settings=("threads", "precision", "batch_size"),
            replace=args.replace,
        )
        print(f"merged the row into {args.results}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
