"""The attention family on shapes, as data: each member's learning rate chosen on val, then seeds.

    python tools/compare_attention.py --out runs/attention
    python tools/compare_attention.py --out runs/attention --only soft soft-dot --seeds 0
    python tools/compare_attention.py --list

Every member is a shipped shapes config with one change (``RUNS``; ``--list`` prints them):
no attention, soft attention with each score function (additive, additive_relu, dot,
scaled_dot, general, cosine) and the location score, local attention
(configs/shapes_local.yaml), key-value attention, multi-head attention (H = 2, 4, 8), grid
self-attention (N = 2) and hard attention (configs/shapes_hard.yaml, its exact estimator).

1. **sweep**: each member at each learning rate of ``--lrs`` with the first seed of
   ``--seeds``, evaluated on the validation and the test split with greedy decoding;
2. **seeds**: each member at its chosen rate (the best on validation by the config's
   ``train.select_metric``; a tie goes to the lower rate) with every seed of ``--seeds``
   (the sweep's run of the first seed is reused), evaluated on both splits.

A learning rate sets ``train.lr`` and ``train.encoder_lr`` together, keeping the config's
ratio of the two (both shapes configs train the encoder at the decoder's rate). Hard
attention is also decoded with each ``decode.hard_context`` on the test split.

Each run is one row of ``--results`` (default results/attention_family.json): the member,
the config and every override, the learning rate and seed, the phase, the validation and test
scores, trainable parameters, train seconds and steps/s, the commit, the command and the
machine. Rows merge into the file by (member, lr, seed), so the study runs in pieces
(``--only``) and resumes: a run folder ``OUT/MEMBER/lrLR-seedS`` that finished is evaluated,
not retrained; one that stopped part-way resumes from its ``last.pt``; one whose training
diverged keeps its ``failed.json`` and gives a row that says so. ``python tools/tables.py``
renders the rows into docs/attention.md.
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: the repository root holds benchmarks/
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import argparse
import json
import logging
import shlex
from typing import Any

from benchmarks.provenance import add_study_options, git_commit, machine, merge_rows, read_rows
from captioning.checkpoint import load_checkpoint
from captioning.config import load_config
from captioning.errors import CaptioningError
from captioning.evaluate import evaluate_checkpoint
from captioning.inference import load_model
from captioning.train import TrainingError, fit

logger = logging.getLogger("captioning")

ROOT = Path(__file__).resolve().parent.parent
SOFT, HARD = "configs/shapes_soft.yaml", "configs/shapes_hard.yaml"
LOCAL = "configs/shapes_local.yaml"
RUNS = {
    "none": (SOFT, ["model.attention=none"]),
    "soft": (SOFT, []),  # the additive score, the paper's
    **{f"soft-{score}": (SOFT, [f"model.score={score}"])
       for score in ("additive_relu", "dot", "scaled_dot", "general", "cosine", "location")},
    "local": (LOCAL, []),
    "key-value": (SOFT, ["model.values=projected", "model.value_dim=128"]),
    **{f"multi-head-{heads}": (SOFT, [f"model.heads={heads}"]) for heads in (2, 4, 8)},
    "grid-self-attention": (SOFT, ["model.grid_layers=2"]),
    "hard": (HARD, []),
}  # fmt: skip
HARD_CONTEXTS = ("expectation", "argmax", "sample")
# (key in a row's scores, key in metrics.json, where: None for the top level, else the
# sub-dict's name)
COLUMNS = [
    ("exact", "exact_match", None),
    ("exact_3_objects", "3", "exact_match_by_objects"),
    ("pointing_color", "pointing_game/color", "grounding_by_word_type"),
    ("pointing_size", "pointing_game/size", "grounding_by_word_type"),
    ("pointing_shape", "pointing_game/category", "grounding_by_word_type"),
    ("centre_pointing", "centre_pointing_game", None),
    ("mass_in_box", "attention_in_box", None),
    ("Bleu_4", "Bleu_4", None),
    ("CIDEr", "CIDEr", None),
]
LRS, SEEDS = "1e-3,2e-3,4e-3,8e-3", "0,1,2"


def scores(metrics: dict[str, Any]) -> dict[str, float | None]:
    """The COLUMNS of an evaluation's metrics (None where the model has no such score)."""
    return {
        name: metrics.get(key) if where is None else (metrics.get(where) or {}).get(key)
        for name, key, where in COLUMNS
    }


