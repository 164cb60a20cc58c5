"""The study runner: a study is a list of :class:`RunSpec` (a config, its overrides, a seed, a
run folder, how to evaluate it); the runner trains, evaluates and records rows.

    specs = [RunSpec("soft", "configs/shapes_soft.yaml", seed=s, folder=out / f"soft-{s}",
                     evaluations=(Evaluation("test"),)) for s in parse_seeds("0-2")]
    recorder = Recorder.from_args("tools.my_study", argv, args, key=lambda r: r["seed"])
    for rows in run_study(plan(specs, threads), make_row, jobs=args.jobs):
        recorder.write(rows)

:func:`run_spec` is the loop every study shares: train a run unless its folder holds a
finished one (``summary.json``, or a ``last.pt`` at the config's last epoch), resume from
``last.pt`` where it stopped part-way, keep a diverged run's ``failed.json`` (its outcome says
so, with no scores), then evaluate ``best.pt`` as the spec says. :func:`run_study` runs the
specs one after another or ``--jobs N`` side by side (one process each); :func:`plan` gives
each run ``train.threads`` = max(1, cores // N) so that parallel trainings never share the
cores unawares. :class:`Recorder` stamps the rows (:mod:`lab.provenance`) and merges
them (:func:`lab.results.write_results`) into ``--results FILE`` when given, else into
``OUT/rows.json`` only: a study never writes into results/ unless asked.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from captioning.checkpoint import load_checkpoint
from captioning.config import Config, config_to_dict, load_config
from captioning.evaluate import evaluate_checkpoint
from captioning.files import write_atomically
from captioning.runtime import resolve_device, resolve_precision
from captioning.training.step import TrainingError
from captioning.training.train import fit
from lab.options import (
    StudyError,
)
from lab.provenance import ROOT, cpu_model, device_name, git_commit, module_command, usable_cores
from lab.results import PLUMBING, Key, Row, settings_of, write_results

SUMMARY, FAILED = "summary.json", "failed.json"  # in a run folder: finished, or diverged
# config keys that may differ between a run folder and the spec that resumes or re-reads it:
# where and how fast it runs, and what is resolved at training time
_FREE = (*PLUMBING, "train.epochs", "train.precision", "decode.precision")


@dataclass(frozen=True)
class Evaluation:
    """One scoring of a run's ``best.pt``: a split, a beam (None: greedy), a hard-attention
    context, and further :func:`captioning.evaluate.evaluate_checkpoint` keywords."""

    split: str = "test"
    beam_size: int | None = None
    hard_context: str | None = None
    options: tuple[tuple[str, Any], ...] = (("meteor", False),)
    write: bool = True  # its captions and metrics into the run folder (eval_NAME)

    @property
    def name(self) -> str:
        """``test``, ``test_argmax``, ``test_beam3``: its key in an outcome's metrics and its
        folder (``eval_NAME``) in the run folder."""
        parts = [self.split, self.hard_context, self.beam_size and f"beam{self.beam_size}"]
        return "_".join(str(p) for p in parts if p)


@dataclass(frozen=True)
class RunSpec:
    """One run of a study.

    Args:
        name: the run's member or variant, as its rows call it.
        config: the config file, relative to the repository root.
        overrides: what this run changes (``KEY=VALUE``), the seed aside.
        seed: ``train.seed``.
        folder: the run folder (trained into, resumed, or read when finished).
        plumbing: overrides that change where and how fast it runs, not what it learns
            (``data.root``, ``train.threads``, ``train.quiet``).
        init: a checkpoint whose weights start the run (a second stage, as SCST).
        evaluations: how ``best.pt`` is scored.
        adopted: a folder trained elsewhere: it is never trained here (an unfinished one
            is an error).
        checked: refuse a folder trained with other settings (:func:`check_folder`); a
            study that reads a finished folder's settings from it (the seed study) says no.
        meta: fields the study's rows carry (not used by the runner).
    """

    name: str
    config: str
    overrides: tuple[str, ...] = ()
    seed: int = 0
    folder: Path = Path("runs")
    plumbing: tuple[str, ...] = ("train.quiet=true",)
    init: Path | None = None
    evaluations: tuple[Evaluation, ...] = ()
    adopted: bool = False
    checked: bool = True
    meta: dict[str, Any] = field(default_factory=dict, compare=False)

    def settings(self) -> list[str]:
        """Every override, in the order they apply: the run's, the seed, the plumbing."""
        return [*self.overrides, f"train.seed={self.seed}", *self.plumbing]

    def load(self) -> Config:
        """The config this run trains with."""
        return load_config(ROOT / self.config, self.settings())


