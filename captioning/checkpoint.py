"""Checkpoints: plain data only, written atomically, read with ``weights_only=True``.

A checkpoint is a dict of tensors, numbers, strings, lists and dicts. Its schema is
:meth:`captioning.training.run_state.Run.state_dict` (``model``, ``optimizer``, ``scheduler``,
``epoch``, ``step``, ``config``: the resolved config dict, ``vocab``: the word list, ``rng``: one
state per process, ...) plus ``format_version``. It rebuilds its own model, and a file crafted to
run code when unpickled is refused instead of executed. Files of an older format version are
upgraded when they are read.
"""

from __future__ import annotations

import os
import pickle
import random
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch

from captioning.config import rename_legacy_keys
from captioning.errors import CheckpointError
from captioning.signals import signals_deferred

# 2: renamed config keys (see captioning.config.RENAMED_KEYS); ``rng`` is a list with one
#    state per process (version 1: one dict, and every rank's in ``rng_ranks`` under DDP).
# 3: the training objective's state under ``objective`` (version 2: the hard-attention
#    baseline under ``baseline``).
# 4: the small CNN's blocks are residual unless ``model.cnn_residual`` is false (version 3:
#    always plain, so its configs get ``cnn_residual: false``).
# 5: ``model.cnn_block`` (plain, residual or preact) replaces ``model.cnn_residual``.
FORMAT_VERSION = 5
REQUIRED_KEYS = ("format_version", "model", "config", "vocab", "epoch", "step")
_PLAIN = (str, int, float, bool, type(None), torch.Tensor)


def _check_plain(value: Any, where: str = "checkpoint") -> None:
    if isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, str | int):
                raise TypeError(f"{where}: key {key!r} is not a string or integer")
            _check_plain(item, f"{where}.{key}")
    elif isinstance(value, list | tuple):
        for i, item in enumerate(value):
            _check_plain(item, f"{where}[{i}]")
    elif not isinstance(value, _PLAIN):
        raise TypeError(f"{where} holds a {type(value).__name__}: checkpoints take plain data")


def save_checkpoint(payload: dict[str, Any], path: str | Path) -> Path:
    """Write ``payload`` (plain data only) to ``path`` atomically: a crash mid-write leaves
    the previous file intact.

    Raises:
        CheckpointError: the write failed (a full disk); the previous file is kept.
    """
    payload = {"format_version": FORMAT_VERSION, **payload}
    _check_plain(payload)
    path = Path(path)
    try:
        save_atomically(payload, path)
    except (OSError, RuntimeError) as exc:  # torch's zip writer reports a full disk so
        reason = " ".join(str(exc).split())[-120:] or type(exc).__name__
        kept = "the previous one is kept" if path.is_file() else "nothing was written"
        raise CheckpointError(
            f"{path}: cannot write the checkpoint ({reason}); {kept}; free some space and run again"
        ) from exc
    return path