def run_folder(out: Path, member: str, lr: float, seed: int) -> Path:
    return out / member / f"lr{lr:g}-seed{seed}"


def settings(member: str, lr: float, seed: int, extra: list[str]) -> tuple[str, list[str]]:
    """The config and every override of one run: the member's change, the learning rates,
    the seed, then ``extra`` (the command's ``--set`` and thread count)."""
    config, change = RUNS[member]
    shipped = load_config(ROOT / config).train
    encoder_lr = lr * shipped.encoder_lr / shipped.lr
    rates = [f"train.lr={lr:g}", f"train.encoder_lr={encoder_lr:g}"]
    return config, [*change, *rates, f"train.seed={seed}", *extra]


def train_and_evaluate(
    out: Path, member: str, lr: float, seed: int, extra: list[str]
) -> dict[str, Any]:
    """One run, trained unless its folder holds a finished (or diverged) one, and scored on
    the validation and test splits: the row without the context (commit, command, machine)."""
    config, overrides = settings(member, lr, seed, extra)
    cfg = load_config(ROOT / config, overrides)
    folder = run_folder(out, member, lr, seed)
    row: dict[str, Any] = {
        "member": member,
        "config": config,
        "change": RUNS[member][1],
        "overrides": overrides,
        "lr": lr,
        "encoder_lr": cfg.train.encoder_lr,
        "seed": seed,
        "select_metric": cfg.train.select_metric,
        "epochs": cfg.train.epochs,
    }
    failure = folder / "failed.json"
    if failure.is_file():
        return {**row, **json.loads(failure.read_text())}
    last = folder / "last.pt"
    done = last.is_file() and load_checkpoint(last)["epoch"] >= cfg.train.epochs
    if not done:
        try:
            fit(cfg, folder, resume=str(last) if last.is_file() else None)
        except TrainingError as exc:  # diverged: a result of this rate, not a crash
            logger.warning("%s at lr %g, seed %d: %s", member, lr, seed, exc)
            failed = {"failed": str(exc)}
            failure.write_text(json.dumps(failed) + "\n")
            return {**row, **failed}
    checkpoint = load_checkpoint(last)
    # training time: the epochs themselves (training and validation), from the history
    seconds = sum(epoch["seconds"] for epoch in checkpoint["history"])
    model = load_model(last)[0]
    evaluations = {}
    for split in ("val", "test"):
        evaluations[split] = evaluate_checkpoint(
            folder / "best.pt", split=split, meteor=False, progress=False,
            out_dir=folder / f"eval_{split}",
        )  # fmt: skip
    row.update(
        precision=checkpoint["config"]["train"]["precision"],
        val_select=evaluations["val"][cfg.train.select_metric],
        val=scores(evaluations["val"]),
        test=scores(evaluations["test"]),
        parameters=sum(p.numel() for p in model.parameters() if p.requires_grad),
        train_seconds=round(seconds, 2),
        steps=checkpoint["step"],
        steps_per_s=round(checkpoint["step"] / seconds, 3),
    )
    if model.hard_attention:
        row["test_by_hard_context"] = {
            mode: scores(evaluate_checkpoint(
                folder / "best.pt", split="test", hard_context=mode, meteor=False,
                progress=False, out_dir=folder / f"eval_test_{mode}",
            ))
            for mode in HARD_CONTEXTS
        }  # fmt: skip
    return row


