"""The real-photo recipe and its baselines, from the shared folder to a table of test scores.

    python -m benchmarks.photos --shared ../shared --out runs/photos
    python -m benchmarks.photos --shared ../shared --out runs/photos --models soft --seeds 0
    python -m benchmarks.photos --help

The stages, each timed, are what a user runs by hand (see docs/photos.md):

1. **prepare**: the shared MobileNetV2 backbone into torchvision's layout
   (``python -m tools.convert_weights``), and ``captioning prepare folder`` on the published
   caption file with the fixed split ``--val 0.1 --test 0.1 --seed 0``;
2. **extract**: ``captioning extract-features`` for the three splits (the frozen backbone's
   10 x 10 x 1280 grid at the config's 320 px, cached as float16);
3. **train** each model and seed with ``--config`` (``configs/photos_mobilenet.yaml``), and
   **evaluate** its ``best.pt`` on the test split with beam search (k = 3).

The models: ``soft`` and ``hard`` are the paper's two (``hard`` trained by its exact
marginal likelihood, ``train.hard_estimator=exact``), ``none`` is the same decoder without
attention (the mean of the grid at every word), and ``nn`` is the consensus nearest-neighbour
caption of Devlin et al. (2015, :mod:`captioning.inference.nearest`), with its ``k`` chosen on the
validation split. Everything but the attention is the config's, for every model.

METEOR is left out: its paraphrase tables and stemmer are English-only, and the shared
captions are Vietnamese. BLEU, ROUGE-L and CIDEr-D are word-level and apply as they are.

The runs go through the study runner (:mod:`lab.runner`), ``--jobs N`` of them side by
side with ``train.threads`` = cores // N unless ``--threads`` says otherwise. Each model and
seed is one row (``nn`` is deterministic: one row) of ``--results FILE`` where given
(results/photos.json), else of ``OUT/rows.json``: the settings, the scores, the seconds of
each stage, precision, threads, device, the command (no machine's paths) and the commit.
Rows merge by (variant, model, seed), so rows of an earlier invocation stay unless this one
makes the same model and seed again, and a row made under other settings is replaced only
with ``--replace``. A stage whose output already exists in ``OUT`` (prepared data, cached
grids, a finished run) is reused, and its row keeps the seconds it took when it ran.

``--variant NAME`` trains the same models with ``--set`` overrides into ``OUT/runs/NAME/``
and marks their rows with the name: the recipe's levers (a setting tried against the shipped
config) live in the same file as the recipe (variant ``recipe``), and the table of levers in
docs/photos.md is made from them.

``--then CONFIG`` (with ``--variant``) adds a second training stage, as self-critical
training follows cross-entropy: each model's ``best.pt`` starts a run of CONFIG
(``captioning train --init``) with the data, weights, model and seed of the first and the
``--then-set`` overrides, and that run's ``best.pt`` is the one scored. The row's train
seconds are both stages', so its recipe seconds are the whole two-stage recipe's. The
shipped two-stage recipe (docs/photos.md, "The 10-minute recipe"; its rows are variant
``budget_bf16_10``, which the photos table shows beside the cross-entropy models)::

    python -m benchmarks.photos --shared ../shared --out runs/photos --models soft \\
        --variant budget_bf16_10 --set model.dropout=0.3 --set train.epochs=12 \\
        --set train.precision=bf16 --then configs/photos_scst.yaml --then-set train.precision=bf16
"""

from __future__ import annotations

import json
import logging
import statistics
import sys
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import torch

from benchmarks.photos_options import MODELS, RECIPE, parse_args, repository_path
from benchmarks.recipe_stages import (
    Stages,
    consensus_predictions,
    extract_grids,
    prepare_stage,
)
from captioning.config import Config, load_config
from captioning.data import load_splits
from captioning.errors import CaptioningError
from captioning.metrics import caption_metrics
from lab import options, runner
from lab.provenance import ROOT, device_name, portable
from lab.results import Row
from lab.runner import Evaluation, Outcome, RunSpec

logger = logging.getLogger("captioning")

# what each model sets on top of the config
MODEL_OVERRIDES = {
    "none": ["model.attention=none"],
    "soft": ["model.attention=soft"],
    "hard": ["model.attention=hard", "train.hard_estimator=exact"],
}
SCORES = ("CIDEr", "Bleu_1", "Bleu_2", "Bleu_3", "Bleu_4", "ROUGE_L")
SPLIT = {"val": 0.1, "test": 0.1, "seed": 0}
# the study sets these itself (--seeds, --shared): a --set of them is refused
OWN = ("train.seed", "data.root", "model.weights")