def save_atomically(data: Any, path: str | Path) -> None:
    """``torch.save(data)`` to ``path`` through a temporary file in the same folder, synced
    and then renamed: a crash mid-write leaves the previous file (or none) in place, never a
    half-written one. Missing parent folders are created. Ctrl-C and SIGTERM wait until
    the write is done (see :func:`captioning.signals.signals_deferred`)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with signals_deferred():
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as handle:
                torch.save(data, handle)
                handle.flush()
                os.fsync(handle.fileno())
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise


def remove_partial_writes(folder: str | Path) -> list[Path]:
    """Delete the temporary files of checkpoint writes that never finished (a process killed
    mid-write); call it only while no other process writes into ``folder``."""
    removed = []
    for tmp in Path(folder).glob(".*.pt.*.tmp"):
        tmp.unlink(missing_ok=True)
        removed.append(tmp)
    return removed


def load_checkpoint(path: str | Path, map_location: str | torch.device = "cpu") -> dict[str, Any]:
    """Read a checkpoint safely and check its format.

    Raises:
        CheckpointError: missing file, not a checkpoint, unsafe content, another format
            version, or a missing key, each with a one-line explanation.
    """
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"{path}: checkpoint not found")
    try:
        payload = torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as exc:
        reason = str(exc).strip().splitlines()
        detail = next((line for line in reason if "GLOBAL" in line or "global" in line), "")
        raise CheckpointError(
            f"{path}: refused to load: it holds objects other than plain data, which could "
            f"run code ({detail.strip() or 'unsafe pickle'}); only load files you trust"
        ) from exc
    except Exception as exc:  # torch.load fails in many ways on a file that is not its own
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise CheckpointError(f"{path}: not a readable checkpoint ({first})") from exc
    if not isinstance(payload, dict):
        raise CheckpointError(f"{path}: not a captioning checkpoint (no dict inside)")
    version = payload.get("format_version")
    if version is None:
        raise CheckpointError(f"{path}: not a captioning checkpoint (no format_version)")
    upgrades = {
        1: _upgrade_from_version_1,
        2: _upgrade_from_version_2,
        3: _upgrade_from_version_3,
        4: _upgrade_from_version_4,
    }
    while version in upgrades:
        payload = upgrades[version](payload)
        version = payload["format_version"]
    if version != FORMAT_VERSION:
        raise CheckpointError(
            f"{path}: checkpoint format version {version}, this code reads version "
            f"{FORMAT_VERSION}; use the matching release of captioning"
        )
    for key in REQUIRED_KEYS:
        if key not in payload:
            raise CheckpointError(f"{path}: checkpoint is missing the key {key!r}")
    _check_contents(payload, path)
    return payload


def _check_contents(payload: dict[str, Any], path: Path) -> None:
    """The types of what every reader uses: the config, the vocabulary, the weights and the
    counters."""
    problem = None
    vocab = payload["vocab"]
    if not isinstance(payload["config"], dict):
        problem = "its config is not a mapping"
    elif not isinstance(vocab, list | tuple) or not all(isinstance(w, str) for w in vocab):
        problem = "its vocabulary is not a list of words"
    elif not isinstance(payload["model"], dict) or not all(
        isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in payload["model"].items()
    ):
        problem = "its model is not a mapping of parameter names to tensors"
    elif not all(isinstance(payload[k], int) and payload[k] >= 0 for k in ("epoch", "step")):
        problem = "its epoch and step are not counts"
    if problem:
        raise CheckpointError(f"{path}: not a usable captioning checkpoint ({problem})")


def _upgrade_from_version_1(payload: dict[str, Any]) -> dict[str, Any]:
    """A version-1 checkpoint in the version-2 schema (renamed keys, ``rng`` a list)."""
    payload = dict(payload)
    if isinstance(payload.get("config"), dict):
        payload["config"] = rename_legacy_keys(payload["config"])
    ranks = payload.pop("rng_ranks", None)
    if isinstance(payload.get("rng"), dict):
        payload["rng"] = list(ranks) if ranks else [payload["rng"]]
    payload["format_version"] = 2
    return payload


def _upgrade_from_version_2(payload: dict[str, Any]) -> dict[str, Any]:
    """A version-2 checkpoint in the version-3 schema: the baseline moves into the
    objective's state."""
    payload = dict(payload)
    baseline = payload.pop("baseline", None)
    payload["objective"] = {"baseline": baseline} if isinstance(baseline, dict) else {}
    payload["format_version"] = 3
    return payload


def _upgrade_from_version_3(payload: dict[str, Any]) -> dict[str, Any]:
    """A version-3 checkpoint in the version-4 schema: its small CNN had plain blocks."""
    payload = dict(payload)
    config = payload.get("config")
    if isinstance(config, dict) and isinstance(config.get("model"), dict):
        payload["config"] = {**config, "model": {"cnn_residual": False, **config["model"]}}
    payload["format_version"] = 4
    return payload


def _upgrade_from_version_4(payload: dict[str, Any]) -> dict[str, Any]:
    """A version-4 checkpoint in the version-5 schema: ``cnn_residual`` names the block."""
    payload = dict(payload)
    config = payload.get("config")
    if isinstance(config, dict) and isinstance(config.get("model"), dict):
        model = dict(config["model"])
        residual = model.pop("cnn_residual", True)
        model.setdefault("cnn_block", "residual" if residual else "plain")
        payload["config"] = {**config, "model": model}
    payload["format_version"] = 5
    return payload


def rng_state() -> dict[str, Any]:
    """Python, NumPy and torch RNG states as plain data."""
    py_version, py_state, py_gauss = random.getstate()
    np_state = np.random.get_state()
    state = {
        "python": [py_version, list(py_state), py_gauss],
        "numpy": [np_state[0], torch.from_numpy(np_state[1].astype(np.int64)), *np_state[2:]],
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore what :func:`rng_state` saved."""
    py_version, py_state, py_gauss = state["python"]
    random.setstate((py_version, tuple(py_state), py_gauss))
    name, keys, *rest = state["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), *rest))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
