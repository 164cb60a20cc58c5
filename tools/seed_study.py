"""The seed study of the shapes recipe, as data: which seeds stall, and why.

    python -m tools.seed_study --out runs/seeds --variant warmup_400 --set train.warmup_steps=400
    python -m tools.seed_study --out runs/seeds --variant warmup_100 --set train.warmup_steps=100 \\
        --seeds 0-5 --adopt 2=/path/to/a/finished/run --results results/shapes_seeds.json

``configs/shapes_soft.yaml`` (a small CNN trained from scratch) stalls on some seeds at test
exact match about 0.05: the colour words are guessed. For each seed of ``--seeds`` this trains
the config with the ``--set`` overrides into ``OUT/VARIANT-seedS`` (a folder that already
holds a finished run is evaluated, not retrained; ``--adopt S=FOLDER`` takes seed S from a
folder trained elsewhere), scores its ``best.pt`` on the test split (greedy decoding) and
measures whether its encoder kept the colours: the **colour probe**, a logistic regression
from the decoder's grid feature (encoder and grid layers) at the cell under each object's
centre to the object's colour, fit on the objects of the first two thirds of the first 400
validation images and scored on the rest (chance: one over the colours, 1/6).

Each seed is one row of ``--results FILE`` where given (results/shapes_seeds.json), else of
``OUT/rows.json``: the variant, the config and every setting the run has that the config does
not (the ``--set`` list, and what the run folder's ``config.yaml`` shows), the seed,
validation and test exact match, the pointing game by word type, the colour probe
(``tools.colour_probe``), ``stalled`` (test exact match below 0.5), the train seconds, the
commit the run was **trained** at (``--trained-at`` for a folder the study did not train:
adopted, copied or linked; ``evaluated_at`` is this checkout's), the commands, precision,
threads, device and machine (:mod:`lab.runner` runs and records them; ``--jobs N``
trains N seeds side by side). Rows merge by (variant, seed); the table in docs/attention.md
is rendered from results/shapes_seeds.json.
"""

from __future__ import annotations

import json
import logging
import shlex
import sys
from pathlib import Path
from typing import Any

import torch

from captioning.checkpoint import load_checkpoint
from captioning.config import Config, config_to_dict, load_config, parse_override
from lab import ROOT
from lab.options import (
    StudyError,
    add_runner_options,
    add_seeds_option,
    errors_in_one_line,
    parse_seeds,
    parser_for,
    refuse_plumbing,
    seeds_of,
    threads_for,
)
from lab.runner import (
    Evaluation,
    Outcome,
    Recorder,
    RunSpec,
    flat_settings,
    plan,
    run_fields,
    run_spec,
    run_study,
)
from tools.colour_probe import PROBE_FIT, centre_cell, colour_probe, object_features

logger = logging.getLogger("captioning")

CONFIG = "configs/shapes_soft.yaml"
STALLED_BELOW = 0.5  # test exact match of a stalled run: ~0.05; of a healthy one: > 0.9
RECORD = "seed_study.json"  # in a run folder the study trained: the commit and command
# settings that say where and how fast a run ran, not what it learnt: the study sets them, and
# they are left out of a row's overrides (the seed and threads have their own fields)
PLUMBING = ("train.seed", "train.threads", "train.quiet", "train.device", "data.root")
POINTING = {
    "color": "pointing_game/color",
    "size": "pointing_game/size",
    "shape": "pointing_game/category",
}
__all__ = ["CONFIG", "PLUMBING", "StudyError", "centre_cell", "colour_probe", "parse_seeds"]


# --- settings of a run ------------------------------------------------------------------


def _text(value: Any) -> str:
    """A config value as ``--set`` takes it: ``[32,32,64,128]``, ``true``, ``null``, ``400``."""
    if isinstance(value, list):
        return "[" + ",".join(_text(v) for v in value) + "]"
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    return str(value)


def differences(base: Config, run: Config) -> dict[str, str]:
    """Every setting of ``run`` that ``base`` does not have, as key -> ``--set`` value, but
    the plumbing (seed, threads, paths) and what ``base`` leaves to be resolved (precision
    ``auto``)."""
    before, after = flat_settings(config_to_dict(base)), flat_settings(config_to_dict(run))
    changed = {}
    for key, value in after.items():
        if key.startswith("runtime.") or key in PLUMBING or before.get(key) == value:
            continue
        if key == "train.precision" and before.get(key) == "auto":
            continue
        changed[key] = _text(value)
    return changed


