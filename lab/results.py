"""Rows of a results file: read them, merge new ones in by key, and refuse to replace a row
with one made under other settings.

A row's **settings** (:func:`settings_of`) are what it learnt or measured under: its
``config``, its ``overrides`` less the plumbing (:data:`PLUMBING`: seed, threads, quiet,
device, paths, figures), its ``precision`` and its ``epochs``. Two rows are compared only on
the fields both have, so a row written before a field existed does not block a re-run. The
key says which row a new one replaces (a study's member, seed, ...); the settings say
whether it may: :func:`write_results` replaces a row of other settings only when asked
(``--replace``), and writes the file atomically, so an interrupted write leaves the previous
file whole.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Hashable
from pathlib import Path
from typing import Any

from captioning.errors import CaptioningError
from captioning.files import write_atomically

Row = dict[str, Any]
Key = Callable[[Row], Hashable]

# overrides that say where and how fast a run ran, not what it learnt: left out of settings
PLUMBING = (
    "train.seed",
    "train.threads",
    "train.quiet",
    "train.device",
    "train.log_every",
    "train.figure_every_epoch",
    "data.root",
    "model.weights",
)
SETTINGS_FIELDS = ("config", "overrides", "precision", "epochs")


class ResultsError(CaptioningError):
    """A results file that cannot be read, or a row it must not take (one-line message)."""


def read_rows(path: Path) -> list[Row]:
    """The rows of the results file ``path``; none if it is absent."""
    if not path.is_file():
        return []
    try:
        rows = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ResultsError(f"{path} is not a results file (a JSON list of rows): {exc}") from None
    if not isinstance(rows, list):
        raise ResultsError(f"{path} is not a results file (a JSON list of rows)")
    return rows


def merge_rows(earlier: list[Row], rows: list[Row], key: Key) -> list[Row]:
    """``earlier`` rows less those that ``rows`` replace (the same ``key``), followed by
    ``rows``: a study runs in pieces and re-runs a row without losing the others."""
    new = {key(r) for r in rows}
    return [r for r in earlier if key(r) not in new] + rows


def _setting(override: str) -> bool:
    return override.split("=", 1)[0].strip() not in PLUMBING


def settings_of(row: Row) -> dict[str, Any]:
    """The fingerprint of what ``row`` was made under (see the module's docstring): the
    fields of :data:`SETTINGS_FIELDS` it has, its overrides sorted and without plumbing."""
    found = {name: row[name] for name in SETTINGS_FIELDS if name in row}
    if isinstance(found.get("overrides"), list):
        found["overrides"] = sorted(o for o in found["overrides"] if _setting(str(o)))
    return found


def differing(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """The names of the settings both fingerprints have and disagree on."""
    return [name for name in old if name in new and old[name] != new[name]]


def write_results(
    path: Path,
    rows: list[Row],
    key: Key,
    *,
    replace: bool = False,
    settings: Callable[[Row], dict[str, Any]] = settings_of,
    order: Callable[[list[Row], list[Row]], list[Row]] | None = None,
) -> list[Row]:
    """Merge ``rows`` into the results file ``path`` by ``key`` and return what it holds.

    Args:
        path: the file, a JSON list of rows (made when absent).
        rows: the rows to write; each replaces the file's row of the same key.
        key: a row's identity in the file.
        replace: also replace a row whose ``settings`` differ (the ``--replace`` flag).
        settings: a row's fingerprint (default :func:`settings_of`).
        order: sorts the merged rows, given the file's rows before and the merged ones
            (default: the file's rows in their order, then the new rows).

    Raises:
        ResultsError: in one line, naming the key and the settings, when a row would replace
            one made under other settings and ``replace`` is false; the file is untouched.
    """
    earlier = read_rows(path)
    if not replace:
        new = {key(r): settings(r) for r in rows}
        for row in earlier:
            k = key(row)
            if k in new and (changed := differing(settings(row), new[k])):
                raise ResultsError(
                    f"{path} holds row {k} made with other {', '.join(changed)}; re-run with "
                    f"--replace to replace it, or write to another --results file"
                )
    merged = merge_rows(earlier, rows, key)
    if order is not None:
        merged = order(earlier, merged)
    write_atomically(path, json.dumps(merged, indent=1, ensure_ascii=False) + "\n")
    return merged
