"""Many photo-recipe runs at once: a list of jobs, trained side by side, one row each.

    python tools/photo_sweep.py --jobs tools/photo_sweeps/scst.json --data data/photos \
        --weights weights/mobilenet_v2.pt --out runs/sweep --parallel 12 --extract

Each job of the ``--jobs`` file is one training run of ``--config`` (the photo recipe,
``configs/photos_mobilenet.yaml``) with soft attention::

    {"name": "drop0.3", "seed": 0, "set": ["model.dropout=0.3"]}
    {"name": "scst", "seed": 0, "set": ["train.objective=scst", ...], "init": "drop0.3",
     "phase": 2, "beams": [3]}

``init`` names another job of the same seed: this one starts from that run's ``best.pt``
(``captioning train --init``), as self-critical training starts from a cross-entropy model,
so it must sit in a later ``phase``; the phases run one after the other, the jobs of a phase
up to ``--parallel`` at a time, each in its own process with one thread. On one GPU a dozen
small decoders train side by side in about the time of one; on a CPU, give each job its own
core.

Every finished run is scored on the validation and the test split with beam search (each
size of ``beams``, default 3) and becomes one row of ``--results``: the job (name, seed,
settings, init), the best validation CIDEr-D and its epoch, the scores, the seconds, the
device, the commit and the command. With ``--extract`` the frozen backbone's grids are cached
first and the consensus nearest neighbour (k on val; ``benchmarks/photos.py``) is scored on
the same device, as the row ``nn``: the rows of one results file then compare on one
footing. A run folder that finished (``summary.json``) is scored again, not retrained.
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: the repository root holds the benchmarks
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import argparse
import json
import shlex
import subprocess
import time
from typing import Any

import torch

from benchmarks.provenance import git_commit, machine, merge_rows, read_rows
from captioning.config import load_config
from captioning.errors import CaptioningError
from captioning.metrics import java_available

ROOT = Path(__file__).resolve().parent.parent
CONFIG = str(ROOT / "configs" / "photos_mobilenet.yaml")


def job_settings(args: argparse.Namespace, job: dict[str, Any]) -> list[str]:
    """The overrides of one job: the data and weights, one quiet thread, soft attention, the
    seed, then the job's own settings (which win)."""
    return [
        f"data.root={args.data}",
        f"model.weights={args.weights}",
        "train.quiet=true",
        "train.figure_every_epoch=false",
        "train.threads=1",
        "model.attention=soft",
        f"train.seed={job['seed']}",
        *job.get("set", []),
    ]


def run_folder(out: Path, name: str, seed: int) -> Path:
    return out / f"{name}-seed{seed}"


def check_jobs(jobs: list[dict[str, Any]]) -> None:
    """Names and seeds unique; every ``init`` a job of the same seed in an earlier phase."""
    seen: dict[tuple[str, int], int] = {}
    for job in jobs:
        for key in ("name", "seed"):
            if key not in job:
                raise CaptioningError(f"a job lacks {key!r}: {json.dumps(job)}")
        key = (job["name"], job["seed"])
        if key in seen:
            raise CaptioningError(f"job {job['name']} seed {job['seed']} is listed twice")
        seen[key] = job.get("phase", 1)
    for job in jobs:
        init = job.get("init")
        if init is None:
            continue
        phase = seen.get((init, job["seed"]))
        if phase is None or phase >= job.get("phase", 1):
            raise CaptioningError(
                f"job {job['name']} seed {job['seed']} starts from {init!r}, which must be a "
                "job of the same seed in an earlier phase"
            )


def run_job(args: argparse.Namespace, job: dict[str, Any]) -> dict[str, Any]:
    """Train one job (unless its folder finished) and score its ``best.pt``."""
    from captioning.evaluate import evaluate_checkpoint
    from captioning.train import fit

    cfg = load_config(args.config, job_settings(args, job))
    folder = run_folder(args.out, job["name"], job["seed"])
    summary_path = folder / "summary.json"
    if summary_path.is_file():
        summary = json.loads(summary_path.read_text())
    else:
        init = job.get("init")
        start = None if init is None else run_folder(args.out, init, job["seed"]) / "best.pt"
        began = time.perf_counter()
        result = fit(cfg, folder, init=None if start is None else str(start))
        summary = {
            "best_score": result["best_score"],
            "best_epoch": result["best_epoch"],
            "seconds": round(time.perf_counter() - began, 1),
        }
        summary_path.write_text(json.dumps(summary, indent=1) + "\n")
    row: dict[str, Any] = {
        "name": job["name"],
        "seed": job["seed"],
        "set": job.get("set", []),
        "init": job.get("init"),
        "val_best": round(summary["best_score"], 4),
        "best_epoch": summary["best_epoch"],
        "train_seconds": summary["seconds"],
    }
    for beam in job.get("beams", [3]):
        for split in ("val", "test"):
            metrics = evaluate_checkpoint(
                folder / "best.pt", split=split, beam_size=beam, meteor=False, progress=False
            )
            row[f"{split}_CIDEr_beam{beam}"] = round(metrics["CIDEr"], 4)
            if split == "test" and beam == 3:
                row.update({k: round(metrics[k], 4) for k in ("Bleu_1", "Bleu_4", "ROUGE_L")})
    return row


