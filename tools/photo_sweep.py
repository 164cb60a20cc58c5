"""Many photo-recipe runs at once: a list of jobs, trained side by side, one row each.

    python -m tools.photo_sweep --jobs tools/photo_sweeps/scst.json --data data/photos \\
        --weights weights/mobilenet_v2.pt --out runs/sweep --parallel 12 --extract

Each job of the ``--jobs`` file is one training run of ``--config`` (the photo recipe,
``configs/photos_mobilenet.yaml``) with soft attention::

    {"name": "drop0.3", "seed": 0, "set": ["model.dropout=0.3"]}
    {"name": "scst", "seed": 0, "set": ["train.objective=scst", ...], "init": "drop0.3",
     "phase": 2, "beams": [3]}

``init`` names another job of the same seed: this one starts from that run's ``best.pt``
(``captioning train --init``), as self-critical training starts from a cross-entropy model,
so it must sit in a later ``phase``; the phases run one after the other, the jobs of a phase
up to ``--parallel`` at a time through the study runner (:mod:`lab.runner`), each in a
process of its own with ``train.threads`` = cores // ``--parallel`` (``--threads`` to say
otherwise). On one GPU a dozen small decoders train side by side in about the time of one;
on a CPU, give each job its own core.

Every finished run is scored on the validation and the test split with beam search (each
size of ``beams``, default 3) and becomes one row of ``--results FILE`` where given
(results/photo_sweep.json), else of ``OUT/rows.json``: the job (name, seed, settings, init),
the best validation CIDEr-D and its epoch, the scores, the seconds, the precision, threads
and device, the commit and the command. Rows merge by (name, seed); a row made under other
settings is replaced only with ``--replace``. With ``--extract`` the frozen backbone's grids
are cached first and the consensus nearest neighbour (k on val; ``benchmarks.photos``) is
scored on the same device, as the row ``nn``: the rows of one results file then compare on
one footing. A run folder that finished is scored again, not retrained; a job that fails is
named, the others go on, and the exit status is 1.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from benchmarks.photos import nearest_neighbour, repository_path
from benchmarks.recipe_stages import extract_grids
from captioning.cli import positive_int
from captioning.config import load_config
from captioning.errors import CaptioningError
from captioning.metrics import java_available
from lab import options, runner
from lab.provenance import add_replace_option, add_result_options
from lab.results import Row
from lab.runner import Evaluation, Outcome, RunSpec

CONFIG = "configs/photos_mobilenet.yaml"
SOFT = "model.attention=soft"  # every job's attention, before its own settings


def plumbing(args: argparse.Namespace) -> tuple[str, ...]:
    """What every job runs with that is not what it learns: the data and weights, quiet."""
    return (
        f"data.root={args.data}",
        f"model.weights={args.weights}",
        "train.quiet=true",
        "train.figure_every_epoch=false",
    )


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


def job_spec(args: argparse.Namespace, job: dict[str, Any]) -> RunSpec:
    """One job as the runner's spec: soft attention, then the job's settings; scored on val
    and test at each of its beam sizes."""
    init, seed = job.get("init"), job["seed"]
    evaluations = tuple(
        Evaluation(split, beam, write=False)
        for beam in job.get("beams", [3])
        for split in ("val", "test")
    )
    return RunSpec(
        job["name"],
        args.config,
        (SOFT, *job.get("set", [])),
        seed,
        run_folder(args.out, job["name"], seed),
        plumbing=plumbing(args),
        init=None if init is None else run_folder(args.out, init, seed) / "best.pt",
        evaluations=evaluations,
        meta={"job": job},
    )


def run_job(spec: RunSpec) -> Outcome:
    """:func:`benchmarks.runner.run_spec`, a job's error becoming its outcome (``failed``)."""
    try:
        return runner.run_spec(spec)
    except Exception as exc:  # noqa: BLE001 -- one job's error (a bad setting) must not stop the sweep
        return Outcome(spec, None, failed=f"{type(exc).__name__}: {exc}")