@dataclass
class Outcome:
    """What :func:`run_spec` found or made: the run's config as trained (None if it diverged
    before writing one), ``failed`` (the divergence) or its ``summary`` and ``history``, and
    ``metrics`` and the ``eval_seconds`` of each by :attr:`Evaluation.name`."""

    spec: RunSpec
    cfg: Config | None
    failed: str | None = None
    trained_now: bool = False
    summary: dict[str, Any] = field(default_factory=dict)
    history: list[dict[str, Any]] = field(default_factory=list)
    metrics: dict[str, dict[str, Any]] = field(default_factory=dict)
    eval_seconds: dict[str, float] = field(default_factory=dict)

    @property
    def train_seconds(self) -> float:
        """The seconds of the run's epochs (training and validation), from its history."""
        return round(sum(e.get("seconds", 0.0) for e in self.history), 2)


def flat_settings(values: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """A nested settings dict as dotted keys (``{"train": {"lr": 1}}`` -> ``{"train.lr": 1}``)."""
    flat = {}
    for key, value in values.items():
        if isinstance(value, dict):
            flat.update(flat_settings(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def check_folder(spec: RunSpec, cfg: Config) -> None:
    """Refuse a run folder whose ``config.yaml`` was trained with other settings than
    ``cfg`` (plumbing, epochs and precision aside)."""
    saved = spec.folder / "config.yaml"
    if not spec.checked or not saved.is_file():
        return
    had, wants = (
        flat_settings(config_to_dict(load_config(saved))),
        flat_settings(config_to_dict(cfg)),
    )
    free = [k for k in wants if k.startswith("runtime.") or k in _FREE]
    changed = [k for k, v in wants.items() if k not in free and had.get(k, v) != v]
    if changed:
        raise StudyError(
            f"{spec.folder} holds a run with other settings "
            f"({', '.join(changed[:4])}); give another --out"
        )


def _finished(spec: RunSpec, cfg: Config) -> bool:
    """Whether the folder's run finished: its ``summary.json``, else its ``last.pt`` at the
    last epoch (of ``cfg``, or of the folder's own config where its settings stand)."""
    folder = spec.folder
    if (folder / SUMMARY).is_file():
        return True
    last = folder / "last.pt"
    if not last.is_file():
        return False
    state = load_checkpoint(last)
    epochs = cfg.train.epochs if spec.checked else state["config"]["train"]["epochs"]
    return state["epoch"] >= epochs


def train(spec: RunSpec) -> Outcome:
    """Train ``spec`` unless its folder holds a finished or diverged run (see the module)."""
    cfg, folder = spec.load(), spec.folder
    if (folder / FAILED).is_file():
        return Outcome(spec, None, failed=json.loads((folder / FAILED).read_text())["failed"])
    check_folder(spec, cfg)
    trained_now = not _finished(spec, cfg)
    if trained_now:
        last = folder / "last.pt"
        if spec.adopted:
            raise StudyError(
                f"{folder} has not finished training; resume it with captioning "
                f"train --resume {last}, or leave it out"
            )
        resume = str(last) if last.is_file() else None
        init = None if resume or spec.init is None else str(spec.init)
        try:
            summary = fit(cfg, folder, resume=resume, init=init)
        except TrainingError as exc:  # diverged: a result of these settings, not a crash
            write_atomically(folder / FAILED, json.dumps({"failed": str(exc)}) + "\n")
            return Outcome(spec, None, failed=str(exc))
        kept = ("best_score", "best_epoch", "epochs", "steps", "seconds")
        write_atomically(folder / SUMMARY, json.dumps({k: summary[k] for k in kept}) + "\n")
    state = load_checkpoint(
        folder / "last.pt" if (folder / "last.pt").is_file() else folder / "best.pt"
    )
    summary = json.loads((folder / SUMMARY).read_text()) if (folder / SUMMARY).is_file() else {}
    summary.setdefault("steps", state["step"])
    return Outcome(
        spec,
        load_config(folder / "config.yaml"),
        trained_now=trained_now,
        summary=summary,
        history=state["history"],
    )


def run_spec(spec: RunSpec) -> Outcome:
    """Train ``spec`` (see :func:`train`) and score its ``best.pt`` by each evaluation."""
    outcome = train(spec)
    if outcome.failed is None:
        for evaluation in spec.evaluations:
            started = time.perf_counter()
            outcome.metrics[evaluation.name] = evaluate_checkpoint(
                spec.folder / "best.pt",
                split=evaluation.split,
                beam_size=evaluation.beam_size,
                hard_context=evaluation.hard_context,
                progress=False,
                out_dir=spec.folder / f"eval_{evaluation.name}" if evaluation.write else None,
                **dict(evaluation.options),
            )
            outcome.eval_seconds[evaluation.name] = round(time.perf_counter() - started, 2)
    return outcome


def run_fields(outcome: Outcome) -> dict[str, Any]:
    """What every row says of its run: the precision it trained in, the threads it used and
    the device (the CPU model, or the GPU's name under CUDA)."""
    cfg = outcome.cfg or outcome.spec.load()
    device = resolve_device(cfg.train.device)
    return {
        "precision": resolve_precision(cfg.train.precision, device),
        "threads": cfg.train.threads or torch.get_num_threads(),
        "device": device_name(device),
    }


MakeRow = Callable[[Outcome], "Row | list[Row]"]


def _job(make_row: MakeRow, spec: RunSpec, run: Callable[[RunSpec], Outcome]) -> list[Row]:
    made = make_row(run(spec))
    return made if isinstance(made, list) else [made]


def run_study(
    specs: list[RunSpec],
    make_row: MakeRow,
    *,
    jobs: int = 1,
    run: Callable[[RunSpec], Outcome] = run_spec,
) -> Iterator[list[Row]]:
    """Each spec's rows (``make_row`` of its :class:`Outcome`), as each run ends: in order
    with one job, as they finish with several (one process each; ``make_row`` and ``run``
    must then be importable functions of a module)."""
    if jobs == 1 or len(specs) < 2:
        for spec in specs:
            yield _job(make_row, spec, run)
        return
    context = multiprocessing.get_context("spawn")  # a fresh torch in each, no forked state
    with ProcessPoolExecutor(max_workers=jobs, mp_context=context) as pool:
        futures = [pool.submit(_job, make_row, spec, run) for spec in specs]
        for future in as_completed(futures):
            yield future.result()


def plan(specs: list[RunSpec], threads: int | None) -> list[RunSpec]:
    """``specs`` with ``train.threads`` (see :func:`threads_for`) among their plumbing."""
    if threads is None:
        return specs
    return [replace(s, plumbing=(*s.plumbing, f"train.threads={threads}")) for s in specs]


@dataclass
class Recorder:
    """Stamps rows with their provenance and merges them (:func:`write_results`) into
    ``results`` when given, else into ``out/rows.json``.

    Every row gets ``commit`` (``+dirty`` when the checkout differs), ``command`` (module
    form, ``places`` such as ``{"OUT": out, "DATA": data}`` as placeholders), ``cpu``,
    ``cores``, ``torch``, ``jobs`` and ``timed_alone`` (false with ``--machine-busy`` or
    several jobs); a row's own fields win (a run trained at another commit keeps it).
    ``settings`` is the fingerprint that :func:`write_results` compares.
    """

    module: str
    argv: list[str] | None
    out: Path
    key: Key
    results: Path | None = None
    replace: bool = False
    timed_alone: bool = True
    jobs: int = 1
    places: dict[str, Path | None] = field(default_factory=dict)
    order: Callable[[list[Row], list[Row]], list[Row]] | None = None
    settings: Callable[[Row], dict[str, Any]] = settings_of
    stamp: dict[str, Any] = field(init=False)

    def __post_init__(self) -> None:
        self.stamp = {
            "commit": git_commit(),  # the code that runs, whatever is committed meanwhile
            "command": module_command(self.module, self.argv, {"OUT": self.out, **self.places}),
            "cpu": cpu_model(),
            "cores": usable_cores(),
            "torch": torch.__version__,
            "jobs": self.jobs,
            "timed_alone": self.timed_alone and self.jobs == 1,
        }

    @classmethod
    def from_args(
        cls, module: str, argv: list[str] | None, args: argparse.Namespace, key: Key, **kwargs: Any
    ) -> Recorder:
        """A recorder of the options of :func:`add_runner_options` and ``args.out``."""
        return cls(
            module,
            argv,
            Path(args.out),
            key,
            results=args.results,
            replace=args.replace,
            timed_alone=not args.machine_busy,
            jobs=args.jobs,
            **kwargs,
        )

    @property
    def path(self) -> Path:
        """The file the rows go to."""
        return self.results or self.out / "rows.json"

    def write(self, rows: list[Row]) -> list[Row]:
        """Stamp ``rows`` and merge them into :attr:`path`; the file's rows after."""
        stamped = [{**self.stamp, **row} for row in rows]
        return write_results(
            self.path,
            stamped,
            self.key,
            replace=self.replace,
            settings=self.settings,
            order=self.order,
        )
