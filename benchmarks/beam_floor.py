"""How fast beam search could be on this machine: the arithmetic every implementation of
the COCO-size model must do, timed on its own.

    python -m benchmarks.beam_floor --bench runs/bench/bench.json
    python -m benchmarks.beam_floor --beam-size 3 --images 32
    python -m benchmarks.beam_floor --beam-size 1 --bench runs/bench/bench.json   (greedy)

Per word, beam search over B images with K beams runs the decoder's dense layers on B*K
rows (LSTM cell, deep output, vocabulary projection, attention query, gate, context) and the
additive score w^T tanh(k_i + q) on B*K*L*A values; once per caption, it projects the grid
into the score's keys. Both the reference and ours must do this work; the reference adds the
re-projection of the grid at every word. This script times these parts alone, with nothing
around them, at the sizes of ``python -m benchmarks.bench --sizes coco``:

- the dense layers, each as one matrix product (the key projection once on B*L rows, the
  others on B*K rows), in the fastest form of the few-row products on this CPU (torch's
  own, the transposed or the packed form of :mod:`captioning.models.packing`), and their
  FLOPs at the rate of one large square product (the machine's best case);
- the score as eager code must run it, three passes over one image's block at a time with
  no allocation (the add into a buffer, ``tanh_`` in place, or ``sigmoid_`` where that is
  faster: tanh(x) = 2 sigmoid(2x) - 1, the 2s folded into the other passes as ours folds
  them; the projection onto w): each
  pass timed on its own, and the three in sequence over every image's own keys; the score
  as the one C kernel ours runs where it is built (:mod:`captioning.models.fused_score`;
  the eager floor takes the faster of the two); and the whole score as the one fused
  reduction ``torch.compile`` makes of it;
- the word choice: the log-softmax of every row over the vocabulary and the top K of each
  image's rows.

Each part is timed alone, and then each word's parts are run in turn (dense layers, score,
word choice), as a word must run them, where each finds the caches as the others left them.
That sequence over a caption of ``--max-length`` words (the first word on B rows: every beam
of an image starts the same), plus the key projection, is the floor under any
implementation that computes the same numbers. Greedy decoding is the same work with one
beam (``--beam-size 1``). Given a ``bench.json``, it prints the largest speed-up over that
run's reference that the floor allows, and our times in that run against the floor;
``--ours`` times our decoding itself, right after each of ``--rounds`` rounds of the floor,
since this machine's speed drifts. ``--results FILE`` merges the medians, the rounds' ratios
and the reference's time into a results file as one row per task and host
(``results/speed.json``); a row of other threads, images or caption length is replaced only
with ``--replace``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from benchmarks.beam_floor_parts import CELLS, COCO, FEATURE_DIM, VOCAB, WIDTH, Floor
from benchmarks.reference_decoding import DECODERS
from benchmarks.timing import median_seconds
from benchmarks.workload import our_decoding, seeded_setup
from captioning.allocator import keep_freed_memory
from captioning.config import replace_section
from captioning.models import Decoder, build_attention
from captioning.models.attention import AttentionSizes
from lab.options import fail
from lab.provenance import add_replace_option, add_result_options, device_name, record
from lab.results import ResultsError


def bench_seconds(path: Path, task: str, impl: str = "reference", compiled: bool = False) -> float:
    """A median time for ``task`` at COCO size, fp32 on the CPU, from a bench run.

    Args:
        path: a ``bench.json`` of ``python -m benchmarks.bench``.
        task: ``greedy``, ``beam3``, ``beam5``, ...
        impl: ``reference`` or ``ours``.
        compiled: ours under ``torch.compile``.

    Raises:
        OSError, ValueError, KeyError: the file cannot be read as a bench.json.
        StopIteration: it holds no such measurement.
    """
    results = json.loads(path.read_text())
    return next(
        m["median_s"]
        for m in results["measurements"]
        if m["size"] == "coco"
        and m["device"] == "cpu"
        and m["precision"] == "fp32"
        and m["task"] == task
        and m["impl"] == impl
        and bool(m.get("compiled")) == compiled
        and m.get("median_s")
    )


def build_parser() -> argparse.ArgumentParser:
    """The command line of :func:`main`."""
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.beam_floor", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--beam-size", type=int, default=5)
    parser.add_argument("--images", type=int, default=32)
    parser.add_argument("--max-length", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--no-compile", action="store_true", help="skip the fused score")
    parser.add_argument("--bench", type=Path, help="a bench.json with the reference's time")
    parser.add_argument(
        "--ours",
        action="store_true",
        help="also time our decoding, right after each round of the floor",
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=3,
        help="with --ours: rounds of floor and ours (medians reported)",
    )
    add_result_options(parser, "the medians, as one row")
    add_replace_option(parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Time the floor and print it; with ``--bench``, the speed-up it allows.

    Args:
        argv: the arguments (None: ``sys.argv[1:]``).

    Returns:
        0, or 2 when the bench file holds no reference time or the row would replace one
        of other settings in ``--results``.
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    keep_freed_memory()  # as the command line runs
    if min(args.beam_size, args.images, args.max_length, args.repeats, args.rounds) < 1:
        parser.error(
            "--beam-size, --images, --max-length, --repeats and --rounds must be at least 1"
        )
    task = "greedy" if args.beam_size == 1 else f"beam{args.beam_size}"
    if args.ours and task not in DECODERS:
        parser.error(f"--ours times {', '.join(DECODERS)}: use --beam-size 1, 3 or 5")
    reference = None
    if args.bench is not None:
        try:
            reference = bench_seconds(args.bench, task)
        except (OSError, ValueError, KeyError, StopIteration) as exc:
            print(
                f"error: no fp32 CPU reference time for {task} at COCO size in {args.bench} "
                f"({type(exc).__name__}); run `python -m benchmarks.bench --sizes coco` first",
                file=sys.stderr,
            )
            return 2

    torch.manual_seed(0)
    model = COCO.config.model
    # the FLOP count below takes one width for embedding, attention and LSTM, a scalar gate,
    # the deep output and the context fed to the LSTM, as the COCO size has them
    assert model.embed_dim == model.attention_dim == WIDTH and model.gate == "scalar"
    assert model.deep_output and model.context_to_lstm
    attention = build_attention(
        model, AttentionSizes(FEATURE_DIM, WIDTH, CELLS, (14, 14), FEATURE_DIM)
    )
    decoder = Decoder(VOCAB, FEATURE_DIM, attention, embed_dim=WIDTH, hidden_dim=WIDTH).eval()
    floor = Floor(decoder, args.beam_size, args.images, args.max_length, not args.no_compile)
    ours = _ours(args, task) if args.ours else {}
    rounds = []
    for _ in range(args.rounds if args.ours else 1):
        parts = floor.measure(args.repeats)
        # ours right after the floor it is compared with: this machine's speed drifts
        timed = {name: median_seconds(fn, 3, warmup=1) for name, fn in ours.items()}
        rounds.append((parts, timed))
    parts = {key: statistics.median(r[0][key] for r in rounds) for key in rounds[0][0]}

    k, b = args.beam_size, args.images
    name = "greedy" if k == 1 else f"beam k={k}"
    print(
        f"{name}, {b} images, {args.max_length} words, COCO size, {torch.get_num_threads()} threads"
    )
    print(
        f"dense layers:                    {parts['dense']:.3g} s  ({floor.gflop:.0f} GFLOP, "
        f"{floor.gflop / parts['dense']:.0f} GFLOP/s)"
    )
    print(
        f"dense layers at the peak rate:   {floor.gflop / parts['peak']:.3g} s  "
        f"({parts['peak']:.0f} GFLOP/s, 2048 x 2048 matrix product)"
    )
    print(f"dense layers, torch's own:       {parts['dense_plain']:.3g} s")
    for form in ("transposed", "packed"):
        if f"dense_{form}" in parts:
            print(f"dense layers, {form + ':':19s}{parts[f'dense_{form}']:.3g} s")
    for name in ("add", "tanh", "sigmoid", "projection"):
        print(
            f"score, eager {name + ':':24s}{parts[name]:.3g} s  "
            f"({floor.activations / 1e6:.0f}M values)"
        )
    print(
        f"word choice:                     {parts['choice']:.3g} s  (log-softmax over "
        f"{VOCAB} words, top {k} per image)"
    )
    print(
        f"score, eager, in sequence:       {parts['sequence']:.3g} s  (the three passes "
        f"over each image's block in turn, the faster of tanh and sigmoid)"
    )
    if "kernel" in parts:
        print(f"score, one C kernel:             {parts['kernel']:.3g} s  (fused_score)")
    score = min(parts["sequence"], parts.get("kernel", parts["sequence"]))
    alone = {"eager": parts["dense"] + score + parts["choice"]}
    if "fused" in parts:
        alone["compiled"] = parts["dense"] + parts["fused"] + parts["choice"]
    print(
        "sum of the parts timed alone: "
        + ", ".join(f"{name} {value:.3g} s" for name, value in alone.items())
    )
    floors = {"eager": [r[0]["eager"] for r in rounds]}
    if "fused" in parts:
        print(f"whole score, compiled (fused):   {parts['fused']:.3g} s")
        floors["compiled"] = [r[0]["compiled"] for r in rounds]
    row: dict[str, Any] = {
        "kind": "floor",
        "task": task,
        "beam_size": k,
        "images": b,
        "max_length": args.max_length,
        "rounds": len(rounds),
        "repeats": args.repeats,
        "gflop": round(floor.gflop, 1),
        "parts": parts,
        "reference_seconds": reference,
        "precision": "fp32",
        "device": device_name("cpu"),
        "threads": torch.get_num_threads(),
    }
    for name, values in floors.items():
        value = statistics.median(values)
        row[f"floor_{name}"] = value
        line = f"floor, {name} (each word's parts in turn): {value:.3g} s"
        if reference is not None:
            line += f"; at most {reference / value:.1f}x the reference's {reference:.2f} s"
            if not ours:
                try:
                    seconds = bench_seconds(args.bench, task, "ours", compiled=name == "compiled")
                    line += f"; ours in that run {seconds:.3g} s, {seconds / value:.2f}x the floor"
                except StopIteration:
                    pass  # the bench run did not time this variant of ours
        if name in ours:
            ratios = [r[1][name] / f for r, f in zip(rounds, values, strict=True)]
            seconds = statistics.median(r[1][name] for r in rounds)
            line += (
                f"; ours {seconds:.3g} s, {statistics.median(ratios):.2f}x the floor "
                f"(rounds: {', '.join(f'{x:.2f}' for x in ratios)})"
            )
            row[f"ours_{name}"], row[f"ratios_{name}"] = seconds, ratios
        print(line)
    if reference is not None:
        print(f"20x the reference needs {reference / 20:.3g} s")
    if args.results is not None:
        try:
            record(
                args.results,
                [row],
                lambda r: (r["kind"], r.get("task"), r.get("device")),
                module="benchmarks.beam_floor",
                argv=argv,
                timed_alone=not args.machine_busy,
                settings=("precision", "threads", "images", "max_length"),
                replace=args.replace,
            )
        except ResultsError as exc:
            return fail(exc)
        print(f"merged the row into {args.results}")
    return 0


def _ours(args: argparse.Namespace, task: str) -> dict[str, Callable[[], object]]:
    """Our decoding as :mod:`benchmarks.bench` times it (a random COCO-size model, every
    caption run to ``--max-length`` words), eager and, unless ``--no-compile``, with its
    step compiled."""
    config = replace_section(COCO.config, "decode", max_length=args.max_length)
    size = dataclasses.replace(COCO, config=config, batch_size=args.images)
    setup = seeded_setup(size)
    ours = {"eager": our_decoding(setup, task, "fp32", compiled=False)}
    if not args.no_compile:
        ours["compiled"] = our_decoding(setup, task, "fp32", compiled=True)
    return ours


if __name__ == "__main__":
    raise SystemExit(main())
