"""How much of this machine's arithmetic training and decoding use: a roofline.

    python -m benchmarks.roofline --results results/roofline.json
    python -m benchmarks.roofline --precisions fp32 --repeats 3 --images 32

1. **The peak**: the median rate of ``torch.mm`` on one large square product (2,048 x 2,048
   x 2,048, the machine's best case) and on the largest products the COCO-size decoder makes
   (a word's vocabulary projection and LSTM cell over the rows of beam search), in each
   precision asked (bf16 only where the CPU computes it natively).
2. **The work**: the matrix FLOPs of each task as it runs, counted by torch's
   ``FlopCounterMode`` (matrix products, batched products and convolutions; elementwise work
   such as the score's tanh is not counted, so a task whose time goes to it shows a low
   share): a training step on cached grids (forward and backward), beam search with 5 beams
   and greedy decoding, every caption run to ``decode.max_length`` words, at the COCO size
   of ``python -m benchmarks.bench --sizes coco`` (14 x 14 x 2,048 grid, LSTM 512, 10,000
   words, 32 images).
3. **The share**: the task's FLOPs over its median seconds, as a share of each peak.
4. **The memory roof** (decoding): the host's read bandwidth (the median rate of summing
   512 MB) and the bytes a decoding must read at every word whatever its code: each weight
   matrix the step multiplies by, the grid (for the context) and its keys (for the score),
   all larger than a core's cache. A task cannot run faster than the larger of its FLOPs at
   the decoder's peak and its bytes at that bandwidth: its share of the roofline is that
   bound over its time.
5. **Torch's own layers**: each task is also timed with torch's own layers, in alternating
   rounds: decoding without the weights packed once per batch
   (:mod:`captioning.models.packing`), training with the LSTM cell's weight gradients taken
   word by word (:mod:`captioning.models.deferred`); and, where the C kernel of the
   additive score is built (:mod:`captioning.models.fused_score`), with the score in
   torch's form instead.

Each row names the task, precision, threads and host (``--results FILE`` merges them into a
results file; ``python -m tools.tables`` renders ``results/roofline.json`` into
docs/speed.md). Time it on an otherwise idle machine (``--machine-busy`` says it was not).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Callable
from typing import Any

import torch
from torch.utils.flop_counter import FlopCounterMode

from benchmarks.timing import median_seconds
from benchmarks.workload import (
    coco_size,
    decoder_step,
    our_decoding,
    seeded_setup,
)
from captioning.allocator import keep_freed_memory
from captioning.config import replace_section
from captioning.models import deferred, fused_score, packing, scores
from captioning.runtime import native_bf16
from lab.options import errors_in_one_line
from lab.provenance import add_replace_option, add_result_options, device_name, merge_rows

TASKS = ("train", "beam5", "greedy")


def matmul_rate(rows: int, inner: int, cols: int, precision: str, repeats: int) -> float:
    """GFLOP/s of ``torch.mm`` of (rows, inner) by (inner, cols) in ``precision``."""
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    g = torch.Generator().manual_seed(0)
    a = torch.randn(rows, inner, generator=g).to(dtype)
    b = torch.randn(inner, cols, generator=g).to(dtype)
    out = torch.empty(rows, cols, dtype=dtype)
    seconds = median_seconds(lambda: torch.mm(a, b, out=out), repeats)
    return 2 * rows * inner * cols / seconds / 1e9


def peaks(precision: str, images: int, repeats: int) -> dict[str, float]:
    """The square product's rate, and the best of the decoder's own largest products."""
    size = coco_size()
    hidden, vocab, features = size.config.model.hidden_dim, size.vocab_size, 2048
    rows = images * 5  # beam search's rows
    model = max(
        matmul_rate(rows, hidden, vocab, precision, repeats),  # vocabulary projection
        matmul_rate(rows, 2 * hidden + features, 4 * hidden, precision, repeats),  # LSTM
    )
    return {"square": matmul_rate(2048, 2048, 2048, precision, repeats), "model": model}


def bandwidth(repeats: int) -> float:
    """GB/s of reading 512 MB of fp32 values once (their sum)."""
    values = torch.ones(1 << 27)
    return values.numel() * 4 / median_seconds(values.sum, repeats) / 1e9


def task_of(name: str, precision: str, images: int) -> tuple[Callable[[], Any], float | None]:
    """The task ``name`` at COCO size over ``images`` images, in ``precision``, and for a
    decoding the GB it must read (:func:`step_bytes` at every word, None for training)."""
    size = coco_size()
    size.batch_size = images
    cfg = replace_section(size.config, "train", precision=precision)
    setup = seeded_setup(size)
    if name == "train":
        return decoder_step(setup, cfg, reference=False, compiled=False), None
    words = size.config.decode.max_length
    with torch.no_grad():
        features = setup.model.encode(grid=setup.batch["grid"])
    per_word = step_bytes(setup.model.decoder, features, precision)
    return our_decoding(setup, name, precision, compiled=False), words * per_word / 1e9


def step_bytes(decoder: torch.nn.Module, features: torch.Tensor, precision: str) -> int:
    """The bytes a decoding step reads from memory at the least: every weight matrix it
    multiplies by (found by running one greedy step with hooks on the layers), and the grid
    and its keys, one copy per image, in ``precision``'s element size."""
    size = 2 if precision == "bf16" else 4
    used: dict[int, int] = {}

    def hook(module: torch.nn.Module, *_: Any) -> None:
        for param in module.parameters(recurse=False):
            if param.dim() == 2:
                used[id(param)] = param.numel() * size

    with torch.no_grad():
        keys = decoder.prepare(features)
        state = decoder.init_state(features)
        tokens = torch.full((features.shape[0],), 1)
        handles = [
            m.register_forward_hook(hook)
            for m in decoder.modules()
            if isinstance(m, torch.nn.Linear | torch.nn.LSTMCell)
        ]
        # the torch form of the additive score runs its projection as a layer the hooks see
        fused_score.ENABLED = False
        try:
            decoder.step(tokens, state, features, keys)
        finally:
            for handle in handles:
                handle.remove()
            fused_score.ENABLED = True
    return sum(used.values()) + (features.numel() + keys.numel()) * size


