"""The speed benchmark's options (:class:`BenchOptions`) and its command line."""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass, field
from typing import NoReturn

from benchmarks.workload import SIZES, BenchError
from lab.provenance import add_replace_option, add_result_options


@dataclass
class BenchOptions:
    """What :func:`benchmarks.bench.run_benchmark` measures and where it writes.

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


def validate(options: BenchOptions) -> None:
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


class _Parser(argparse.ArgumentParser):
    """Argument errors raise :class:`BenchError`, which :func:`benchmarks.bench.main` prints
    on one line."""

    def error(self, message: str) -> NoReturn:
        raise BenchError(message)


def build_parser() -> argparse.ArgumentParser:
    """The command line of :func:`benchmarks.bench.main`."""
    p = _Parser(
        prog="python -m benchmarks.bench",
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
    add_replace_option(p)
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
