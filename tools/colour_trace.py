"""Where and when a shapes run loses the colours: the colour probe at every encoder stage over
the first training steps, as data.

    python -m tools.colour_trace --out runs/trace --variant plain --seeds 0,3 \\
        --set model.cnn_block=plain --results results/colour_trace.json
    python -m tools.colour_trace --out runs/trace --variant preact --seeds 0,3

For each seed this trains ``configs/shapes_soft.yaml`` (with the ``--set`` overrides) into
``OUT/VARIANT-seedS`` and, before the steps of ``--steps``, reads the colour probe of
``tools.colour_probe`` from the output of each encoder stage (the stem, then each block, under
each object's centre) and from the decoder's grid (after the position codes and grid layers).
Each (variant, seed, step) is one row of ``--results FILE`` where given
(results/colour_trace.json), else of ``OUT/rows.json``, recorded by :mod:`lab.runner`
(precision, threads, device, commit, command); the table in docs/attention.md is rendered
from results/colour_trace.json.
"""

from __future__ import annotations

import json
import logging
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch
from PIL import Image

from captioning.models import Captioner
from captioning.training.run_state import Run
from captioning.training.train import fit
from lab.options import (
    StudyError,
    add_runner_options,
    add_seeds_option,
    errors_in_one_line,
    parser_for,
    refuse_plumbing,
    seeds_of,
)
from lab.runner import Outcome, Recorder, RunSpec, run_fields
from tools.colour_probe import centre_cell, colour_probe
from tools.seed_study import CONFIG, PLUMBING

logger = logging.getLogger("captioning")

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
        return torch.tensor(
            [
                self.colours.index(a["color"])
                for image in self.images
                for a in self.objects[image["id"]]
            ]
        )

    def at_centres(self, maps: torch.Tensor) -> torch.Tensor:
        """Each object's feature from ``maps`` (B, C, H, W): (N, C), in label order."""
        rows, cols = maps.shape[2:]
        return torch.stack(
            [
                maps[b, :, cell // cols, cell % cols]
                for b, image in enumerate(self.images)
                for cell in (
                    centre_cell(a["bbox"], image["width"], image["height"], rows, cols)
                    for a in self.objects[image["id"]]
                )
            ]
        )


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
        sharpness = first_word_map(model, grid)
    rows, cols = model.grid_shape
    maps["grid"] = grid.transpose(1, 2).reshape(len(inputs), -1, rows, cols)
    model.train(was_training)
    probes = {}
    for name, m in maps.items():
        features = probe_set.at_centres(m)
        probes[name] = round(
            colour_probe(features, labels, classes=classes, steps=TRACE_PROBE_STEPS), 4
        )
    return {**probes, **sharpness}


def first_word_map(model: Captioner, grid: torch.Tensor) -> dict[str, float]:
    """How peaked the first word's attention map is, from the decoder's first state over the
    ``grid`` (B, L, D): the mean of each map's largest weight (``first_peak``; an even map's is
    1 / L), its mean entropy in nats (``first_entropy``) and the standard deviation of the
    scores across the cells (``first_score_sd``). A score whose logits start large puts
    nearly all the weight on one cell before the grid means anything, and its softmax then
    passes almost no gradient to the other cells. Soft and hard attention (other
    kinds: {}). The first word's query is h_0, as in the shapes configs' decoder."""
    decoder = model.decoder
    score = getattr(decoder.attention, "score", None)  # soft and hard attention's one score
    if score is None:
        return {}
    state = decoder.init_state(grid)
    keys = decoder.values_and_keys(grid, decoder.prepare(grid))[1]
    scores = score(keys, state.h).float()  # (B, L)
    alpha = torch.softmax(scores, dim=1)
    entropy = -(alpha * alpha.clamp_min(1e-12).log()).sum(dim=1)
    return {
        "first_peak": round(alpha.max(dim=1).values.mean().item(), 4),
        "first_entropy": round(entropy.mean().item(), 4),
        "first_score_sd": round(scores.std(dim=1).mean().item(), 4),
    }


def trace_seed(spec: RunSpec, steps: list[int], probe_set: ProbeSet) -> list[dict[str, Any]]:
    """Train ``spec`` afresh into its folder, probing before each step of ``steps`` and
    stopping after the last (the seed study trains the whole run); one row per step."""
    rows = []

    def probe(run: Run) -> None:
        if run.progress.step in steps:
            rows.append({"step": run.progress.step, **stage_probes(run.model, probe_set)})
            logger.info(
                "%s seed %d step %d: %s",
                spec.name,
                spec.seed,
                run.progress.step,
                json.dumps(rows[-1]),
            )
        if run.progress.step >= steps[-1]:
            raise _Traced

    if spec.folder.exists():
        raise StudyError(
            f"{spec.folder} exists; the trace trains afresh, remove it or use another --out"
        )
    try:
        fit(spec.load(), spec.folder, on_step=probe)
    except _Traced:
        pass
    if not rows or rows[-1]["step"] != steps[-1]:
        raise StudyError(f"the run ended before step {steps[-1]}; ask for fewer --steps")
    where = run_fields(Outcome(spec, None))
    return [
        {
            "variant": spec.name,
            "overrides": sorted(spec.overrides),
            "seed": spec.seed,
            "config": spec.config,
            **row,
            **where,
        }
        for row in rows
    ]


@errors_in_one_line
def main(argv: list[str] | None = None) -> int:
    parser = parser_for("tools.colour_trace", __doc__)
    parser.add_argument("--out", type=Path, required=True, help="where the run folders go")
    parser.add_argument("--variant", required=True, help="the rows' name for these settings")
    add_seeds_option(parser, "0,3")
    parser.add_argument("--steps", default=STEPS, help=f"steps to probe before ({STEPS})")
    parser.add_argument(
        "--data-root", type=Path, default=Path("data/shapes"), help="the shapes data (data/shapes)"
    )
    add_runner_options(parser, each="every traced run")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        refuse_plumbing(args.overrides, PLUMBING)
    except StudyError as exc:
        raise StudyError(f"{exc} (the trace sets this itself)") from None
    seeds = seeds_of(args)
    try:
        steps = sorted({int(s) for s in args.steps.split(",")})
    except ValueError:
        raise StudyError(f"--steps wants steps such as 0,50,100, got {args.steps!r}") from None
    if not (args.data_root / "annotations" / "instances_val.json").is_file():
        raise StudyError(
            f"no shapes data under {args.data_root}; write it with "
            f"captioning shapes --out {args.data_root}"
        )
    if args.jobs != 1:
        raise StudyError("--jobs: the trace probes its runs one at a time; leave it out")
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    probe_set = ProbeSet(args.data_root)
    recorder = Recorder.from_args(
        "tools.colour_trace",
        argv,
        args,
        lambda r: (r["variant"], r["seed"], r["step"]),
        places={"DATA": args.data_root},
    )
    plumbing = (
        f"data.root={args.data_root}",
        "train.quiet=true",
        "train.figure_every_epoch=false",
    )
    if args.threads is not None:
        plumbing += (f"train.threads={args.threads}",)
    for seed in seeds:
        spec = RunSpec(
            args.variant,
            CONFIG,
            tuple(args.overrides),
            seed,
            args.out / f"{args.variant}-seed{seed}",
            plumbing=plumbing,
        )
        recorder.write(trace_seed(spec, steps, probe_set))
    print(f"wrote {recorder.path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