def sweep_row(outcome: Outcome) -> list[Row]:
    """A job's row: what it was, then its scores, or ``failed`` (not written)."""
    job, spec = outcome.spec.meta["job"], outcome.spec
    row: Row = {
        "name": job["name"],
        "seed": job["seed"],
        "set": job.get("set", []),
        "init": job.get("init"),
    }
    if outcome.failed is not None:
        return [{**row, "failed": outcome.failed}]
    summary = outcome.summary
    best = summary.get("best_score")
    row.update(
        val_best=None if best is None else round(best, 4),
        best_epoch=summary.get("best_epoch"),
        train_seconds=round(summary.get("seconds", outcome.train_seconds), 1),
        config=repository_path(spec.config),
        **runner.run_fields(outcome),
    )
    for beam in job.get("beams", [3]):
        for split in ("val", "test"):
            metrics = outcome.metrics[f"{split}_beam{beam}"]
            row[f"{split}_CIDEr_beam{beam}"] = round(metrics["CIDEr"], 4)
            if split == "test" and beam == 3:
                row.update({k: round(metrics[k], 4) for k in ("Bleu_1", "Bleu_4", "ROUGE_L")})
    return [row]


def nearest_neighbour_row(args: argparse.Namespace) -> Row:
    """Cache the grids of every split, then score the consensus nearest neighbour."""
    cfg = load_config(Path(args.config), [*plumbing(args), SOFT])
    extract_grids(cfg)
    row = nearest_neighbour(cfg)
    return {
        "name": "nn",
        "seed": None,
        "k": row["k"],
        "val_CIDEr_by_k": row["val_CIDEr_by_k"],
        "test_CIDEr_beam3": round(row["CIDEr"], 4),  # no beam: the column the models share
        **{k: round(row[k], 4) for k in ("Bleu_1", "Bleu_4", "ROUGE_L")},
        **{k: row[k] for k in ("precision", "threads", "device")},
    }


def settings(row: Row) -> dict[str, Any]:
    """What a row was made under, for the merge: its config, job settings, init, precision."""
    return {k: row[k] for k in ("config", "set", "init", "precision") if k in row}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--jobs", type=Path, required=True, help="a JSON list of jobs")
    parser.add_argument("--data", type=Path, required=True, help="the prepared photos")
    parser.add_argument("--weights", required=True, help="the backbone (model.weights)")
    parser.add_argument("--out", type=Path, required=True, help="where the run folders go")
    parser.add_argument("--config", default=CONFIG, help=f"the recipe ({CONFIG})")
    parser.add_argument("--parallel", type=positive_int, default=2, help="jobs at a time (2)")
    parser.add_argument(
        "--threads", type=positive_int, help="train.threads of each job (cores // --parallel)"
    )
    parser.add_argument("--extract", action="store_true", help="cache the grids; score nn")
    add_result_options(parser, "the rows")
    add_replace_option(parser)
    args = parser.parse_args(argv)
    try:
        args.job_list = json.loads(args.jobs.read_text(encoding="utf-8"))
        check_jobs(args.job_list)
    except (OSError, json.JSONDecodeError, CaptioningError) as error:
        parser.error(f"--jobs {args.jobs}: {error}")
    args.config = str(Path(args.config).resolve())
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    jobs, written, failed = args.job_list, 0, 0
    try:
        threads = options.threads_for(args.parallel, args.threads)
        recorder = runner.Recorder(
            "tools.photo_sweep",
            argv,
            args.out,
            lambda r: (r["name"], r["seed"]),
            results=args.results,
            replace=args.replace,
            timed_alone=not args.machine_busy,
            jobs=args.parallel,
            places={"DATA": args.data},
            settings=settings,
        )
        # without Java the captions are tokenized in Python, which moves scores slightly
        context = {"tokenizer": "ptb" if java_available() else "python"}
        if args.extract:
            row = nearest_neighbour_row(args)
            recorder.write([{**row, **context}])
            written += 1
            print(f"nn: test CIDEr-D {row['test_CIDEr_beam3']:.3f}", flush=True)
        for phase in sorted({job.get("phase", 1) for job in jobs}):
            specs = [job_spec(args, job) for job in jobs if job.get("phase", 1) == phase]
            for (row,) in runner.run_study(
                runner.plan(specs, threads), sweep_row, jobs=args.parallel, run=run_job
            ):
                if "failed" in row:
                    failed += 1
                    print(f"{row['name']} seed {row['seed']}: failed ({row['failed']})")
                    continue
                recorder.write([{**row, **context}])  # after each job: a stopped sweep keeps it
                written += 1
                print(f"{row['name']} seed {row['seed']}: val {row['val_best']:.3f}", flush=True)
    except CaptioningError as exc:
        return options.fail(exc)
    print(f"wrote {recorder.path}: {written} rows; {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
