"""What feature extraction's encoder costs, with each convolution and its clamp apart and
joined in one oneDNN pass.

    python -m benchmarks.encoder_speed --results results/speed.json
    python -m benchmarks.encoder_speed --grids os16 --precisions bf16 --images 64

Builds the frozen MobileNetV2 of each grid the Flickr8k study extracts (``best``: the 7 x 7
top of ``configs/flickr8k_best.yaml``; ``os16``: its stride-16 14 x 14 grid with the top's
summary, ``model.drop_stages=1``, ``model.output_stride=16``, ``model.summary=both``), folds
its BatchNorms as extraction does, and times ``--images`` images at 224 px in batches of
``--batch`` two ways: with each ReLU/ReLU6 after its convolution
(``Encoder.fold_batch_norms(fuse=False)``) and joined to it
(:mod:`captioning.models.fused_conv`, what extraction runs). The two run in alternating
rounds so that a host's drift falls on both; each row holds the median of ``--rounds``
rounds, the ratio, and whether the two grids are equal to the bit. The weights are random
(the time does not depend on them); ``--weights FILE`` loads real ones.

One row per grid and precision (bf16 only where the CPU computes it natively), with the
host, threads and precision; ``python -m tools.tables`` renders them into docs/speed.md. Time
it on an otherwise idle machine (``--machine-busy`` says it was not).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Sequence
from typing import Any

import torch

from captioning.config import load_config
from captioning.models.encoder import Encoder, build_encoder
from captioning.runtime import autocast, native_bf16
from lab.options import errors_in_one_line
from lab.provenance import add_replace_option, add_result_options, device_name, merge_rows

CONFIG = "configs/flickr8k_best.yaml"
GRIDS = {
    "best": [],
    "os16": ["model.drop_stages=1", "model.output_stride=16", "model.summary=both"],
}


def build(grid: str, fuse: bool, weights: str | None) -> Encoder:
    """The frozen encoder of ``grid``, BatchNorms folded, clamps joined where ``fuse``."""
    cfg = load_config(CONFIG, [*GRIDS[grid], f"model.weights={weights or 'null'}"])
    torch.manual_seed(0)
    encoder = build_encoder(cfg.model, cfg.runtime).eval()
    encoder.fold_batch_norms(fuse=fuse)
    return encoder


def time_pair(
    grid: str, precision: str, images: int, batch: int, rounds: int, weights: str | None
) -> dict[str, Any]:
    """One row: the two encoders of ``grid`` timed in alternating rounds in ``precision``."""
    encoders = {"apart": build(grid, False, weights), "fused": build(grid, True, weights)}
    size = encoders["apart"].image_size
    generator = torch.Generator().manual_seed(0)
    pixels = torch.randint(0, 256, (images, 3, size, size), dtype=torch.uint8, generator=generator)
    batches = pixels.split(batch)
    device = torch.device("cpu")

    def run(encoder: Encoder) -> torch.Tensor:
        with torch.no_grad(), autocast(device, precision):
            return torch.cat([encoder.backbone(b) for b in batches])

    grids = {name: run(encoder) for name, encoder in encoders.items()}  # warm-up and check
    seconds: dict[str, list[float]] = {name: [] for name in encoders}
    for _ in range(rounds):
        for name, encoder in encoders.items():
            start = time.perf_counter()
            run(encoder)
            seconds[name].append(time.perf_counter() - start)
    apart, fused = (statistics.median(seconds[n]) for n in ("apart", "fused"))
    rows, channels = encoders["fused"].num_rows, encoders["fused"].out_channels
    print(f"{grid} {precision}: apart {apart:.3f} s, fused {fused:.3f} s ({apart / fused:.2f}x)")
    return {
        "kind": "encoder",
        "grid": grid,
        "grid_shape": list(encoders["fused"].grid_shape),
        "grid_rows": rows,
        "channels": channels,
        "precision": precision,
        "images": images,
        "batch": batch,
        "rounds": rounds,
        "threads": torch.get_num_threads(),
        "device": device_name(),
        "seconds_apart": round(apart, 4),
        "seconds_fused": round(fused, 4),
        "speedup": round(apart / fused, 3),
        "bit_identical": bool(torch.equal(grids["apart"], grids["fused"])),
        "max_abs_difference": float((grids["apart"].float() - grids["fused"].float()).abs().max()),
    }


@errors_in_one_line
def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.encoder_speed", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--grids", default="best,os16", help="comma-separated: best, os16")
    parser.add_argument("--precisions", default="fp32,bf16", help="comma-separated: fp32, bf16")
    parser.add_argument("--images", type=int, default=320, help="images timed (default 320)")
    parser.add_argument("--batch", type=int, default=32, help="images a batch (default 32)")
    parser.add_argument("--rounds", type=int, default=5, help="alternating rounds (default 5)")
    parser.add_argument("--weights", help="a MobileNetV2 weights file (default: random)")
    add_result_options(parser, "the rows")
    add_replace_option(parser)
    args = parser.parse_args(argv)
    grids = [g for g in args.grids.split(",") if g]
    precisions = [p for p in args.precisions.split(",") if p]
    if unknown := [g for g in grids if g not in GRIDS] + [
        p for p in precisions if p not in ("fp32", "bf16")
    ]:
        parser.error(f"unknown grid or precision {unknown[0]!r}: use best, os16, fp32, bf16")
    if min(args.images, args.batch, args.rounds) < 1:
        parser.error("--images, --batch and --rounds must be at least 1")
    if "bf16" in precisions and not native_bf16(torch.device("cpu")):
        print("this CPU does not compute bf16 natively: timing fp32 only")
        precisions = [p for p in precisions if p != "bf16"]
    rows = [
        time_pair(grid, precision, args.images, args.batch, args.rounds, args.weights)
        for grid in grids
        for precision in precisions
    ]
    if args.results is None:
        return 0
    key = ("kind", "grid", "precision", "device", "threads")
    return merge_rows(
        args,
        rows,
        lambda r: tuple(str(r.get(k)) for k in key),
        module="benchmarks.encoder_speed",
        argv=argv,
        settings=("images", "batch"),
    )


if __name__ == "__main__":
    sys.exit(main())