def flops(fn: Callable[[], Any]) -> int:
    """The matrix FLOPs of one call of ``fn``, counted with torch's own layers and the
    additive score's torch form (the counter knows neither the packed product nor the C
    kernel)."""
    packing.ENABLED = fused_score.ENABLED = False
    try:
        with FlopCounterMode(display=False) as counter:
            fn()
    finally:
        packing.ENABLED = fused_score.ENABLED = True
    return counter.get_total_flops()


def measure(precision: str, images: int, repeats: int) -> list[dict[str, Any]]:
    """One row per task in ``precision``. The peaks and the bandwidth are measured before
    and after the tasks and the higher kept: a host whose speed drifts is held to the best it
    showed in the run."""
    before = peaks(precision, images, repeats), bandwidth(repeats)
    timings = []
    for name in TASKS:
        fn, gbytes = task_of(name, precision, images)
        work = flops(fn) / 1e9
        timings.append((name, work, gbytes, *timed(fn, repeats, tanh=name != "train")))
    after = peaks(precision, images, repeats), bandwidth(repeats)
    peak = {key: max(before[0][key], after[0][key]) for key in before[0]}
    read = max(before[1], after[1])
    return [_row(*timing, precision, images, peak, read) for timing in timings]


def _row(
    name: str,
    work: float,
    gbytes: float | None,
    seconds: float,
    unpacked: float,
    torch_score: float | None,
    tanh: float | None,
    precision: str,
    images: int,
    peak: dict[str, float],
    read: float,
) -> dict[str, Any]:
    """A task's row, printed as it is made."""
    rate = work / seconds
    roof = None if gbytes is None else max(work / peak["model"], gbytes / read)
    print(
        f"{name:7s} {precision}: {work:.1f} GFLOP in {seconds:.3f} s = {rate:.0f} GFLOP/s; "
        f"{rate / peak['square']:.0%} of the square product's {peak['square']:.0f}, "
        f"{rate / peak['model']:.0%} of the decoder's own products' {peak['model']:.0f}"
        + ("" if roof is None else f"; {gbytes:.2f} GB read at {read:.1f} GB/s, ")
        + ("" if roof is None else f"{roof / seconds:.0%} of the roofline's bound")
        + f"; torch's own layers {unpacked:.3f} s"
        + ("" if torch_score is None else f"; the score in torch's form {torch_score:.3f} s")
        + ("" if tanh is None else f"; the score's tanh {tanh:.3f} s")
    )
    return {
        "task": name,
        "precision": precision,
        "images": images,
        "threads": torch.get_num_threads(),
        "device": device_name("cpu"),
        "gflop": round(work, 2),
        "seconds": round(seconds, 4),
        "gflops_per_s": round(rate, 1),
        "peak_square_gflops_per_s": round(peak["square"], 1),
        "peak_model_gflops_per_s": round(peak["model"], 1),
        "share_of_square_peak": round(rate / peak["square"], 3),
        "share_of_model_peak": round(rate / peak["model"], 3),
        "bandwidth_gb_per_s": round(read, 1),
        "gbytes": None if gbytes is None else round(gbytes, 2),
        "roofline_seconds": None if roof is None else round(roof, 4),
        "share_of_roofline": None if roof is None else round(roof / seconds, 3),
        "seconds_unpacked": round(unpacked, 4),
        "seconds_torch_score": None if torch_score is None else round(torch_score, 4),
        "seconds_tanh": None if tanh is None else round(tanh, 4),
    }