def prepare(shared: Path, out: Path, stages: Stages) -> tuple[Path, Path]:
    """Convert the backbone and prepare the photos (reused when already done): returns the
    weights file and the dataset root."""
    from captioning.prepare.folder import prepare_folder

    photos = shared / "data" / "photos_vi"
    images, captions = photos / "images", photos / "captions.txt"

    def make_data(data: Path) -> None:
        prepare_folder(images, captions, data, progress=False, **SPLIT)

    return prepare_stage(shared, out, stages, (captions, images), make_data)


def extract(cfg: Config, stages: Stages) -> None:
    """Cache the grids of every split (reused when present), timed."""
    started = time.perf_counter()
    if extract_grids(cfg):
        stages.record("extract", time.perf_counter() - started)


def nearest_neighbour(cfg: Config) -> Row:
    """The consensus nearest-neighbour baseline: ``k`` chosen on val, scored on test (on the
    CPU, in fp32)."""
    started = time.perf_counter()
    best_k, val_cider, predictions = consensus_predictions(cfg)
    references = {r.image_id: list(r.captions) for r in load_splits(cfg.data)["test"]}
    test = caption_metrics(predictions, references, meteor=False)
    return {
        "variant": RECIPE,
        "model": "nn",
        "seed": None,
        "k": best_k,
        "val_CIDEr_by_k": {str(k): round(v, 4) for k, v in val_cider.items()},
        **{name: test[name] for name in SCORES},
        "train_seconds": round(time.perf_counter() - started, 2),
        "precision": "fp32",
        "threads": torch.get_num_threads(),
        "device": device_name("cpu"),
    }


# --------------------------------------------------------------------------- the runs


def model_specs(
    config: str,
    plumbing: tuple[str, ...],
    overrides: list[str],
    model: str,
    seed: int,
    out: Path,
    beam_size: int,
    variant: str = RECIPE,
    then: tuple[str, list[str]] | None = None,
) -> list[RunSpec]:
    """The runs of one model and seed: its run of ``config`` with ``overrides`` (and
    ``plumbing``: the data and weights) in ``OUT/runs[/VARIANT]/MODEL-seedS``, and with
    ``then`` (a config and its overrides) a second stage from its ``best.pt`` in
    ``MODEL-seedS-then``; the last one is scored on the test split."""
    runs = out / "runs" if variant == RECIPE else out / "runs" / variant
    test = (Evaluation("test", beam_size, options=(("meteor", False),)),)
    meta = {"variant": variant, "out": out}
    first = RunSpec(
        model,
        config,
        (*overrides, *MODEL_OVERRIDES[model]),
        seed,
        runs / f"{model}-seed{seed}",
        plumbing=(*plumbing, "train.quiet=true"),
        evaluations=() if then else test,
        meta={**meta, "stage": "first" if then else "only"},
    )
    if then is None:
        return [first]
    second = RunSpec(
        model,
        then[0],
        (*MODEL_OVERRIDES[model], *then[1]),
        seed,
        runs / f"{model}-seed{seed}-then",
        plumbing=first.plumbing,
        init=first.folder / "best.pt",
        evaluations=test,
        meta={**meta, "stage": "then", "first": first, "then": then},
    )
    return [first, second]


def _diverged(outcome: Outcome) -> options.StudyError:
    spec = outcome.spec
    failed = spec.folder / "failed.json"
    return options.StudyError(f"{spec.name} seed {spec.seed} diverged ({failed}): {outcome.failed}")


def photo_row(outcome: Outcome) -> list[Row]:
    """The row of a scored run (none for the first of two stages, scored after the second)."""
    spec = outcome.spec
    if outcome.failed is not None:
        raise _diverged(outcome)
    if spec.meta["stage"] == "first":
        return []
    summary = outcome.summary
    seconds = summary.get("seconds", outcome.train_seconds)
    first_spec = spec.meta.get("first", spec)
    row: Row = {"variant": spec.meta["variant"], "model": spec.name, "seed": spec.seed}
    metrics = next(iter(outcome.metrics.values()))
    row.update({name: metrics[name] for name in SCORES})
    if spec.meta["stage"] == "then":
        first = json.loads((first_spec.folder / "summary.json").read_text())
        then_config, then_overrides = spec.meta["then"]
        row["then"] = {
            "config": then_config,
            "overrides": then_overrides,
            "first_val_CIDEr": first["best_score"],
            "first_best_epoch": first["best_epoch"],
            "first_seconds": round(first["seconds"], 2),
        }
        seconds += first["seconds"]
    row.update(
        {
            "val_CIDEr": summary.get("best_score"),
            "best_epoch": summary.get("best_epoch"),
            "epochs": summary.get("epochs", len(outcome.history)),
            "steps": summary["steps"],
            "train_seconds": round(seconds, 2),
            "steps_per_s": round(summary["steps"] / seconds, 3),
            "evaluate_seconds": next(iter(outcome.eval_seconds.values())),
            "config": first_spec.config,
            # paths inside OUT as OUT/..., so that rows from different machines compare
            "overrides": [
                portable(o, {"OUT": spec.meta["out"]})
                for o in replace(first_spec, plumbing=spec.plumbing).settings()
            ],
            **runner.run_fields(outcome),
        }
    )
    return [row]


