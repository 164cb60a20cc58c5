"""The attention family on shapes, as data: each member's learning rate chosen on val, then seeds.

    python -m tools.compare_attention --out runs/attention --results results/attention_family.json
    python -m tools.compare_attention --out runs/attention --only soft soft-dot --seeds 0
    python -m tools.compare_attention --list

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

Each run is one row of ``--results FILE`` where given (results/attention_family.json), else of
``OUT/rows.json``: the member, the config and every override, the learning rate and seed,
the phase, the validation and test scores, trainable parameters, train seconds and steps/s,
the precision, threads and device, the commit, the command and the machine. Rows merge into
the file by (member, lr, seed, the small CNN's blocks), so the study runs in pieces
(``--only``) and resumes: the runner (:mod:`lab.runner`) evaluates a run folder
``OUT/MEMBER/lrLR-seedS`` that finished without retraining it, resumes one that stopped
part-way from its ``last.pt``, and keeps the ``failed.json`` of one whose training diverged,
whose row says so. ``--jobs N`` trains N rates (then N seeds) side by side. The tables in
docs/attention.md are rendered from results/attention_family.json.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import Any

from captioning.config import load_config
from captioning.inference.caption import load_model
from lab import ROOT
from lab.options import (
    add_runner_options,
    add_seeds_option,
    errors_in_one_line,
    parser_for,
    seeds_of,
    threads_for,
)
from lab.runner import Evaluation, Outcome, Recorder, RunSpec, plan, run_fields, run_spec, run_study

logger = logging.getLogger("captioning")

SOFT, HARD = "configs/shapes_soft.yaml", "configs/shapes_hard.yaml"
LOCAL = "configs/shapes_local.yaml"
RUNS = {
    "none": (SOFT, ["model.attention=none"]),
    "soft": (SOFT, []),  # the additive score, the paper's
    **{
        f"soft-{score}": (SOFT, [f"model.score={score}"])
        for score in ("additive_relu", "dot", "scaled_dot", "general", "cosine", "location")
    },
    "local": (LOCAL, []),
    "key-value": (SOFT, ["model.values=projected", "model.value_dim=128"]),
    **{f"multi-head-{heads}": (SOFT, [f"model.heads={heads}"]) for heads in (2, 4, 8)},
    "grid-self-attention": (SOFT, ["model.grid_layers=2"]),
    "hard": (HARD, []),
}
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
    the seed, then ``extra`` (the command's ``--set``)."""
    config, change = RUNS[member]
    shipped = load_config(ROOT / config).train
    encoder_lr = lr * shipped.encoder_lr / shipped.lr
    rates = [f"train.lr={lr:g}", f"train.encoder_lr={encoder_lr:g}"]
    return config, [*change, *rates, f"train.seed={seed}", *extra]


EVALUATIONS = (
    Evaluation("val"),
    Evaluation("test"),
    *(Evaluation("test", hard_context=mode) for mode in HARD_CONTEXTS),
)


def member_spec(out: Path, member: str, lr: float, seed: int, extra: list[str]) -> RunSpec:
    """One run as the runner's spec; hard attention is also scored with each context."""
    config, overrides = settings(member, lr, seed, extra)
    hard = load_config(ROOT / config, overrides).model.attention == "hard"
    return RunSpec(
        member,
        config,
        tuple(overrides),
        seed,
        run_folder(out, member, lr, seed),
        plumbing=(),
        evaluations=EVALUATIONS if hard else EVALUATIONS[:2],
        meta={"lr": lr},
    )


def row_key(row: dict[str, Any]) -> tuple[str, float, int, str]:
    """A row's identity in the results file: rows of the same member, rate and seed trained
    with other blocks sit beside each other (rows before ``blocks`` was recorded: plain)."""
    return row["member"], row["lr"], row["seed"], row.get("blocks", "plain")


