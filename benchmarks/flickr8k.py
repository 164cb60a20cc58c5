"""Show, Attend and Tell's Flickr8k table, measured like for like: from the shared Flickr8k
release to rows of test scores beside the paper's.

    python -m benchmarks.flickr8k --shared ../shared --out runs/flickr8k
    python -m benchmarks.flickr8k --shared ../shared --out runs/flickr8k --models soft --seeds 0
    python -m benchmarks.flickr8k --help

The stages, each timed, are what a user runs by hand (docs/flickr8k.md):

1. **prepare**: the shared MobileNetV2 into torchvision's layout (``python -m
   tools.convert_weights``) and ``captioning prepare flickr8k`` (the official 6,000 / 1,000 /
   1,000 split);
2. **extract**: ``captioning extract-features`` of the three splits;
3. **train** each model and seed from its config file, and decode the 1,000 test images
   with beam search (k = 3; 1 and 5 as well for ``soft``);
4. **score** every decoded split as the paper does: BLEU-1..4 and METEOR of pycocoevalcap
   (PTB tokenizer), BLEU without the brevity penalty (the paper's form), ROUGE-L, CIDEr-D.

The models: ``nn`` (the consensus nearest neighbour, ``k`` chosen on the dev split), ``none``
(the decoder without attention), ``soft`` (``configs/flickr8k_mobilenet.yaml``), ``hard``
(the paper's REINFORCE, ``configs/flickr8k_hard.yaml``), ``hard_exact`` (hard attention by
its exact marginal likelihood, ``configs/flickr8k_hard_exact.yaml``), and two second stages
from the ``soft`` run of the same seed: ``scst`` (self-critical training,
``configs/flickr8k_scst.yaml``) and ``finetune`` (``configs/flickr8k_finetune.yaml``);
``best_scst`` and ``best_finetune`` (``configs/flickr8k_best_scst.yaml``,
``configs/flickr8k_best_finetune.yaml``) are the same second stages from the ``best`` run of
the same seed (``configs/flickr8k_best.yaml``), and ``best_exact`` is hard attention by the
exact marginal from it (``configs/flickr8k_best_exact.yaml``).

Training goes through the study runner (:mod:`lab.runner`): ``--jobs N`` runs side by
side (on one GPU, or one at a time on a CPU so that the times are a user's), each with
``train.threads`` = cores // N unless ``--threads`` or ``--set train.threads=`` says
otherwise. A run lives in ``OUT/runs/cpu|gpu[/VARIANT]/MODEL-seedS`` (by the device that
trained it): its training in ``train/``, its decoded test split in ``test_beamB/`` and what
the run was in ``job.json``. A finished run (its ``job.json``) is reused, and keeps the
seconds and the machine it ran on, so runs made on another machine (``--no-score`` there,
the run folders copied back into ``OUT/runs/gpu`` or ``OUT/runs/cpu``) are scored here like
any other (``--no-train`` scores what is there and trains nothing).

The rows (one per model, seed and beam size) go to ``--results FILE`` where given
(results/flickr8k.json), else to ``OUT/rows.json``; they merge by (variant, model, seed,
beam, device), and a row made under other settings is replaced only with ``--replace``.
``--variant NAME`` marks rows trained with ``--set`` overrides (a lever tried against the
recipe). :mod:`benchmarks.flickr8k_decoding` decodes finished runs again with the beam size
and length penalty chosen on the dev split.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.flickr8k_options import parse_args
from benchmarks.flickr8k_runs import (
    BEAMS,
    CONFIGS,
    FIRST_STAGE,
    KINDS,
    RECIPE,
    extract_stage,
    first_stage_folder,
    grid_of,
    job_settings,
    run_dir,
)
from benchmarks.flickr8k_scores import references, rows_of_job, score
from benchmarks.recipe_stages import (
    Stages,
    consensus_predictions,
    extract_grids,
    prepare_stage,
)
from captioning.config import load_config, parse_override
from captioning.errors import CaptioningError
from lab import options, runner
from lab.options import StudyError
from lab.provenance import ROOT, cpu_model, device_name
from lab.results import Row
from lab.runner import Outcome, RunSpec

logger = logging.getLogger("captioning")


def prepare(shared: Path, out: Path) -> dict[str, Any]:
    """The converted backbone in ``OUT/weights`` and the dataset in ``OUT/data`` (reused when
    there), and the seconds it took when it ran."""
    from captioning.prepare.flickr import prepare_flickr8k

    stages = Stages(out)
    images, text = (
        shared / "data" / "flickr8k" / "Flicker8k_Dataset",
        shared / "data" / "flickr8k" / "Flickr8k_text",
    )

    def make_data(data: Path) -> None:
        prepare_flickr8k(images, text, data, progress=False)

    prepare_stage(shared, out, stages, (images, text), make_data, **_host())
    return stages.seconds


def extract(out: Path, model: str, overrides: list[str]) -> dict[str, Any]:
    """Cache the frozen backbone's grids of every split for ``model``'s config (reused when
    there)."""
    stages, started = Stages(out), time.perf_counter()
    config = CONFIGS[grid_of(model)][0]
    if extract_grids(load_config(ROOT / config, overrides)):
        stages.record(extract_stage(model), time.perf_counter() - started, **_host())
    return stages.seconds


def stages_of(out: Path, model: str) -> dict[str, Any]:
    """The recorded stages as ``model``'s recipe ran them: its own extraction as ``extract``."""
    stages = dict(Stages(out).seconds)
    stages["extract"] = stages.get(extract_stage(model))
    return {k: v for k, v in stages.items() if not k.startswith("extract ")}