def overrides_of(config: Path, requested: list[str], run: Config | None) -> list[str]:
    """A row's overrides as sorted ``KEY=VALUE``: every key of ``requested`` (the ``--set``
    list, kept even where the config now holds the same value) and whatever else the run
    folder's config shows differs from ``config``. A folder trained with another value than
    ``--set`` asks is refused."""
    keys = [".".join(parse_override(text)[0]) for text in requested]
    asked = flat_settings(config_to_dict(load_config(config, requested)))
    wanted = {key: _text(asked[key]) for key in keys}
    if run is None:
        return sorted(f"{k}={v}" for k, v in wanted.items())
    has = flat_settings(config_to_dict(run))
    for key, value in wanted.items():
        if _text(has[key]) != value:
            raise StudyError(
                f"the run has {key}={_text(has[key])} where --set asks {value}; "
                f"give it another --variant"
            )
    found = {**differences(load_config(config), run), **wanted}
    return sorted(f"{k}={v}" for k, v in found.items())


def parse_adopt(items: list[str], seeds: list[int]) -> dict[int, Path]:
    """``S=FOLDER`` items as seed -> folder; each seed must be one of ``seeds``."""
    adopted = {}
    for item in items:
        seed, sep, folder = item.partition("=")
        if not sep or not seed.strip().isdigit() or not folder:
            raise StudyError(f"--adopt wants SEED=FOLDER, e.g. 5=runs/old/s5, got {item!r}")
        if int(seed) not in seeds:
            raise StudyError(f"--adopt {item}: seed {seed} is not among --seeds")
        if not (Path(folder) / "best.pt").is_file():
            raise StudyError(f"--adopt {item}: {folder} holds no best.pt; name a finished run")
        adopted[int(seed)] = Path(folder)
    return adopted


# --- one seed ---------------------------------------------------------------------------


def train_command(config: str, cfg: Config, overrides: list[str]) -> str:
    """The ``captioning train`` command that trains this run."""
    words = ["captioning", "train"] + (["--quiet"] if cfg.train.quiet else [])
    settings = [f"train.seed={cfg.train.seed}", *overrides]
    if cfg.train.threads is not None:
        settings.insert(1, f"train.threads={cfg.train.threads}")
    words += ["--config", config] + [w for s in settings for w in ("--set", s)]
    return shlex.join(words)


def _overrides(config: str, requested: list[str], folder: Path) -> list[str]:
    try:
        return overrides_of(ROOT / config, requested, load_config(folder / "config.yaml"))
    except StudyError as exc:
        raise StudyError(f"{folder}: {exc}") from exc


def seed_spec(
    config: str,
    variant: str,
    seed: int,
    requested: list[str],
    folder: Path,
    adopted: bool,
    data_root: Path,
) -> RunSpec:
    """One seed as the runner's spec: scored on the test split, greedy, on the CPU (batched
    or GPU decoding moves a stalled grid's scores by a few objects)."""
    test = Evaluation(
        "test",
        options=(("meteor", False), ("data_root", str(data_root)), ("device", "cpu")),
        write=False,
    )
    return RunSpec(
        variant,
        config,
        tuple(requested),
        seed,
        folder,
        plumbing=(f"data.root={data_root}", "train.quiet=true"),
        evaluations=(test,),
        adopted=adopted,
        checked=False,
        meta={"data_root": str(data_root)},
    )


def run_seed(spec: RunSpec) -> Outcome:
    """Refuse a folder trained with another value than ``--set`` asks, then train (unless
    finished) and evaluate it."""
    if (spec.folder / "config.yaml").is_file():
        _overrides(spec.config, list(spec.overrides), spec.folder)
    return run_spec(spec)


def seed_row(outcome: Outcome) -> dict[str, Any]:
    """The row of one seed (without its provenance): scores, the colour probe, settings."""
    spec = outcome.spec
    folder, best_path = spec.folder, spec.folder / "best.pt"
    if outcome.failed is not None:
        raise StudyError(f"{folder} diverged ({outcome.failed}); the seed study needs a model")
    if outcome.trained_now:
        (folder / RECORD).unlink(missing_ok=True)  # main() writes this invocation's
    best = load_checkpoint(best_path)
    run = load_config(folder / "config.yaml")
    if run.train.seed != spec.seed:
        raise StudyError(f"{folder} was trained with seed {run.train.seed}, not {spec.seed}")
    overrides = _overrides(spec.config, list(spec.overrides), folder)
    at_best = next(e for e in best["history"] if e["epoch"] == best["best_epoch"])
    test = outcome.metrics["test"]
    features, labels, colours = object_features(best_path, Path(spec.meta["data_root"]))
    probe = colour_probe(features, labels, classes=len(colours))
    fitted = int(len(labels) * PROBE_FIT)
    by_type = test.get("grounding_by_word_type") or {}
    return {
        "variant": spec.name,
        "config": spec.config,
        "overrides": overrides,
        "seed": spec.seed,
        "val_exact": at_best.get("val_exact_match"),
        "test_exact": test["exact_match"],
        "test_exact_by_objects": test.get("exact_match_by_objects"),
        "pointing": {word: by_type.get(key) for word, key in POINTING.items()},
        "colour_probe": round(probe, 4),
        "probe_objects": {"fit": fitted, "held_out": len(labels) - fitted},
        "probe_chance": round(1 / len(colours), 4),
        "stalled": test["exact_match"] < STALLED_BELOW,
        "train_seconds": outcome.train_seconds or None,
        "steps": best["step"],
        **run_fields(outcome),
        "train_threads": run.train.threads,
        "train_command": train_command(spec.config, run, overrides),
        "trained_now": outcome.trained_now,
    }


