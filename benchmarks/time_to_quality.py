"""Time to quality: the wall time of the shapes recipes as a user starts them, and what the
model they leave scores.

    python -m benchmarks.time_to_quality --out runs/ttq --results results/speed.json
    python -m benchmarks.time_to_quality --out runs/ttq --runs soft:0,hard:1,quickstart

Each run of ``--runs`` is timed from the start of its command to its exit, in a process of its
own (start-up, data loading, training and its validation included):

- ``soft:S`` and ``hard:S``: ``captioning train --config configs/shapes_{soft,hard}.yaml
  --set train.seed=S``, then its ``best.pt`` scored on the test split (greedy): exact match,
  exact match of three-object images, and the pointing game per word type;
- ``quickstart``: ``python -m captioning quickstart`` (what ``make demo`` runs after the
  install) into a fresh data folder, so that writing the shapes data is timed too.

Each run is one row (``kind`` ``quality``) of ``--results FILE`` where given
(results/speed.json), else of ``OUT/rows.json``, merged by its name (a row made under other
settings, such as another precision, is replaced only with ``--replace``), with its target,
whether it was met, the config, precision, device and threads it trained with, the command,
the commit and the machine (:class:`lab.runner.Recorder`). Run it on an otherwise
idle machine: the seconds are the result.
"""

from __future__ import annotations

import argparse
import json
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

from captioning.config import load_config
from captioning.errors import CaptioningError
from captioning.folders import marked_verb
from captioning.runtime import resolve_device, resolve_precision
from lab.provenance import ROOT, add_replace_option, add_result_options, device_name, portable
from lab.runner import Recorder

DEFAULT_RUNS = "soft:0,soft:1,hard:0,hard:1,quickstart"
# the targets a user is promised (docs/speed.md): seconds, and the least test scores
TARGETS: dict[str, dict[str, float]] = {
    "soft": {"seconds": 240, "exact": 0.95, "three_objects": 0.90, "pointing": 0.90},
    "hard": {"seconds": 360, "exact": 0.97, "pointing": 0.90},
    "quickstart": {"seconds": 180, "exact": 0.95},
}
POINTING = {
    "colour": "pointing_game/color",
    "size": "pointing_game/size",
    "shape": "pointing_game/category",
}


class Failed(Exception):
    """A command of the benchmark failed (the message says which and how)."""


def parse_runs(text: str) -> list[tuple[str, int | None]]:
    """``soft:0,hard:1,quickstart`` as (recipe, seed) pairs; the quickstart has no seed."""
    runs: list[tuple[str, int | None]] = []
    for item in filter(None, (part.strip() for part in text.split(","))):
        recipe, _, seed = item.partition(":")
        if recipe == "quickstart" and not seed:
            runs.append((recipe, None))
        elif recipe in ("soft", "hard") and seed.isdigit():
            runs.append((recipe, int(seed)))
        else:
            raise ValueError(f"--runs: {item!r} is not soft:SEED, hard:SEED or quickstart")
    if not runs:
        raise ValueError("--runs names no run; e.g. soft:0,hard:0,quickstart")
    return runs


def _timed(words: list[str], log: Path) -> float:
    """Run ``words`` from the repository root, output into ``log``; its wall seconds."""
    began = time.perf_counter()
    with log.open("w") as out:
        done = subprocess.run(words, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)
    seconds = time.perf_counter() - began
    if done.returncode != 0:
        raise Failed(f"{shlex.join(words)} exited with {done.returncode}; see {log}")
    return seconds


def scores(metrics: dict[str, Any]) -> dict[str, Any]:
    """The row's scores from ``evaluate``'s metrics of a shapes model."""
    by_type = metrics.get("grounding_by_word_type") or {}
    return {
        "exact": metrics["exact_match"],
        "three_objects": (metrics.get("exact_match_by_objects") or {}).get("3"),
        "pointing": {word: by_type.get(key) for word, key in POINTING.items()},
    }


def met(recipe: str, row: dict[str, Any]) -> bool:
    """Whether the row reaches every target of its recipe."""
    target = TARGETS[recipe]
    checks = [row["seconds"] <= target["seconds"], row["exact"] >= target["exact"]]
    if "three_objects" in target:
        checks.append((row["three_objects"] or 0) >= target["three_objects"])
    if "pointing" in target:
        checks += [(v or 0) >= target["pointing"] for v in row["pointing"].values()]
    return all(checks)


