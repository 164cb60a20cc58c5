"""Train hard attention with each gradient estimator and several seeds; tabulate the test split.

    python -m tools.compare_estimators --out runs/estimators [--config configs/shapes_hard.yaml] \
        [--estimators reinforce exact ...] [--seeds 0 1 2] [--soft-share P] \
        [--set train.epochs=6 ...] [--jobs N] [--results results/hard_estimators.json]

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
the pointing game by word type. The runner (:mod:`lab.runner`) trains, resumes and
records: one row per (estimator, seed, decode mode) with its settings, precision, threads,
device, commit and command, merged into ``--results FILE`` where given, else into
``OUT/rows.json``; ``OUT/results.md`` tabulates the rows (mean ± standard deviation over the
seeds, a single value for one seed, and the wall time of training).
"""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path
from typing import Any

from captioning.config import Config, load_config
from captioning.errors import CaptioningError
from captioning.objectives.hard_attention import ESTIMATORS, MULTI_SAMPLE
from lab.options import add_runner_options, add_seeds_option, seeds_of, threads_for
from lab.runner import Evaluation, Outcome, Recorder, RunSpec, plan, run_fields, run_study

# the test scores each row keeps (the columns of the table in docs/hard-attention.md)
COLUMNS = (
    "exact_match",
    "Bleu_4",
    "CIDEr",
    "pointing_game/color",
    "pointing_game/size",
    "pointing_game/category",
)
# the keys through which the tool sets each estimator's share of expected-context minibatches
MIXING = ("train.exact_soft_p", "train.semi_sampling_p")
# the estimators with a score-function term, scaled by lambda_r (train.reinforce_weight)
SCORE_FUNCTION = ("reinforce", "reinforce_loo", "vimco")


def KEY(row: dict[str, Any]) -> tuple:  # noqa: N802 (a constant of the study, as a function)
    """A row's identity in its results file: estimator, seed and decode mode."""
    return (row["estimator"], row["seed"], row["decode"])


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
    return [
        f"train.hard_estimator={estimator}",
        "train.exact_soft_p=0",
        f"train.semi_sampling_p={1.0 - soft_share}",
    ]


def estimator_config(
    config: str, estimator: str, seed: int, overrides: list[str], soft_share: float | None
) -> Config:
    """The config one (estimator, seed) run trains with; ``soft_share`` None takes the
    config file's own."""
    if soft_share is None:
        soft_share = soft_share_of(load_config(config))
    return load_config(
        config,
        [
            *overrides,
            *estimator_overrides(estimator, soft_share),
            f"train.seed={seed}",
            "train.quiet=true",
        ],
    )


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


def estimator_spec(config: str, cfg: Config, out: Path, overrides: list[str]) -> RunSpec:
    """One (estimator, seed) run as the runner's spec, decoded with every context (and
    ``marginal`` where the context does not enter the LSTM)."""
    estimator, seed = cfg.train.hard_estimator, cfg.train.seed
    soft_share = soft_share_of(cfg)
    modes = ["expectation", "argmax", "sample"] + (
        [] if cfg.model.context_to_lstm else ["marginal"]
    )
    own = (*overrides, *estimator_overrides(estimator, soft_share))
    tests = tuple(Evaluation("test", hard_context=mode) for mode in modes)
    return RunSpec(estimator, config, own, seed, out / estimator / f"seed{seed}", evaluations=tests)


def estimator_rows(outcome: Outcome) -> list[dict[str, Any]]:
    """One row per decode mode of a run: its settings, train time and test scores."""
    spec = outcome.spec
    cfg = spec.load()
    rows = []
    for evaluation in spec.evaluations:
        metrics = outcome.metrics[evaluation.name]
        flat = {
            **metrics,
            **{
                f"pointing_game/{k.split('/')[-1]}": v
                for k, v in metrics.get("grounding_by_word_type", {}).items()
                if k.startswith("pointing_game/")
            },
        }
        rows.append(
            {
                "estimator": spec.name,
                "seed": spec.seed,
                "decode": evaluation.hard_context,
                **settings_of(cfg),
                "config": spec.config,
                "overrides": list(spec.overrides),
                "train_seconds": outcome.train_seconds,
                "epochs": len(outcome.history),
                **run_fields(outcome),
                **{key: flat.get(key) for key in COLUMNS},
            }
        )
        logging.info(
            "%s seed %d %s: %s", spec.name, spec.seed, evaluation.hard_context, json.dumps(rows[-1])
        )
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m tools.compare_estimators", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--config", default="configs/shapes_hard.yaml")
    parser.add_argument("--out", default="runs/estimators", type=Path)
    parser.add_argument("--estimators", nargs="*", default=list(ESTIMATORS), choices=ESTIMATORS)
    add_seeds_option(parser, "0,1,2")
    parser.add_argument(
        "--soft-share",
        type=float,
        default=None,
        help="the share of every estimator's minibatches trained with the "
        "expected context (default: the config's)",
    )
    add_runner_options(parser)
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
    try:  # every run's config is checked before the first run starts
        seeds, threads = seeds_of(args), threads_for(args.jobs, args.threads)
        configs = [
            estimator_config(args.config, estimator, seed, args.overrides, args.soft_share)
            for seed in seeds
            for estimator in args.estimators
        ]
        specs = plan(
            [estimator_spec(args.config, cfg, args.out, args.overrides) for cfg in configs], threads
        )
        recorder = Recorder.from_args("tools.compare_estimators", argv, args, KEY)
        rows: list[dict[str, Any]] = []
        for made in run_study(specs, estimator_rows, jobs=args.jobs):
            rows += made
            recorder.write(made)  # after each run: an interrupted study keeps what it did
    except CaptioningError as exc:
        raise SystemExit(f"error: {exc}") from None
    from tools.tables import hard_estimators  # the docs' table, of this invocation's rows

    (args.out / "results.md").write_text(hard_estimators(rows))
    print(hard_estimators(rows))
    print(f"wrote {recorder.path} and {args.out / 'results.md'}")


if __name__ == "__main__":
    main()