def provenance(folder: Path, trained_at: str) -> dict[str, Any]:
    """Where a run folder's run comes from: the commit it was trained at and how. A folder the
    study trained holds its :data:`RECORD`; any other (``--adopt``, or one copied or linked
    into ``--out``) is an adopted run, trained at ``trained_at`` as the command says."""
    record = folder / RECORD
    if record.is_file():
        made = json.loads(record.read_text(encoding="utf-8"))
        return {
            "commit": made["commit"],
            "trained": f"trained at {made['commit'][:7]} by {made['command']}",
            "adopted": False,
        }
    warmup = load_config(folder / "config.yaml").train.warmup_steps
    return {
        "commit": trained_at,
        "trained": f"trained at {trained_at} with warmup_steps={warmup}, adopted from {folder}",
        "adopted": True,
    }


def order(earlier: list[dict[str, Any]], merged: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Variants in the order they first came (the file's, then the new), seeds in order."""
    first = list(dict.fromkeys(r["variant"] for r in [*earlier, *merged]))
    return sorted(merged, key=lambda r: (first.index(r["variant"]), r["seed"]))


@errors_in_one_line
def main(argv: list[str] | None = None) -> int:
    parser = parser_for("tools.seed_study", __doc__)
    parser.add_argument("--out", type=Path, required=True, help="where the run folders go")
    parser.add_argument("--variant", required=True, help="the rows' name for these settings")
    add_seeds_option(parser, "0-9")
    parser.add_argument("--config", default=CONFIG, help=f"the config ({CONFIG})")
    parser.add_argument(
        "--adopt",
        action="append",
        default=[],
        metavar="SEED=FOLDER",
        help="take this seed from a finished run folder instead of training it",
    )
    parser.add_argument(
        "--trained-at",
        default="unknown",
        metavar="COMMIT",
        help="the commit the adopted folders were trained at (recorded in their rows)",
    )
    parser.add_argument(
        "--data-root", type=Path, default=None, help="the shapes data (default: the config's)"
    )
    add_runner_options(parser, each="every run of the variant")
    args = parser.parse_args(argv)
    if not args.variant.replace("_", "").replace("-", "").isalnum():
        parser.error(f"--variant wants letters, digits, - and _, got {args.variant!r}")
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if not (ROOT / args.config).is_file():
        raise StudyError(f"config {args.config} not found; name a file under {ROOT}")
    refuse_plumbing(args.overrides, PLUMBING)
    seeds = seeds_of(args)
    adopted = parse_adopt(args.adopt, seeds)
    data_root = args.data_root or Path(load_config(ROOT / args.config).data.root)
    if not (data_root / "annotations" / "instances_val.json").is_file():
        raise StudyError(
            f"no shapes data under {data_root}; write it with captioning "
            f"shapes --out {data_root}, or give --data-root"
        )
    threads = threads_for(args.jobs, args.threads)
    if threads is not None:
        torch.set_num_threads(threads)
    recorder = Recorder.from_args(
        "tools.seed_study",
        argv,
        args,
        lambda r: (r["variant"], r["seed"]),
        places={"DATA": data_root},
        order=order,
    )
    here = recorder.stamp["commit"]
    folders = {s: adopted.get(s, args.out / f"{args.variant}-seed{s}") for s in seeds}
    specs = plan(
        [
            seed_spec(
                args.config,
                args.variant,
                s,
                args.overrides,
                folders[s],
                s in adopted,
                data_root,
            )
            for s in seeds
        ],
        threads,
    )
    for (row,) in run_study(specs, seed_row, jobs=args.jobs, run=run_seed):
        folder = folders[row["seed"]]
        if row.pop("trained_now"):
            made = {"commit": here, "command": recorder.stamp["command"]}
            (folder / RECORD).write_text(json.dumps(made) + "\n", encoding="utf-8")
        # written after each seed, so an interrupted study keeps what it finished
        merged = recorder.write(
            [{**row, **provenance(folder, args.trained_at), "evaluated_at": here}]
        )
        logger.info(
            "%s seed %d: test exact %.3f, colour probe %.3f%s",
            args.variant,
            row["seed"],
            row["test_exact"],
            row["colour_probe"],
            " (stalled)" if row["stalled"] else "",
        )
    print(f"wrote {recorder.path}: {len(merged)} rows")
    return 0


if __name__ == "__main__":
    sys.exit(main())
