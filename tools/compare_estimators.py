"""Train hard attention with each gradient estimator and several seeds; tabulate the test split.

    python tools/compare_estimators.py --out runs/estimators [--config configs/shapes_hard.yaml] \
        [--estimators reinforce exact ...] [--seeds 0 1 2] [--soft-share P] \
        [--set train.epochs=6 ...]

Each (estimator, seed) trains ``--config`` with ``train.hard_estimator`` and ``train.seed``
set (plus ``--set`` overrides) into ``OUT/<estimator>/seed<k>``, unless that folder already
holds a finished run (a run there with other settings is an error). Every estimator trains the
same share P of its minibatches with the expected context instead (``--soft-share``; default:
the config's own share, ``train.exact_soft_p`` when it trains ``exact``, else 1 -
``train.semi_sampling_p``): ``exact`` through ``train.exact_soft_p = P``, the sampling
estimators through ``train.semi_sampling_p = 1 - P`` with ``train.exact_soft_p = 0``, which
they need (so ``--set`` of either key is refused: give ``--soft-share``). The sampling
estimators keep the config's lambda_r (``train.reinforce_weight``), entropy bonus
(``train.entropy_weight``) and, for reinforce_loo and vimco, K (``train.hard_samples``);
``exact`` has none of these terms. Every row names these settings.

Each ``best.pt`` is decoded on the test split with every decode mode (``marginal`` too,
without the context in the LSTM) and scored without METEOR: exact match, BLEU-4, CIDEr-D and
the pointing game by word type. Writes ``results.json`` (every run, with its settings) and
``results.md`` (mean ± standard deviation over the seeds, a single value for one seed, and
the wall time of training).
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
from typing import Any

from benchmarks.provenance import add_study_options, git_commit, machine, merge_rows, read_rows
from captioning.checkpoint import load_checkpoint
from captioning.config import Config, load_config
from captioning.errors import CaptioningError
from captioning.evaluate import evaluate_checkpoint
from captioning.hard_attention import ESTIMATORS, MULTI_SAMPLE
from captioning.train import fit
from tools.tables import ESTIMATOR_COLUMNS, hard_estimators

COLUMNS = ESTIMATOR_COLUMNS  # the test scores each row keeps


RESULTS = Path(__file__).resolve().parent.parent / "results" / "hard_estimators.json"
# the keys through which the tool sets each estimator's share of expected-context minibatches
MIXING = ("train.exact_soft_p", "train.semi_sampling_p")
# the estimators with a score-function term, scaled by lambda_r (train.reinforce_weight)
SCORE_FUNCTION = ("reinforce", "reinforce_loo", "vimco")


def soft_share_of(cfg: Config) -> float:
    """The share of minibatches ``cfg`` trains with the expected context."""
    if cfg.train.hard_estimator == "exact":
        return cfg.train.exact_soft_p
    return 1.0 - cfg.train.semi_sampling_p


def estimator_overrides(estimator: str, soft_share: float) -> list[str]:
    """What ``estimator`` needs to train ``soft_share`` of its minibatches with the expected
    context (``--set`` overrides, applied after the user's)."""
    if estimator == "exact":
        return ["train.hard_estimator=exact", f"train.exact_soft_p={soft_share}"]
    return [f"train.hard_estimator={estimator}", "train.exact_soft_p=0",
            f"train.semi_sampling_p={1.0 - soft_share}"]  # fmt: skip


def estimator_config(
    config: str, estimator: str, seed: int, overrides: list[str], soft_share: float | None
) -> Config:
    """The config one (estimator, seed) run trains with; ``soft_share`` None takes the
    config file's own."""
    if soft_share is None:
        soft_share = soft_share_of(load_config(config))
    return load_config(config, [*overrides, *estimator_overrides(estimator, soft_share),
                                f"train.seed={seed}", "train.quiet=true"])  # fmt: skip


def settings_of(cfg: Config) -> dict[str, Any]:
    """The settings that differ between estimators (None where an estimator has no such
    term)."""
    train, estimator = cfg.train, cfg.train.hard_estimator
    sampling = estimator != "exact"
    return {
        "soft_share": soft_share_of(cfg),
        "soft_share_per": train.semi_sampling if sampling else "batch",
        "reinforce_weight": train.reinforce_weight if estimator in SCORE_FUNCTION else None,
        "entropy_weight": train.entropy_weight if sampling else None,
        "hard_samples": train.hard_samples if estimator in MULTI_SAMPLE else None,
    }


def merge(path: Path, rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The rows of ``path`` with ``rows``, which replace any of the same estimator, seed and
    decode mode."""

    return merge_rows(read_rows(path), rows, lambda r: (r["estimator"], r["seed"], r["decode"]))


def train_and_evaluate(cfg: Config, out: Path) -> list[dict[str, Any]]:
    estimator, seed = cfg.train.hard_estimator, cfg.train.seed
    run_dir = out / estimator / f"seed{seed}"
    if (run_dir / "last.pt").exists():
        previous = load_checkpoint(run_dir / "last.pt")["config"]["train"]
        changed = [key for key in ("hard_estimator", "seed", "exact_soft_p", "semi_sampling_p",
                                   "reinforce_weight", "entropy_weight", "hard_samples")
                   if previous.get(key) != getattr(cfg.train, key)]  # fmt: skip
        if changed:
            raise SystemExit(f"error: {run_dir} holds a run with other settings "
                             f"({', '.join(changed)}); give another --out")  # fmt: skip
    done = (run_dir / "last.pt").exists() and (
        load_checkpoint(run_dir / "last.pt")["epoch"] >= cfg.train.epochs
    )
    if not done:
        resume = str(run_dir / "last.pt") if (run_dir / "last.pt").exists() else None
        fit(cfg, out_dir=run_dir, resume=resume)
    history = load_checkpoint(run_dir / "last.pt")["history"]
    modes = ["expectation", "argmax", "sample"]
    if not cfg.model.context_to_lstm:
        modes.append("marginal")
    rows = []
    for mode in modes:
        metrics = evaluate_checkpoint(run_dir / "best.pt", split="test", hard_context=mode,
                                      meteor=False, progress=False)  # fmt: skip
        flat = {**metrics, **{f"pointing_game/{k.split('/')[-1]}": v
                              for k, v in metrics.get("grounding_by_word_type", {}).items()
                              if k.startswith("pointing_game/")}}  # fmt: skip
        rows.append({
            "estimator": estimator, "seed": seed, "decode": mode, **settings_of(cfg),
            "train_seconds": sum(epoch["seconds"] for epoch in history),
            "epochs": len(history),
            **{key: flat.get(key) for key in COLUMNS},
        })  # fmt: skip
        logging.info("%s seed %d %s: %s", estimator, seed, mode, json.dumps(rows[-1]))
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/shapes_hard.yaml")
    parser.add_argument("--out", default="runs/estimators")
    parser.add_argument("--estimators", nargs="*", default=list(ESTIMATORS), choices=ESTIMATORS)
    parser.add_argument("--seeds", nargs="*", type=int, default=[0, 1, 2])
    parser.add_argument("--soft-share", type=float, default=None,
                        help="the share of every estimator's minibatches trained with the "
                        "expected context (default: the config's)")  # fmt: skip
    add_study_options(parser, results=RESULTS)
    args = parser.parse_args(argv)
    if args.soft_share is not None and not 0.0 <= args.soft_share < 1.0:
        parser.error(f"--soft-share must be in [0, 1), got {args.soft_share}")
    for override in args.overrides:
        if override.split("=")[0].strip() in MIXING:
            parser.error(
                f"--set {override}: the tool sets the mixing of every estimator; "
                f"give the share of expected-context minibatches as --soft-share"
            )
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    out = Path(args.out)
    try:  # every run's config is checked before the first run starts
        threads = [] if args.threads is None else [f"train.threads={args.threads}"]
        configs = [estimator_config(args.config, estimator, seed, [*args.overrides, *threads],
                                    args.soft_share)
                   for seed in args.seeds for estimator in args.estimators]  # fmt: skip
    except CaptioningError as exc:
        raise SystemExit(f"error: {exc}") from None
    context = {"commit": git_commit(), "timed_alone": not args.machine_busy,
               "command": shlex.join(["python", "tools/compare_estimators.py",
                                      *(sys.argv[1:] if argv is None else argv)]),
               **machine()}  # fmt: skip
    if args.threads is not None:  # what the runs used, not this process's start
        context["threads"] = args.threads
    rows: list[dict] = []
    for cfg in configs:
        rows += [{**row, **context} for row in train_and_evaluate(cfg, out)]
        (out / "results.json").write_text(json.dumps(rows, indent=2))
        (out / "results.md").write_text(hard_estimators(rows))
        args.results.parent.mkdir(parents=True, exist_ok=True)
        merged = merge(args.results, rows)
        args.results.write_text(json.dumps(merged, indent=1) + "\n", encoding="utf-8")
    print(hard_estimators(rows))
    print(f"wrote {args.results}; python tools/tables.py renders it")


if __name__ == "__main__":
    main()