def run_models(specs: list[RunSpec], threads: int | None = None, jobs: int = 1) -> Iterator[Row]:
    """The rows of ``specs`` (of :func:`model_specs`), ``jobs`` runs side by side: first
    stages, then second stages, as each run ends."""
    for wave in (
        [s for s in specs if "first" not in s.meta],
        [s for s in specs if "first" in s.meta],
    ):
        for rows in runner.run_study(runner.plan(wave, threads), photo_row, jobs=jobs):
            yield from rows


def key(row: Row) -> tuple:
    """A row's identity in a results file: (variant, model, seed)."""
    return (row.get("variant", RECIPE), row["model"], row["seed"])


def order(earlier: list[Row], merged: list[Row]) -> list[Row]:
    """By variant (the recipe first), model, then seed."""
    return sorted(
        merged,
        key=lambda r: (
            r.get("variant", RECIPE) != RECIPE,
            r.get("variant", RECIPE),
            MODELS.index(r["model"]),
            r["seed"] or 0,
        ),
    )


def table(rows: list[Row]) -> str:
    """A Markdown table: per model, test CIDEr-D (mean and each seed), BLEU-4, ROUGE-L,
    and the recipe's seconds."""
    lines = [
        "| model | test CIDEr-D, mean | each seed | BLEU-4 | ROUGE-L | recipe s |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for model in MODELS:
        group = [r for r in rows if r["model"] == model and r.get("variant", RECIPE) == RECIPE]
        if not group:
            continue
        each = ", ".join(
            f"{r['CIDEr']:.3f}" + ("" if r["seed"] is None else f" ({r['seed']})") for r in group
        )
        recipe = ", ".join(f"{r['recipe_seconds']:.0f}" for r in group)

        def mean(name: str, group: list[Row] = group) -> str:
            return f"{statistics.mean(r[name] for r in group):.3f}"

        lines.append(
            f"| {model} | {mean('CIDEr')} | {each} | {mean('Bleu_4')} | "
            f"{mean('ROUGE_L')} | {recipe} |"
        )
    return "\n".join(lines)


# --------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        seeds = options.seeds_of(args)
        options.refuse_plumbing([*args.overrides, *args.then_set], OWN)
        threads = options.threads_for(args.jobs, args.threads)
        config = repository_path(args.config)
        then = None if args.then is None else (repository_path(args.then), args.then_set)
        out = args.out.resolve()
        out.mkdir(parents=True, exist_ok=True)
        stages = Stages(out)
        weights, data = prepare(args.shared, out, stages)
        plumbing = (f"data.root={data}", f"model.weights={weights}")
        cfg = load_config(ROOT / config, [*plumbing, *args.overrides])
        extract(cfg, stages)
        images = {split: len(records) for split, records in load_splits(cfg.data).items()}
        before = stages.seconds.get("prepare", 0.0) + stages.seconds.get("extract", 0.0)
        context = {
            "config": config,
            "split": "test",
            "beam_size": args.beam_size,
            "split_settings": SPLIT,
            "images": images,
            "test_images": images["test"],
            "prepare_seconds": stages.seconds.get("prepare"),
            "extract_seconds": stages.seconds.get("extract"),
        }
        recorder = runner.Recorder.from_args(
            "benchmarks.photos", argv, args, key, order=order, places={"SHARED": args.shared}
        )

        def record(row: Row) -> list[Row]:
            seconds = before + row["train_seconds"] + row.get("evaluate_seconds", 0.0)
            return recorder.write([{**context, **row, "recipe_seconds": round(seconds, 1)}])

        rows = record(nearest_neighbour(cfg)) if "nn" in args.models else []
        specs = [
            spec
            for model in args.models
            if model != "nn"
            for seed in seeds
            for spec in model_specs(
                config,
                plumbing,
                args.overrides,
                model,
                seed,
                out,
                args.beam_size,
                args.variant,
                then,
            )
        ]
        for row in run_models(specs, threads, args.jobs):
            rows = record(row)  # written after each run: an interrupted study keeps it
    except CaptioningError as exc:
        return options.fail(exc)
    print(table(rows))
    print(f"wrote {recorder.path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