def trained_with(recipe: str) -> dict[str, Any]:
    """The config a recipe trains (the quickstart: the soft one), and the precision, device
    and threads it resolves to on this machine."""
    config = f"configs/shapes_{'soft' if recipe == 'quickstart' else recipe}.yaml"
    cfg = load_config(ROOT / config)
    train = cfg.train
    device = resolve_device(train.device)
    return {
        "config": config,
        "blocks": cfg.model.cnn_block,  # the small CNN's: they set a step's cost
        "precision": resolve_precision(train.precision, device),
        "device": device_name(device),
        "threads": train.threads or torch.get_num_threads(),
    }


def remove_own(folder: Path, verb: str) -> None:
    """Remove ``folder`` before a run writes it afresh, only when it is missing or marked as
    written by ``captioning VERB`` (a folder of this benchmark's own earlier run).

    Raises:
        CaptioningError: ``folder`` holds anything else; nothing was removed.
    """
    if not folder.exists():
        return
    if marked_verb(folder) != verb:
        raise CaptioningError(
            f"{folder} holds files that `captioning {verb}` did not write; "
            "nothing was removed: choose another --out"
        )
    shutil.rmtree(folder)


def run_one(recipe: str, seed: int | None, out: Path, python: str) -> dict[str, Any]:
    """Time one run and score what it left."""
    if recipe == "quickstart":
        folder, data = out / "quickstart", out / "quickstart_data"
        remove_own(data, "shapes")  # written afresh, as on a fresh clone
        words = [
            python,
            "-m",
            "captioning",
            "quickstart",
            "--quiet",
            "--out",
            str(folder),
            "--data-root",
            str(data),
        ]
        seconds = _timed(words, out / "quickstart.log")
        metrics = json.loads((folder / "eval" / "metrics.json").read_text())
        name = "quickstart"
    else:
        from captioning.evaluate import evaluate_checkpoint

        folder = out / f"{recipe}_s{seed}"
        remove_own(folder, "train")
        words = [
            python,
            "-m",
            "captioning",
            "train",
            "--quiet",
            "--config",
            f"configs/shapes_{recipe}.yaml",
            "--set",
            f"train.seed={seed}",
            "--out",
            str(folder),
        ]
        seconds = _timed(words, out / f"{recipe}_s{seed}.log")
        metrics = evaluate_checkpoint(
            folder / "best.pt", split="test", meteor=False, progress=False
        )
        name = f"{recipe} seed {seed}"
    run_command = ["captioning", *(portable(w, {"OUT": out}, "OUT") for w in words[3:])]
    row = {
        "kind": "quality",
        "name": name,
        "recipe": recipe,
        "seed": seed,
        "seconds": round(seconds, 1),
        **scores(metrics),
        "target": TARGETS[recipe],
        "run_command": shlex.join(run_command),
        **trained_with(recipe),
    }
    row["met"] = met(recipe, row)
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="the runs' folder")
    parser.add_argument("--runs", default=DEFAULT_RUNS, help=f"default {DEFAULT_RUNS}")
    add_result_options(parser, "the rows")
    add_replace_option(parser)
    args = parser.parse_args(argv)
    try:
        runs = parse_runs(args.runs)
    except ValueError as exc:
        parser.error(str(exc))
    args.out.mkdir(parents=True, exist_ok=True)
    recorder = Recorder(
        "benchmarks.time_to_quality",
        argv,
        args.out,
        lambda r: (r["kind"], r.get("name"), r.get("device")),
        results=args.results,
        replace=args.replace,
        timed_alone=not args.machine_busy,
    )
    for recipe, seed in runs:
        try:
            row = run_one(recipe, seed, args.out, sys.executable)
            recorder.write([row])
        except Failed as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 1
        except CaptioningError as exc:  # a results file that must not take the row
            print(f"error: {exc}", file=sys.stderr)
            return 2
        print(
            f"{row['name']}: {row['seconds']:.0f} s, test exact {row['exact']:.3f}, "
            f"{'met' if row['met'] else 'not met'}",
            flush=True,
        )
    print(f"wrote {recorder.path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
