"""How fast a training step could be on this machine: the matrix products of the
paper-wiring step on cached grids, each timed on its own.

    python -m benchmarks.train_floor --sizes coco,flickr8k,flickr8k_14x14 --precisions fp32

Whatever its code, a training step of the paper's wiring runs the products of the model's
forward and backward passes: the grid's key projection and its weight's gradient once per
batch; at every word the query projection, the context's product over the grid, the gate and
the LSTM cell, and in the backward pass their input gradients; the weight gradients; the deep
output and the vocabulary projection over every word. This script records the products that
our step (as ``benchmarks.bench`` times it) runs, through a dispatch mode that sees what
autograd and autocast run (``mm``, ``addmm``, ``bmm``, ``baddbmm``, ``mv``, ``addmv``), and
times each distinct product alone, warm, as often as the step runs it: a 2-D product of at
least ``packing.MIN_ROWS`` rows in fp32 at the faster of torch's product and MKL's packed
one. Their sum is a floor under any step that computes the same numbers with products as
fast as torch's on this machine, and a low one: it leaves out the additive score's tanh,
the softmaxes, the LSTM's gate equations, dropout, gradient clipping and Adam, and every
product finds its operands in cache. Each round times the floor, then ours and the
reference's steps right after it (this machine's speed drifts); a row per size and precision
keeps the medians and the largest speed-up over the reference that the floor allows.
"""

from __future__ import annotations

import argparse
import math
import statistics
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from benchmarks.timing import median_seconds
from benchmarks.workload import (
    SIZES,
    decoder_step,
    seeded_setup,
    sizes_and_precisions,
)
from captioning.allocator import keep_freed_memory
from captioning.config import replace_section
from captioning.models import packing
from lab.provenance import add_replace_option, add_result_options, device_name, merge_rows

ATEN = torch.ops.aten
PRODUCTS = {
    ATEN.mm.default: "mm",
    ATEN.addmm.default: "addmm",
    ATEN.bmm.default: "bmm",
    ATEN.baddbmm.default: "baddbmm",
    ATEN.mv.default: "mv",
    ATEN.addmv.default: "addmv",
}


@dataclass(frozen=True)
class Operand:
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype

    @classmethod
    def of(cls, tensor: torch.Tensor) -> Operand:
        return cls(tuple(tensor.shape), tuple(tensor.stride()), tensor.dtype)

    def make(self, generator: torch.Generator) -> torch.Tensor:
        """A tensor of this shape, layout and dtype, of random values."""
        extent = 1 + sum((n - 1) * s for n, s in zip(self.shape, self.stride, strict=True))
        base = torch.randn(max(extent, 1), generator=generator).to(self.dtype)
        return base.as_strided(self.shape, self.stride)


@dataclass(frozen=True)
class Product:
    """One matrix product of the step: ``op`` over ``operands``."""

    op: str
    operands: tuple[Operand, ...]

    @property
    def dims(self) -> list[int]:
        """[batch,] rows, inner, columns: a vector product has one column."""
        *batch, rows, inner = self.operands[-2].shape
        cols = self.operands[-1].shape[-1] if self.op not in ("mv", "addmv") else 1
        return [*batch, rows, inner, cols]

    @property
    def gflop(self) -> float:
        return 2 * math.prod(self.dims) / 1e9

    @property
    def label(self) -> str:
        dtype = self.operands[-1].dtype
        name = {torch.float32: "fp32", torch.bfloat16: "bf16"}.get(dtype, str(dtype))
        return f"{self.op} {'x'.join(map(str, self.dims))} {name}"

    def runs(self, generator: torch.Generator) -> list[Callable[[], object]]:
        """Ways to run it alone: torch's op; in fp32 the same product with its operands
        swapped, ``(B^T A^T)^T`` (the transposed form of :mod:`captioning.models.packing`,
        or the form it replaces), and with enough rows the packed one."""
        tensors = [operand.make(generator) for operand in self.operands]
        op = getattr(ATEN, self.op).default
        ways: list[Callable[[], object]] = [lambda: op(*tensors)]
        a, b = tensors[-2:]
        rows = a.shape[0]
        packable = self.op in ("mm", "addmm") and a.dtype == torch.float32
        if packable:
            ways.append(lambda: torch.mm(b.t(), a.t()))
        if packable and rows >= packing.MIN_ROWS and packing.packing_available():
            weight = b.t()  # (N, K), as a linear layer's
            bias = tensors[0] if self.op == "addmm" and tensors[0].dim() == 1 else None
            packed = torch.ops.mkl._mkl_reorder_linear_weight(weight, rows)
            ways.append(lambda: torch.ops.mkl._mkl_linear(a, packed, weight, bias, rows))
        return ways