def timed(
    fn: Callable[[], Any], repeats: int, tanh: bool
) -> tuple[float, float, float | None, float | None]:
    """The median seconds of ``fn`` as it runs by default, with torch's own layers (no
    packed weights, no deferred weight gradients), with the additive score in torch's form
    instead of its C kernel (``fused_score.ENABLED``, where the kernel is built) and, with
    ``tanh``, with the score's tanh instead of its sigmoid form (``scores.SIGMOID_TANH``),
    timed in alternating rounds."""
    fn()
    arms = ["default", "unpacked"]
    if fused_score.available(torch.zeros(1, 1, 1, 1)):
        arms.append("torch_score")
    if tanh:
        arms.append("tanh")
    times: dict[str, list[float]] = {arm: [] for arm in arms}
    for _ in range(repeats):
        for arm in arms:
            packing.ENABLED = deferred.ENABLED = arm != "unpacked"
            fused_score.ENABLED = arm != "torch_score"
            scores.SIGMOID_TANH = arm != "tanh"
            try:
                times[arm].append(median_seconds(fn, 1, warmup=0))
            finally:
                packing.ENABLED = deferred.ENABLED = scores.SIGMOID_TANH = True
                fused_score.ENABLED = True
    medians = {arm: statistics.median(values) for arm, values in times.items()}
    return medians["default"], medians["unpacked"], medians.get("torch_score"), medians.get("tanh")


@errors_in_one_line
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.roofline", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--precisions", default="fp32,bf16", help="comma-separated")
    parser.add_argument("--images", type=int, default=32, help="images per batch (32)")
    parser.add_argument("--repeats", type=int, default=5, help="timed calls per median (5)")
    add_result_options(parser, "the rows")
    add_replace_option(parser)
    args = parser.parse_args(argv)
    keep_freed_memory()  # as the command line runs
    precisions = [p for p in args.precisions.split(",") if p]
    unknown = sorted(set(precisions) - {"fp32", "bf16"})
    if unknown or not precisions:
        parser.error(f"--precisions takes fp32 and bf16, got {args.precisions!r}")
    if args.images < 1 or args.repeats < 1:
        parser.error("--images and --repeats must be at least 1")
    rows = []
    for precision in precisions:
        if precision == "bf16" and not native_bf16(torch.device("cpu")):
            print("bf16: this CPU does not compute it natively; left out")
            continue
        rows.extend(measure(precision, args.images, args.repeats))
    if not args.results:
        return 0
    return merge_rows(
        args,
        rows,
        lambda row: (row["task"], row["precision"], row.get("device")),
        module="benchmarks.roofline",
        argv=argv,
        settings=("images", "threads"),
    )


if __name__ == "__main__":
    sys.exit(main())
