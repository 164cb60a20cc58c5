"""The seed study of the shapes recipe, as data: which seeds stall, and why.

    python tools/seed_study.py --out runs/seeds --variant warmup_400 --set train.warmup_steps=400
    python tools/seed_study.py --out runs/seeds --variant warmup_100 --set train.warmup_steps=100 \\
        --seeds 0-5 --adopt 2=/path/to/a/finished/run

``configs/shapes_soft.yaml`` (a small CNN trained from scratch) stalls on some seeds at test
exact match about 0.05: the colour words are guessed. For each seed of ``--seeds`` this trains
the config with the ``--set`` overrides into ``OUT/VARIANT-seedS`` (a folder that already
holds a finished run is evaluated, not retrained; ``--adopt S=FOLDER`` takes seed S from a
folder trained elsewhere), scores its ``best.pt`` on the test split (greedy decoding) and
measures whether its encoder kept the colours: the **colour probe**, a logistic regression
from the decoder's grid feature (encoder and grid layers) at the cell under each object's
centre to the object's colour, fit on the objects of the first two thirds of the first 400
validation images and scored on the rest (chance: one over the colours, 1/6).

Each seed is one row of ``--results`` (default results/shapes_seeds.json): the variant, the
config and every setting the run has that the config does not (the ``--set`` list, and what
the run folder's ``config.yaml`` shows), the seed, validation and test exact match, the
pointing game by word type, the colour probe, ``stalled`` (test exact match below 0.5), the
train seconds, the commit the run was **trained** at (``--trained-at`` for a folder the study
did not train: adopted, copied or linked; ``evaluated_at`` is this checkout's), the commands
and the machine. Rows merge by (variant, seed). ``python tools/tables.py`` renders them into
docs/attention.md.
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
from collections import defaultdict
from typing import Any

import torch
from PIL import Image

from benchmarks.provenance import add_study_options, git_commit, machine, merge_rows, read_rows
from captioning.api import load
from captioning.checkpoint import load_checkpoint
from captioning.config import Config, config_to_dict, load_config, parse_override
from captioning.errors import CaptioningError
from captioning.evaluate import evaluate_checkpoint
from captioning.train import fit

logger = logging.getLogger("captioning")

ROOT = Path(__file__).resolve().parent.parent
CONFIG = "configs/shapes_soft.yaml"
STALLED_BELOW = 0.5  # test exact match of a stalled run: ~0.05; of a healthy one: > 0.9
PROBE_IMAGES = 400  # the first validation images whose objects the probe reads
PROBE_FIT = 2 / 3  # the share of those objects (in image order) the probe is fit on
PROBE_STEPS, PROBE_SEED = 500, 0
RECORD = "seed_study.json"  # in a run folder the study trained: the commit and command
# settings that say where and how fast a run ran, not what it learnt: left out of a row's
# overrides (the seed and threads have their own fields)
PLUMBING = ("train.seed", "train.threads", "train.quiet", "train.device", "data.root")
POINTING = {"color": "pointing_game/color", "size": "pointing_game/size",
            "shape": "pointing_game/category"}  # fmt: skip


class StudyError(CaptioningError):
    """A run folder or an argument the study cannot use (the message says what to do)."""


# --- the colour probe -----------------------------------------------------------------


def colour_probe(
    features: torch.Tensor,
    labels: torch.Tensor,
    *,
    classes: int,
    fit_share: float = PROBE_FIT,
    steps: int = PROBE_STEPS,
    seed: int = PROBE_SEED,
) -> float:
    """Held-out accuracy of a multinomial logistic regression from ``features`` to ``labels``.

    The first ``fit_share`` of the rows (in the order given, so that held-out objects come from
    held-out images) are standardised with their own mean and deviation, then fit by Adam
    (``steps`` full-batch steps, learning rate 0.05, L2 weight 1e-3) from zero weights; the
    rest are scored. Deterministic: the same inputs give the same number.

    Args:
        features: (N, D) one feature vector per object.
        labels: (N,) class indices in ``0 .. classes - 1``.
        classes: the number of classes (chance is ``1 / classes`` for balanced labels).
        fit_share: the share of rows fit on; the others are held out.
        steps: optimiser steps.
        seed: the seed of the generator that the fit runs under.
    """
    n = int(len(labels) * fit_share)
    if n < 1 or n >= len(labels):
        raise ValueError(f"the probe needs rows both to fit and to hold out, got {len(labels)}")
    features = features.detach().float()
    mean, std = features[:n].mean(0), features[:n].std(0)
    x = (features - mean) / (std + 1e-6)  # (N, D)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        weight = torch.zeros(x.shape[1], classes, requires_grad=True)  # (D, C)
        bias = torch.zeros(classes, requires_grad=True)  # (C,)
        optimiser = torch.optim.Adam([weight, bias], lr=0.05)
        with torch.enable_grad():
            for _ in range(steps):
                optimiser.zero_grad()
                logits = x[:n] @ weight + bias  # (n, C)
                loss = torch.nn.functional.cross_entropy(logits, labels[:n])
                (loss + 1e-3 * weight.pow(2).sum()).backward()
                optimiser.step()
    with torch.no_grad():
        predicted = (x[n:] @ weight + bias).argmax(1)  # (N - n,)
    return (predicted == labels[n:]).float().mean().item()


def centre_cell(bbox: list[float], width: int, height: int, rows: int, cols: int) -> int:
    """The flat index (row-major) of the grid cell under the centre of a COCO ``bbox``
    (x, y, w, h in the image's pixels), for an image resized whole onto a rows x cols grid."""
    x, y, w, h = bbox
    col = min(int((x + w / 2) / width * cols), cols - 1)
    row = min(int((y + h / 2) / height * rows), rows - 1)
    return row * cols + col


def object_features(
    checkpoint: Path, data_root: Path, images: int = PROBE_IMAGES, batch_size: int = 1
) -> tuple[torch.Tensor, torch.Tensor, list[str]]:
    """The decoder's grid feature at each object's centre cell, over the objects of the first
    ``images`` validation images: features (N, D), colour indices (N,) and the colour names
    (sorted). One image at a time by default: batched encoding moves the features by about
    1e-5, and on a stalled grid that moves the held-out score by a few objects."""
    instances = json.loads((data_root / "annotations" / "instances_val.json").read_text())
    objects = defaultdict(list)
    for annotation in instances["annotations"]:
        objects[annotation["image_id"]].append(annotation)
    colours = sorted({a["color"] for a in instances["annotations"]})
    loaded = load(checkpoint, device="cpu")
    rows, cols = loaded.grid_shape
    chosen = instances["images"][:images]
    features, labels = [], []
    for start in range(0, len(chosen), batch_size):
        batch = chosen[start : start + batch_size]
        pictures = [
            Image.open(data_root / "images" / "val" / image["file_name"]).convert("RGB")
            for image in batch
        ]
        inputs = torch.stack([loaded.prepare(p) for p in pictures])  # (B, 3, S, S) uint8
        with torch.no_grad():
            grid = loaded.model.encode(inputs).float()  # (B, L, D)
        for image, cells in zip(batch, grid):
            for annotation in objects[image["id"]]:
                cell = centre_cell(annotation["bbox"], image["width"], image["height"], rows, cols)
                features.append(cells[cell])  # (D,)
                labels.append(colours.index(annotation["color"]))
    return torch.stack(features), torch.tensor(labels), colours


# --- settings of a run ------------------------------------------------------------------


def _flat(values: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    flat = {}
    for key, value in values.items():
        if isinstance(value, dict):
            flat.update(_flat(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


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
    before, after = _flat(config_to_dict(base)), _flat(config_to_dict(run))
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
    asked = _flat(config_to_dict(load_config(config, requested)))
    wanted = {key: _text(asked[key]) for key in keys}
    if run is None:
        return sorted(f"{k}={v}" for k, v in wanted.items())
    has = _flat(config_to_dict(run))
    for key, value in wanted.items():
        if _text(has[key]) != value:
            raise StudyError(
                f"the run has {key}={_text(has[key])} where --set asks {value}; "
                f"give it another --variant"
            )
    found = {**differences(load_config(config), run), **wanted}
    return sorted(f"{k}={v}" for k, v in found.items())


def parse_seeds(text: str) -> list[int]:
    """``0-5``, ``0,1,3`` or ``2-3,5`` as a sorted list of seeds; a one-line error otherwise."""
    seeds: set[int] = set()
    try:
        for part in (p.strip() for p in text.split(",") if p.strip()):
            low, _, high = part.partition("-")
            first, last = int(low), int(high) if high else int(low)
            if first < 0 or last < first:
                raise ValueError
            seeds.update(range(first, last + 1))
    except ValueError:
        seeds.clear()
    if not seeds:
        raise StudyError(f"--seeds wants seeds >= 0 such as 0-5 or 0,2,4, got {text!r}")
    return sorted(seeds)


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


def study_seed(
    *,
    config: str,
    variant: str,
    seed: int,
    requested: list[str],
    folder: Path,
    adopted: bool,
    data_root: Path,
    threads: int | None,
) -> dict[str, Any]:
    """Train (unless ``folder`` holds a finished run), evaluate and probe one seed: the row
    without its context (commit, command, machine)."""
    plumbing = [f"train.seed={seed}", f"data.root={data_root}", "train.quiet=true"]
    if threads is not None:
        plumbing.append(f"train.threads={threads}")
    cfg = load_config(ROOT / config, [*requested, *plumbing])
    best_path, last_path = folder / "best.pt", folder / "last.pt"
    finished = best_path.is_file()
    if finished and last_path.is_file():
        state = load_checkpoint(last_path)
        finished = state["epoch"] >= state["config"]["train"]["epochs"]
    if not finished:
        if adopted:
            raise StudyError(
                f"{folder} has not finished training; resume it with captioning train "
                f"--resume {last_path}, or leave out --adopt"
            )
        if (folder / "config.yaml").is_file():  # a run that stopped part-way: the same run?
            _overrides(config, requested, folder)
        logger.info("%s seed %d: training into %s", variant, seed, folder)
        fit(cfg, folder, resume=str(last_path) if last_path.is_file() else None)
        (folder / RECORD).unlink(missing_ok=True)  # main() writes this invocation's
    best = load_checkpoint(best_path)
    run = load_config(folder / "config.yaml")
    if run.train.seed != seed:
        raise StudyError(f"{folder} was trained with seed {run.train.seed}, not {seed}")
    overrides = _overrides(config, requested, folder)
    history = load_checkpoint(last_path)["history"] if last_path.is_file() else best["history"]
    at_best = next(e for e in best["history"] if e["epoch"] == best["best_epoch"])
    logger.info("%s seed %d: evaluating %s", variant, seed, best_path)
    test = evaluate_checkpoint(
        best_path,
        split="test",
        data_root=str(data_root),
        meteor=False,
        progress=False,
        device="cpu",
    )
    features, labels, colours = object_features(best_path, data_root)
    probe = colour_probe(features, labels, classes=len(colours))
    fitted = int(len(labels) * PROBE_FIT)
    seconds = [e["seconds"] for e in history if "seconds" in e]
    by_type = test.get("grounding_by_word_type") or {}
    return {
        "variant": variant,
        "config": config,
        "overrides": overrides,
        "seed": seed,
        "val_exact": at_best.get("val_exact_match"),
        "test_exact": test["exact_match"],
        "test_exact_by_objects": test.get("exact_match_by_objects"),
        "pointing": {word: by_type.get(key) for word, key in POINTING.items()},
        "colour_probe": round(probe, 4),
        "probe_objects": {"fit": fitted, "held_out": len(labels) - fitted},
        "probe_chance": round(1 / len(colours), 4),
        "stalled": test["exact_match"] < STALLED_BELOW,
        "train_seconds": round(sum(seconds), 2) if seconds else None,
        "steps": best["step"],
        "precision": run.train.precision,
        "train_threads": run.train.threads,
        "train_command": train_command(config, run, overrides),
        "trained_now": not finished,
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


def merge(path: Path, rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The rows in ``path`` with ``rows``, which replace any earlier row of the same variant
    and seed; variants in the order they first came, seeds in order."""
    earlier = read_rows(path)
    kept = merge_rows(earlier, rows, lambda r: (r["variant"], r["seed"]))
    order = list(dict.fromkeys(r["variant"] for r in [*earlier, *rows]))
    return sorted(kept, key=lambda r: (order.index(r["variant"]), r["seed"]))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, required=True, help="where the run folders go")
    parser.add_argument("--variant", required=True, help="the rows' name for these settings")
    parser.add_argument("--seeds", default="0-9", help="seeds, e.g. 0-9 or 0,2,4 (0-9)")
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
    add_study_options(
        parser, results=ROOT / "results" / "shapes_seeds.json", each="every run of the variant"
    )
    args = parser.parse_args(argv)
    if not args.variant.replace("_", "").replace("-", "").isalnum():
        parser.error(f"--variant wants letters, digits, - and _, got {args.variant!r}")
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        if not (ROOT / args.config).is_file():
            raise StudyError(f"config {args.config} not found; name a file under {ROOT}")
        for text in args.overrides:
            key = ".".join(parse_override(text)[0])
            if key in PLUMBING:
                raise StudyError(f"--set {text}: {key} is the study's to set; use --seeds, "
                                 f"--threads or --data-root")  # fmt: skip
        seeds = parse_seeds(args.seeds)
        adopted = parse_adopt(args.adopt, seeds)
        data_root = args.data_root or Path(load_config(ROOT / args.config).data.root)
        if not (data_root / "annotations" / "instances_val.json").is_file():
            raise StudyError(f"no shapes data under {data_root}; write it with captioning "
                             f"shapes --out {data_root}, or give --data-root")  # fmt: skip
        if args.threads is not None:
            torch.set_num_threads(args.threads)
        here = git_commit()
        context = {
            "evaluated_at": here,
            "command": shlex.join(["python", "tools/seed_study.py", *(argv or sys.argv[1:])]),
            **machine(),
            "timed_alone": not args.machine_busy,
        }
        rows = []
        for seed in seeds:
            folder = adopted.get(seed, args.out / f"{args.variant}-seed{seed}")
            row = study_seed(config=args.config, variant=args.variant, seed=seed,
                             requested=args.overrides, folder=folder, adopted=seed in adopted,
                             data_root=data_root, threads=args.threads)  # fmt: skip
            if row.pop("trained_now"):
                record = {"commit": here, "command": context["command"]}
                (folder / RECORD).write_text(json.dumps(record) + "\n", encoding="utf-8")
            rows.append({**row, **provenance(folder, args.trained_at), **context})
            logger.info("%s seed %d: test exact %.3f, colour probe %.3f%s", args.variant, seed,
                        row["test_exact"], row["colour_probe"],
                        " (stalled)" if row["stalled"] else "")  # fmt: skip
            # written after each seed, so an interrupted study keeps what it finished
            args.results.parent.mkdir(parents=True, exist_ok=True)
            merged = merge(args.results, rows)
            args.results.write_text(json.dumps(merged, indent=1) + "\n", encoding="utf-8")
    except CaptioningError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {args.results}: {len(merged)} rows; python tools/tables.py renders them")
    return 0


if __name__ == "__main__":
    sys.exit(main())
