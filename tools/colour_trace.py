"""Where and when a shapes run loses the colours: the colour probe at every encoder stage over
the first training steps, as data.

    python tools/colour_trace.py --out runs/trace --variant plain --seeds 0,3 \\
        --set model.cnn_block=plain
    python tools/colour_trace.py --out runs/trace --variant preact --seeds 0,3

For each seed this trains ``configs/shapes_soft.yaml`` (with the ``--set`` overrides) into
``OUT/VARIANT-seedS`` and, before the steps of ``--steps``, reads the colour probe of
``tools/seed_study.py`` from the output of each encoder stage (the stem, then each block, under
each object's centre) and from the decoder's grid (after the position codes and grid layers).
Each (variant, seed, step) is one row of ``--results`` (default results/colour_trace.json);
``python tools/tables.py`` renders them into docs/attention.md.
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: the repository root holds benchmarks/
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import argparse
import json
import logging
from collections import defaultdict
from typing import Any

import torch
from PIL import Image

from benchmarks.provenance import add_study_options, command, git_commit, machine, write_rows
from captioning.config import load_config, parse_override
from captioning.errors import CaptioningError
from captioning.models import Captioner
from captioning.run_state import Run
from captioning.train import fit
from tools.seed_study import CONFIG, PLUMBING, centre_cell, colour_probe, parse_seeds

logger = logging.getLogger("captioning")

ROOT = Path(__file__).resolve().parent.parent
STEPS = "0,25,50,75,100,150,200,300,450"
TRACE_IMAGES = 300  # validation images whose objects the probe reads (fewer than the study's)
TRACE_PROBE_STEPS = 300  # the logistic regression's steps (the study's: 500)


class _Traced(Exception):
    """Raised from the step hook once the last step of the trace is probed."""


class ProbeSet:
    """The first ``images`` validation images of the shapes data and their objects."""

    def __init__(self, data_root: Path, images: int = TRACE_IMAGES) -> None:
        instances = json.loads((data_root / "annotations" / "instances_val.json").read_text())
        self.objects = defaultdict(list)
        for annotation in instances["annotations"]:
            self.objects[annotation["image_id"]].append(annotation)
        self.colours = sorted({a["color"] for a in instances["annotations"]})
        self.images = instances["images"][:images]
        self.pictures = [
            Image.open(data_root / "images" / "val" / image["file_name"]).convert("RGB")
            for image in self.images
        ]

    def labels(self) -> torch.Tensor:
        return torch.tensor([self.colours.index(a["color"]) for image in self.images
                             for a in self.objects[image["id"]]])  # fmt: skip

    def at_centres(self, maps: torch.Tensor) -> torch.Tensor:
        """Each object's feature from ``maps`` (B, C, H, W): (N, C), in label order."""
        rows, cols = maps.shape[2:]
        return torch.stack([
            maps[b, :, cell // cols, cell % cols]
            for b, image in enumerate(self.images)
            for cell in (centre_cell(a["bbox"], image["width"], image["height"], rows, cols)
                         for a in self.objects[image["id"]])
        ])  # fmt: skip


def stage_probes(model: Captioner, probe_set: ProbeSet) -> dict[str, float]:
    """The colour probe from each encoder stage's output (``stage0`` is the stem) and from the
    decoder's grid, in eval mode (the model's mode is restored)."""
    was_training = model.training
    model.eval()
    encoder = model.encoder
    inputs = torch.stack([encoder.transform(p) for p in probe_set.pictures])  # (B, 3, S, S)
    labels, classes = probe_set.labels(), len(probe_set.colours)
    maps = {}
    with torch.no_grad():
        x = (inputs.float() - encoder.mean) / encoder.std
        for i, stage in enumerate(encoder.stages):
            x = stage(x)
            maps[f"stage{i}"] = x.float()
        grid = model.encode(inputs).float()  # (B, L, D)
    rows, cols = model.grid_shape
    maps["grid"] = grid.transpose(1, 2).reshape(len(inputs), -1, rows, cols)
    model.train(was_training)
    probes = {}
    for name, m in maps.items():
        features = probe_set.at_centres(m)
        probes[name] = round(
            colour_probe(features, labels, classes=classes, steps=TRACE_PROBE_STEPS), 4
        )
    return probes


def trace_seed(
    *, variant: str, seed: int, requested: list[str], folder: Path, data_root: Path,
    steps: list[int], threads: int | None, probe_set: ProbeSet,
) -> list[dict[str, Any]]:  # fmt: skip
    """Train one seed afresh into ``folder``, probing before each step of ``steps`` and
    stopping after the last (the seed study trains the whole run); one row per step."""
    plumbing = [f"train.seed={seed}", f"data.root={data_root}", "train.quiet=true",
                "train.figure_every_epoch=false"]  # fmt: skip
    if threads is not None:
        plumbing.append(f"train.threads={threads}")
    cfg = load_config(ROOT / CONFIG, [*requested, *plumbing])
    rows = []

    def probe(run: Run) -> None:
        if run.progress.step in steps:
            rows.append({"step": run.progress.step, **stage_probes(run.model, probe_set)})
            logger.info("%s seed %d step %d: %s", variant, seed, run.progress.step,
                        json.dumps(rows[-1]))  # fmt: skip
        if run.progress.step >= steps[-1]:
            raise _Traced

    if folder.exists():
        raise CaptioningError(f"{folder} exists; the trace trains afresh, remove it or use "
                              f"another --out")  # fmt: skip
    try:
        fit(cfg, folder, on_step=probe)
    except _Traced:
        pass
    if not rows or rows[-1]["step"] != steps[-1]:
        raise CaptioningError(f"the run ended before step {steps[-1]}; ask for fewer --steps")
    return [{"variant": variant, "overrides": sorted(requested), "seed": seed, **row}
            for row in rows]  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, required=True, help="where the run folders go")
    parser.add_argument("--variant", required=True, help="the rows' name for these settings")
    parser.add_argument("--seeds", default="0,3", help="seeds, e.g. 0-5 or 0,3 (0,3)")
    parser.add_argument("--steps", default=STEPS, help=f"steps to probe before ({STEPS})")
    parser.add_argument("--data-root", type=Path, default=Path("data/shapes"),
                        help="the shapes data (data/shapes)")  # fmt: skip
    add_study_options(
        parser, results=ROOT / "results" / "colour_trace.json", each="every traced run"
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        for text in args.overrides:
            if ".".join(parse_override(text)[0]) in PLUMBING:
                raise CaptioningError(f"--set {text}: the trace sets this itself")
        seeds = parse_seeds(args.seeds)
        try:
            steps = sorted({int(s) for s in args.steps.split(",")})
        except ValueError:
            raise CaptioningError(
                f"--steps wants steps such as 0,50,100, got {args.steps!r}"
            ) from None
        if not (args.data_root / "annotations" / "instances_val.json").is_file():
            raise CaptioningError(f"no shapes data under {args.data_root}; write it with "
                                  f"captioning shapes --out {args.data_root}")  # fmt: skip
        if args.threads is not None:
            torch.set_num_threads(args.threads)
        probe_set = ProbeSet(args.data_root)
        context = {"config": CONFIG, "commit": git_commit(), **machine(),
                   "timed_alone": not args.machine_busy,
                   "command": command("tools/colour_trace.py", argv)}  # fmt: skip
        for seed in seeds:
            rows = trace_seed(variant=args.variant, seed=seed, requested=args.overrides,
                              folder=args.out / f"{args.variant}-seed{seed}",
                              data_root=args.data_root, steps=steps, threads=args.threads,
                              probe_set=probe_set)  # fmt: skip
            rows = [{**row, **context} for row in rows]
            write_rows(args.results, rows, lambda r: (r["variant"], r["seed"], r["step"]))
    except CaptioningError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {args.results}; python tools/tables.py renders it")
    return 0


if __name__ == "__main__":
    sys.exit(main())