def nearest_neighbour_row(args: argparse.Namespace) -> dict[str, Any]:
    """Cache the grids of every split, then score the consensus nearest neighbour."""
    from benchmarks.photos import nearest_neighbour
    from captioning.feature_cache import FeatureCache, cache_folder, extract_features
    from captioning.models import encoder_from_config

    cfg = load_config(args.config, job_settings(args, {"seed": 0}))
    folder = cache_folder(cfg, encoder_from_config(cfg.model))
    for split in ("train", "val", "test"):
        if not FeatureCache.exists(folder, split):
            extract_features(cfg, split, progress=False)
    row = nearest_neighbour(cfg)
    return {
        "name": "nn",
        "seed": None,
        "k": row["k"],
        "val_CIDEr_by_k": row["val_CIDEr_by_k"],
        "test_CIDEr_beam3": round(row["CIDEr"], 4),  # no beam: the column the models share
        **{k: round(row[k], 4) for k in ("Bleu_1", "Bleu_4", "ROUGE_L")},
    }


def merge(path: Path, rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Earlier rows of ``path`` with ``rows``, a new row replacing one of the same name and
    seed."""
    return merge_rows(read_rows(path), rows, lambda r: (r["name"], r["seed"]))


def device_name() -> str:
    if torch.cuda.is_available():
        return f"{torch.cuda.get_device_name(0)} (CUDA)"
    return "CPU"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--jobs", type=Path, required=True, help="a JSON list of jobs")
    parser.add_argument("--data", type=Path, required=True, help="the prepared photos")
    parser.add_argument("--weights", required=True, help="the backbone (model.weights)")
    parser.add_argument("--out", type=Path, required=True, help="where the run folders go")
    parser.add_argument("--config", default=CONFIG, help=f"the recipe ({CONFIG})")
    parser.add_argument("--parallel", type=int, default=2, help="jobs at a time (2)")
    parser.add_argument("--extract", action="store_true", help="cache the grids; score nn")
    parser.add_argument(
        "--results", type=Path, default=Path("photo_sweep.json"), help="the rows' file"
    )
    parser.add_argument("--job", help=argparse.SUPPRESS)  # one job, in a worker process
    args = parser.parse_args(argv)
    if args.job is not None:
        print("ROW " + json.dumps(run_job(args, json.loads(args.job))), flush=True)
        return 0
    try:
        jobs = json.loads(args.jobs.read_text(encoding="utf-8"))
        check_jobs(jobs)
    except (OSError, json.JSONDecodeError, CaptioningError) as error:
        parser.error(f"--jobs {args.jobs}: {error}")
    context = {
        "commit": git_commit(),
        "command": shlex.join(["python", "tools/photo_sweep.py", *(argv or sys.argv[1:])]),
        "device": device_name(),
        "machine": machine(),
        # without Java the captions are tokenized in Python, which moves scores slightly
        "tokenizer": "ptb" if java_available() else "python",
    }
    rows: list[dict[str, Any]] = []

    def save(row: dict[str, Any]) -> None:
        rows.append({**row, **context})
        args.results.parent.mkdir(parents=True, exist_ok=True)
        merged = merge(args.results, [rows[-1]])
        args.results.write_text(json.dumps(merged, indent=1) + "\n", encoding="utf-8")

    if args.extract:
        save(nearest_neighbour_row(args))
        print(f"nn: test CIDEr-D {rows[-1]['test_CIDEr_beam3']:.3f}", flush=True)
    passed = list(argv or sys.argv[1:])
    failed = 0
    for phase in sorted({job.get("phase", 1) for job in jobs}):
        queue = [job for job in jobs if job.get("phase", 1) == phase]
        running: list[tuple[dict[str, Any], subprocess.Popen[str]]] = []
        while queue or running:
            while queue and len(running) < args.parallel:
                job = queue.pop(0)
                worker = [sys.executable, __file__, *passed, "--job", json.dumps(job)]
                running.append((job, subprocess.Popen(worker, stdout=subprocess.PIPE, text=True)))
            for job, process in list(running):
                if process.poll() is None:
                    continue
                running.remove((job, process))
                output = process.stdout.read() if process.stdout else ""
                found = [line[4:] for line in output.splitlines() if line.startswith("ROW ")]
                if process.returncode != 0 or not found:
                    failed += 1
                    print(f"{job['name']} seed {job['seed']}: failed (exit {process.returncode})")
                    continue
                save(json.loads(found[0]))
                print(f"{job['name']} seed {job['seed']}: val {rows[-1]['val_best']:.3f}")
            time.sleep(1)
    print(f"wrote {args.results}: {len(rows)} rows; {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