def member_row(outcome: Outcome) -> dict[str, Any]:
    """A run's row: its settings, then its scores, or ``failed`` where it diverged."""
    spec = outcome.spec
    cfg = spec.load()
    row: dict[str, Any] = {
        "member": spec.name,
        "config": spec.config,
        "change": RUNS[spec.name][1],
        "overrides": [*spec.overrides, *spec.plumbing],
        "lr": spec.meta["lr"],
        "encoder_lr": cfg.train.encoder_lr,
        "seed": spec.seed,
        "select_metric": cfg.train.select_metric,
        "epochs": cfg.train.epochs,
        "blocks": cfg.model.cnn_block,  # the small CNN's; the stall study compares them
    }
    if outcome.failed is not None:
        return {**row, "failed": outcome.failed}
    seconds = outcome.train_seconds  # the epochs themselves (training and validation)
    model = load_model(spec.folder / "last.pt")[0]
    metrics = outcome.metrics
    row.update(
        **run_fields(outcome),
        val_select=metrics["val"][cfg.train.select_metric],
        val=scores(metrics["val"]),
        test=scores(metrics["test"]),
        parameters=sum(p.numel() for p in model.parameters() if p.requires_grad),
        train_seconds=seconds,
        steps=outcome.summary["steps"],
        steps_per_s=round(outcome.summary["steps"] / seconds, 3),
    )
    if model.hard_attention:
        row["test_by_hard_context"] = {m: scores(metrics[f"test_{m}"]) for m in HARD_CONTEXTS}
    return row


def train_and_evaluate(
    out: Path, member: str, lr: float, seed: int, extra: list[str]
) -> dict[str, Any]:
    """One run through the runner, in this process: its row without the provenance."""
    return member_row(run_spec(member_spec(out, member, lr, seed, extra)))


def chosen_lr(rows: list[dict[str, Any]], member: str, seed: int) -> float | None:
    """The member's learning rate with the best validation score among its rows of ``seed``
    (the lower rate on a tie); None without a scored row."""
    sweep = [r for r in rows if r["member"] == member and r["seed"] == seed and "val" in r]
    if not sweep:
        return None
    return max(sweep, key=lambda r: (r["val_select"], -r["lr"]))["lr"]


def order(earlier: list[dict[str, Any]], merged: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """By member (as in RUNS), learning rate, then seed."""
    members = list(RUNS)
    return sorted(merged, key=lambda r: (members.index(r["member"]), r["lr"], r["seed"]))


def numbers(text: str, kind: type, flag: str) -> list:
    """A comma-separated list of ``kind`` (float or int); a one-line error otherwise."""
    try:
        values = [kind(v) for v in text.split(",") if v.strip()]
    except ValueError:
        values = []
    if not values or any(v < 0 for v in values):
        raise SystemExit(f"error: {flag} wants comma-separated numbers >= 0, got {text!r}")
    return values


@errors_in_one_line
def main(argv: list[str] | None = None) -> int:
    parser = parser_for("tools.compare_attention", __doc__)
    parser.add_argument("--out", default="runs/attention", type=Path, help="the run folders")
    parser.add_argument(
        "--only",
        nargs="+",
        default=list(RUNS),
        metavar="NAME",
        help="members to run (default: all; --list names them)",
    )
    parser.add_argument("--lrs", default=LRS, help=f"the sweep's learning rates ({LRS})")
    add_seeds_option(parser, SEEDS, ", at the chosen rate; the first is the sweep's")
    add_runner_options(parser)
    parser.add_argument("--list", action="store_true", help="print the members and their changes")
    args = parser.parse_args(argv)
    if args.list:
        for name, (config, change) in RUNS.items():
            print(f"{name:22s} {config} {' '.join(change)}")
        return 0
    unknown = [name for name in args.only if name not in RUNS]
    if unknown:
        parser.error(f"unknown member {unknown[0]!r}; --list names them")
    lrs = numbers(args.lrs, float, "--lrs")
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    seeds = seeds_of(args)
    threads = threads_for(args.jobs, args.threads)
    recorder = Recorder.from_args("tools.compare_attention", argv, args, row_key, order=order)

    def run(phase: str, specs: list[RunSpec]) -> list[dict[str, Any]]:
        rows = []
        for (row,) in run_study(plan(specs, threads), member_row, jobs=args.jobs):
            rows.append({**row, "phase": phase})
            # written after each run, so an interrupted study keeps what it finished
            recorder.write(rows[-1:])
        return rows

    for member in args.only:
        sweep = run(
            "sweep", [member_spec(args.out, member, lr, seeds[0], args.overrides) for lr in lrs]
        )
        lr = chosen_lr(sweep, member, seeds[0])
        if lr is None:
            logger.warning("%s: no rate trained without diverging; no seeds", member)
            continue
        logger.info("%s: lr %g chosen on val", member, lr)
        run(
            "seeds",
            [member_spec(args.out, member, lr, seed, args.overrides) for seed in seeds[1:]],
        )
    print(f"wrote {recorder.path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