def _host() -> dict[str, Any]:
    """The device the stages ran on, in words, and the CPU threads."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    return {"device": device_name(device), "cpu": cpu_model(), "threads": torch.get_num_threads()}


# --------------------------------------------------------------------------- one run


def run_spec_of(args: argparse.Namespace, model: str, seed: int) -> RunSpec:
    """One model and seed as the runner's spec: trained into ``RUN/train``, from the first
    stage's ``best.pt`` for a second stage; decoded by :func:`train_and_decode`."""
    folder, first = run_dir(args.out, args.variant, model, seed), FIRST_STAGE.get(model)
    data = job_settings(args.out, model, seed, [])[:2]
    init = None if first is None else run_dir(args.out, args.first_stage, first, seed)
    meta = {
        "variant": args.variant,
        "first_stage": args.first_stage,
        "out": args.out,
        "beams": BEAMS.get(model, (3,)),
        "timed_alone": not args.machine_busy and args.jobs == 1,
        "commit": args.commit,
        "command": args.command,
    }
    return RunSpec(
        model,
        CONFIGS[model][0],
        (*CONFIGS[model][1], *args.overrides),
        seed,
        folder / "train",
        plumbing=(*data, "train.quiet=true"),
        init=None if init is None else init / "train" / "best.pt",
        meta=meta,
    )


def train_and_decode(spec: RunSpec) -> Outcome:
    """Train one model and seed (the runner resumes or reuses its folder) and decode its test
    split at each beam size; write ``job.json`` in its run folder. A run whose ``job.json``
    is there is left as it is."""
    from captioning.evaluate import evaluate_checkpoint

    folder = spec.folder.parent
    if (folder / "job.json").is_file():
        return Outcome(spec, None)
    outcome = runner.train(spec)
    if outcome.failed is not None:
        raise StudyError(
            f"{spec.name} seed {spec.seed} diverged "
            f"({spec.folder / 'failed.json'}): {outcome.failed}"
        )
    decoded = {}
    for beam in spec.meta["beams"]:
        started = time.perf_counter()
        evaluate_checkpoint(
            spec.folder / "best.pt",
            split="test",
            beam_size=beam,
            meteor=False,
            progress=False,
            out_dir=folder / f"test_beam{beam}",
        )
        decoded[str(beam)] = round(time.perf_counter() - started, 2)
    summary, cfg = outcome.summary, outcome.cfg or spec.load()
    job = {
        "model": spec.name,
        "seed": spec.seed,
        "variant": spec.meta["variant"],
        **({"first_stage_variant": spec.meta["first_stage"]} if spec.name in FIRST_STAGE else {}),
        "config": spec.config,
        "settings": spec.settings(),
        "select_metric": cfg.train.select_metric,
        "best_val": summary.get("best_score"),
        "best_epoch": summary.get("best_epoch"),
        "epochs": summary.get("epochs", len(outcome.history)),
        "steps": summary["steps"],
        "train_seconds": round(summary.get("seconds", outcome.train_seconds), 2),
        "evaluate_seconds": decoded,
        **runner.run_fields(outcome),
        "cpu": cpu_model(),
        **{k: spec.meta[k] for k in ("timed_alone", "commit", "command")},
        "stages": stages_of(spec.meta["out"], spec.name),
        "history": outcome.history,
    }
    (folder / "job.json").write_text(json.dumps(job, indent=1) + "\n")
    return outcome


def job_of(outcome: Outcome) -> list[Row]:
    """The ``job.json`` of a run :func:`train_and_decode` finished."""
    return [json.loads((outcome.spec.folder.parent / "job.json").read_text())]


def train_all(args: argparse.Namespace, models: list[str], seeds: list[int]) -> None:
    """Every trained model and seed, ``--jobs`` at a time; second stages after their first."""
    threads = options.threads_for(args.jobs, args.threads or set_threads(args.overrides))
    waves = [
        [m for m in models if m in CONFIGS and m not in FIRST_STAGE],
        [m for m in models if m in FIRST_STAGE],
    ]
    for wave in waves:
        for model in wave:
            first = FIRST_STAGE.get(model)
            if first and first not in models:
                missing = [
                    s
                    for s in seeds
                    if not (run_dir(args.out, args.first_stage, first, s) / "job.json").is_file()
                ]
                if missing:
                    raise CaptioningError(
                        f"{model} starts from the {first} run of the same "
                        f"seed; add {first} to --models"
                    )
        specs = runner.plan([run_spec_of(args, m, s) for m in wave for s in seeds], threads)
        for (job,) in runner.run_study(specs, job_of, jobs=args.jobs, run=train_and_decode):
            logger.info(
                "%s seed %d: trained in %.0f s (best validation %s %.3f)",
                job["model"],
                job["seed"],
                job["train_seconds"],
                job["select_metric"],
                job["best_val"],
            )