class _Recorder(TorchDispatchMode):
    """Counts the matrix products run inside it, by op, shapes, layouts and dtypes."""

    def __init__(self) -> None:
        super().__init__()
        self.products: Counter[Product] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        kwargs = kwargs or {}
        if func in PRODUCTS:
            tensors = tuple(Operand.of(x) for x in args if isinstance(x, torch.Tensor))
            self.products[Product(PRODUCTS[func], tensors)] += 1
        return func(*args, **kwargs)


def record_products(step: Callable[[], object]) -> Counter[Product]:
    """The products one call of ``step`` runs, with how often it runs each."""
    recorder = _Recorder()
    with recorder:
        step()
    return recorder.products


def time_products(products: Counter[Product], repeats: int) -> dict[Product, float]:
    """Each product's time alone (median of ``repeats``; the fastest way to run it) times
    the number of calls."""
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        return {
            product: count * min(median_seconds(run, repeats) for run in product.runs(generator))
            for product, count in products.items()
        }


def _calls(count: int) -> str:
    return f"{count} call" if count == 1 else f"{count} calls"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.train_floor", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--sizes", default="coco", help="of benchmarks.bench (default: coco)")
    parser.add_argument("--precisions", default="fp32", help="fp32 and/or bf16 (autocast)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of floor, ours, reference")
    parser.add_argument("--repeats", type=int, default=10, help="timed calls of each product")
    add_result_options(parser, "one row per size and precision")
    add_replace_option(parser)
    return parser


def measure(size_name: str, precision: str, rounds: int, repeats: int) -> dict[str, Any]:
    """One size and precision: the floor's products, and rounds of floor, ours, reference."""
    size = SIZES[size_name]()
    setup = seeded_setup(size)
    cfg = replace_section(size.config, "train", precision=precision)
    ours = decoder_step(setup, cfg, reference=False, compiled=False)
    reference = decoder_step(setup, cfg, reference=True, compiled=False)
    ours()  # the first call allocates what later ones reuse: record a later one
    products = record_products(ours)
    floors, timed = [], []
    for _ in range(rounds):
        parts = time_products(products, repeats)
        floors.append(sum(parts.values()))
        timed.append((median_seconds(ours, 3, warmup=1), median_seconds(reference, 3, warmup=1)))
    floor = statistics.median(floors)
    ours_s, reference_s = (statistics.median(t[i] for t in timed) for i in (0, 1))
    top = sorted(parts.items(), key=lambda item: -item[1])
    return {
        "kind": "train_floor",
        "size": size_name,
        "precision": precision,
        "batch_size": size.batch_size,
        "words": size.caption_length - 1,
        "rounds": rounds,
        "repeats": repeats,
        "products": len(products),
        "calls": sum(products.values()),
        "gflop": round(sum(p.gflop * n for p, n in products.items()), 2),
        "floor_seconds": floor,
        "ours_seconds": ours_s,
        "reference_seconds": reference_s,
        "ours_over_floor": [o / f for (o, _), f in zip(timed, floors, strict=True)],
        "reference_over_floor": [r / f for (_, r), f in zip(timed, floors, strict=True)],
        "largest": {
            f"{product.label}, {_calls(products[product])}": seconds for product, seconds in top[:6]
        },
        "device": device_name("cpu"),
        "threads": torch.get_num_threads(),
    }


def main(argv: list[str] | None = None) -> int:
    """Time the floor of each size and precision, and print it beside ours and the
    reference's step.

    Returns:
        0, or 2 when the row would replace one of other settings in ``--results``.
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    keep_freed_memory()  # as training runs: ours and the reference alike
    sizes, precisions = sizes_and_precisions(parser, args.sizes, args.precisions)
    if min(args.rounds, args.repeats) < 1:
        parser.error("--rounds and --repeats must be at least 1")
    rows = []
    for size in sizes:
        for precision in precisions:
            row = measure(size, precision, args.rounds, args.repeats)
            rows.append(row)
            allowed = row["reference_seconds"] / row["floor_seconds"]
            print(
                f"{size} {precision}: {row['calls']} products ({row['products']} distinct, "
                f"{row['gflop']:.1f} GFLOP) alone {row['floor_seconds']:.3g} s; "
                f"ours {row['ours_seconds']:.3g} s "
                f"({statistics.median(row['ours_over_floor']):.2f}x the floor), "
                f"reference {row['reference_seconds']:.3g} s: at most {allowed:.1f}x it"
            )
            for label, seconds in row["largest"].items():
                print(f"    {seconds:.3g} s  {label}")
    if args.results is None:
        return 0
    return merge_rows(
        args,
        rows,
        lambda r: (r.get("kind"), r.get("device"), r.get("size"), r.get("precision")),
        module="benchmarks.train_floor",
        argv=argv,
        settings=("threads", "batch_size", "words"),
    )


if __name__ == "__main__":
    raise SystemExit(main())