def chosen_lr(rows: list[dict[str, Any]], member: str, seed: int) -> float | None:
    """The member's learning rate with the best validation score among its rows of ``seed``
    (the lower rate on a tie); None without a scored row."""
    sweep = [r for r in rows if r["member"] == member and r["seed"] == seed and "val" in r]
    if not sweep:
        return None
    return max(sweep, key=lambda r: (r["val_select"], -r["lr"]))["lr"]


def merge(path: Path, rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The rows already in ``path`` with ``rows``, which replace any earlier row of the same
    member, learning rate and seed; ordered by member (as in RUNS), rate, then seed."""

    kept = merge_rows(read_rows(path), rows, lambda r: (r["member"], r["lr"], r["seed"]))
    order = list(RUNS)
    return sorted(kept, key=lambda r: (order.index(r["member"]), r["lr"], r["seed"]))


def numbers(text: str, kind: type, flag: str) -> list:
    """A comma-separated list of ``kind`` (float or int); a one-line error otherwise."""
    try:
        values = [kind(v) for v in text.split(",") if v.strip()]
    except ValueError:
        values = []
    if not values or any(v < 0 for v in values):
        raise SystemExit(f"error: {flag} wants comma-separated numbers >= 0, got {text!r}")
    return values


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", default="runs/attention", type=Path, help="the run folders")
    parser.add_argument(
        "--only",
        nargs="+",
        default=list(RUNS),
        metavar="NAME",
        help="members to run (default: all; --list names them)",
    )
    parser.add_argument("--lrs", default=LRS, help=f"the sweep's learning rates ({LRS})")
    parser.add_argument(
        "--seeds", default=SEEDS, help=f"seeds at the chosen rate, the first the sweep's ({SEEDS})"
    )
    add_study_options(parser, results=ROOT / "results" / "attention_family.json")
    parser.add_argument("--list", action="store_true", help="print the members and their changes")
    args = parser.parse_args(argv)
    if args.list:
        for name, (config, change) in RUNS.items():
            print(f"{name:22s} {config} {' '.join(change)}")
        return 0
    unknown = [name for name in args.only if name not in RUNS]
    if unknown:
        parser.error(f"unknown member {unknown[0]!r}; --list names them")
    lrs, seeds = numbers(args.lrs, float, "--lrs"), numbers(args.seeds, int, "--seeds")
    extra = [*args.overrides] + ([] if args.threads is None else [f"train.threads={args.threads}"])
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    context = {
        "commit": git_commit(),  # the code that runs, whatever is committed while it runs
        "command": shlex.join(["python", "tools/compare_attention.py", *(argv or sys.argv[1:])]),
        **machine(),
        "timed_alone": not args.machine_busy,
    }
    if args.threads is not None:  # what the runs used, not this process's start
        context["threads"] = args.threads
    results = args.results
    earlier = json.loads(results.read_text(encoding="utf-8")) if results.is_file() else []
    try:
        for member in args.only:
            rows = []
            for lr in lrs:  # the sweep
                rows.append({**train_and_evaluate(args.out, member, lr, seeds[0], extra),
                             "phase": "sweep", **context})  # fmt: skip
            lr = chosen_lr(rows, member, seeds[0])
            if lr is None:
                logger.warning("%s: no rate trained without diverging; no seeds", member)
            else:
                logger.info("%s: lr %g chosen on val", member, lr)
                for seed in seeds[1:]:
                    rows.append({**train_and_evaluate(args.out, member, lr, seed, extra),
                                 "phase": "seeds", **context})  # fmt: skip
            # written after each member, so an interrupted study keeps what it finished
            merged = merge(results, rows)
            results.parent.mkdir(parents=True, exist_ok=True)
            results.write_text(json.dumps(merged, indent=1) + "\n", encoding="utf-8")
    except CaptioningError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    rows = json.loads(results.read_text(encoding="utf-8"))
    added = len(rows) - len(earlier)
    print(f"wrote {results}: {len(rows)} rows ({added:+d}); python tools/tables.py renders them")
    return 0


if __name__ == "__main__":
    sys.exit(main())