def set_threads(overrides: list[str]) -> int | None:
    """The ``train.threads`` a ``--set`` asks for, if any (the last one wins)."""
    asked = [value for key, value in map(parse_override, overrides) if key == ["train", "threads"]]
    return int(asked[-1]) if asked and asked[-1] is not None else None


# --------------------------------------------------------------------------- scoring


def nearest_neighbour(out: Path, overrides: list[str]) -> dict[str, Any]:
    """The consensus nearest neighbour: ``k`` chosen on the dev split's CIDEr-D, test scored."""
    started = time.perf_counter()
    cfg = load_config(ROOT / CONFIGS["soft"][0], job_settings(out, "soft", 0, overrides))
    best_k, val_cider, test = consensus_predictions(cfg)
    seconds = time.perf_counter() - started
    return {
        "k": best_k,
        "val_CIDEr_by_k": {str(k): round(v, 4) for k, v in val_cider.items()},
        "predictions": test,
        "seconds": round(seconds, 2),
    }


def rows_of_run(
    out: Path, folder: Path, refs: dict[int, list[str]], cuts: tuple[int, ...] = ()
) -> list[dict[str, Any]]:
    """The rows of the finished run in ``folder`` (:func:`rows_of_job`), a second stage's
    recipe seconds counting its first stage's training."""
    job = json.loads((folder / "job.json").read_text())
    first = first_stage_folder(folder, job)
    seconds = (
        0.0 if first is None else json.loads((first / "job.json").read_text())["train_seconds"]
    )
    return rows_of_job(out, folder, job, refs, seconds, cuts)


def collect(args: argparse.Namespace, models: list[str], seeds: list[int]) -> list[dict]:
    refs = references(args.out, "test")
    rows = []
    for model in models:
        if model == "nn":
            nn = nearest_neighbour(args.out, args.overrides)
            stages = Stages(args.out).seconds
            before = (stages.get("prepare") or 0) + (stages.get("extract") or 0)
            extra = {"k": nn["k"], "val_CIDEr_by_k": nn["val_CIDEr_by_k"]}
            rows.append(
                {
                    "variant": RECIPE,
                    "model": "nn",
                    "seed": None,
                    "beam_size": None,
                    **score(nn["predictions"], refs),
                    **extra,
                    "seconds": {
                        "prepare": stages.get("prepare"),
                        "extract": stages.get("extract"),
                        "train": nn["seconds"],
                        "recipe": round(before + nn["seconds"], 1),
                    },
                    "config": CONFIGS["soft"][0],
                    "overrides": [],
                    "precision": "fp32",
                    **_host(),
                    "timed_alone": not args.machine_busy,
                    "commit": args.commit,
                    "command": args.command,
                }
            )
            continue
        for seed in seeds:
            folders = [run_dir(args.out, args.variant, model, seed, kind) for kind in KINDS]
            done = [folder for folder in folders if (folder / "job.json").is_file()]
            for folder in done:
                cuts = tuple(args.cut) if model == "soft" and args.variant == RECIPE else ()
                rows.extend(rows_of_run(args.out, folder, refs, cuts))
            if not done:
                logger.warning(
                    "%s seed %d has no finished run in %s; no row",
                    model,
                    seed,
                    " or ".join(str(f) for f in folders),
                )
    return rows


def _key(row: dict[str, Any]) -> tuple:
    return (row["variant"], row["model"], row["seed"], row["beam_size"], row["device"])


# --------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    args.out = args.out.resolve()
    args.out.mkdir(parents=True, exist_ok=True)
    try:
        recorder = runner.Recorder.from_args(
            "benchmarks.flickr8k", argv, args, _key, places={"SHARED": args.shared}
        )
        # the code that trains, recorded with each run (--commit: a copy without .git)
        args.commit = recorder.stamp["commit"] = args.commit or recorder.stamp["commit"]
        args.command = recorder.stamp["command"]
        prepare(args.shared, args.out)
        # the grids of the recipe (every model but best reads them) and of best, as asked
        grids = {grid_of(model) for model in args.models}
        for model in sorted(grids, reverse=True):
            extract(args.out, model, job_settings(args.out, model, 0, args.overrides))
        if not args.no_train:
            train_all(args, args.models, args.seeds)
        if args.no_score:
            return 0
        rows = collect(args, args.models, args.seeds)
        recorder.write(rows)
    except CaptioningError as exc:
        return options.fail(exc)
    for row in rows:
        print(
            f"{row['model']} seed {row['seed']} beam {row['beam_size']} ({row['device']}): "
            f"BLEU-4 {100 * row['Bleu_4']:.2f} (no BP {100 * row['Bleu_4_no_bp']:.2f}), "
            f"METEOR {100 * (row['METEOR'] or 0):.2f}, CIDEr-D {100 * row['CIDEr']:.2f}"
        )
    print(f"wrote {recorder.path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
