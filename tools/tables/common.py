"""What every table shares: score formatting, Markdown lines, and the provenance note.

The note under a table says, for the rows it shows, the precision, the device (CPU model or
GPU name) with its threads, whether the rows were timed alone, and the commits (``+dirty``
when the checkout had changes). Rows written by older benchmarks keep some of this under
other keys (``cpu``, ``cores``, ``machine``, ``train_threads``, ``decoding``): the keys
``precision``, ``device``, ``threads``, ``timed_alone`` and ``commit`` are read first and the
older ones after them; a field that no row holds reads "not recorded".
"""

from __future__ import annotations

import re
import statistics
from pathlib import PurePosixPath
from typing import Any

from lab import ROOT

Row = dict[str, Any]
Rows = list[Row]

SHARED = ROOT.parent / "shared"  # the project's shared data and weights, beside the checkout
NOT_RECORDED = "not recorded"

# overrides of paths, the model, the seed and the thread count: not what a lever changes
PLUMBING = (
    "data.root=",
    "model.weights=",
    "model.attention=",
    "train.seed=",
    "train.threads=",
    "train.quiet=",
)

# device values that name a kind of device, not a model: the row's CPU model is used instead
_DEVICE_KINDS = {"cpu", "cuda", "gpu", "mps"}
# an absolute path in a command: a "/" that does not continue a word, a relative path or a
# ``{seed}`` template
_ABSOLUTE = re.compile(r"(?<![\w.~/:}\]-])/[^\s'\"`;,)]+")


def line(cells: list[str]) -> str:
    """One Markdown table line of ``cells``."""
    return "| " + " | ".join(cells) + " |"


def header(names: list[str] | str) -> list[str]:
    """A Markdown table's head line and its rule line; ``names`` a list, or one string of
    them joined by `` | ``."""
    if isinstance(names, str):
        names = names.split(" | ")
    return [line(names), line(["---"] * len(names))]


def spread(values: list[float | None], digits: int = 3) -> str:
    """Mean, and the standard deviation where there are several values; missing values
    (None) are left out, and none at all is –."""
    present = [v for v in values if v is not None]
    if not present:
        return "–"
    if len(present) == 1:
        return f"{present[0]:.{digits}f}"
    return f"{statistics.mean(present):.{digits}f} ± {statistics.stdev(present):.{digits}f}"


def score(value: float | None) -> str:
    """A score with three decimals, or – where there is none."""
    return "–" if value is None else f"{value:.3f}"


def mean(values: list[float | None]) -> float | None:
    """The mean of the values present, None if there are none."""
    present = [v for v in values if v is not None]
    return statistics.mean(present) if present else None


def short(commit: str) -> str:
    """A commit's first 7 characters, marked ``+dirty`` when the checkout had changes."""
    return commit[:7] + ("+dirty" if commit.endswith("+dirty") else "")


def _machine(row: Row) -> dict[str, Any]:
    machine = row.get("machine")
    return machine if isinstance(machine, dict) else {}


def _recorded(value: Any) -> bool:
    # rewritten rows say "not recorded" for what their run did not write down
    return value is not None and value != NOT_RECORDED


def _first(row: Row, *keys: str) -> Any:
    """The first of ``keys`` that the row or its ``machine`` holds, else None."""
    for key in keys:
        for holder in (row, _machine(row)):
            if _recorded(holder.get(key)):
                return holder[key]
    return None


def precision_of(row: Row) -> str | None:
    """The row's precision: its own key, else its decoding's or its settings'."""
    for holder in (row, row.get("decoding"), row.get("settings")):
        if isinstance(holder, dict) and _recorded(holder.get("precision")):
            return str(holder["precision"])
    return None


def device_of(row: Row) -> str | None:
    """The CPU model or GPU name that made the row; a device kind alone (``cpu``) gives way
    to the row's CPU model."""
    for holder in (row, _machine(row)):
        device = holder.get("device")
        if _recorded(device) and str(device).strip().lower() not in _DEVICE_KINDS:
            return device
    cpu = _first(row, "cpu")
    if cpu is not None:
        return str(cpu)
    device = _first(row, "device")
    if device is not None and str(device).lower() != "cpu":
        return "a GPU (name not recorded)"
    return None


def threads_of(row: Row) -> int | None:
    """The torch threads of the run that made the row."""
    return _first(row, "threads", "train_threads")


def machines(rows: Rows) -> str:
    """The devices that made ``rows``, each once with its cores (a CPU's) and the threads
    its rows used: ``AMD EPYC (2 cores, 1 or 2 threads) and NVIDIA H100 80GB HBM3
    (2 threads)``."""
    devices: dict[str, Rows] = {}
    for row in rows:
        device = device_of(row)
        if device is not None:
            devices.setdefault(device, []).append(row)
    if not devices:
        return f"device {NOT_RECORDED}"
    described = []
    for device, group in sorted(devices.items()):
        cores = sorted({_first(r, "cores") for r in group if device == _first(r, "cpu")} - {None})
        details = [f"{' or '.join(str(c) for c in cores)} cores"] if cores else []
        details.append(threads(group))
        described.append(f"{device} ({', '.join(details)})")
    return " and ".join(described)


def hosts(rows: Rows) -> str:
    """The CPUs that made ``rows``, each once, after their core counts:
    ``2 cores (AMD EPYC; Intel Xeon)``; GPU names join the CPUs'."""
    cores = sorted({str(c) for c in (_first(r, "cores") for r in rows) if c is not None})
    names = sorted({d for d in (device_of(r) for r in rows) if d is not None})
    listed = "; ".join(names) if names else f"device {NOT_RECORDED}"
    return f"{' or '.join(cores)} cores ({listed})" if cores else listed


def threads(rows: Rows) -> str:
    """The thread counts of ``rows``: ``1 thread``, ``1 or 2 threads``, and for how many
    rows they were not recorded."""
    found = [t for t in (threads_of(r) for r in rows) if t is not None]
    if not found:
        return f"threads {NOT_RECORDED}"
    counts = sorted(set(found))
    text = f"{' or '.join(str(c) for c in counts)} thread{'' if counts == [1] else 's'}"
    missing = len(rows) - len(found)
    return text + (f", {NOT_RECORDED} for {missing} of {len(rows)} rows" if missing else "")


def precisions(rows: Rows) -> str:
    """The precisions of ``rows``, each once: ``bf16, fp32``."""
    found = sorted({p for p in (precision_of(r) for r in rows) if p is not None})
    return ", ".join(found) if found else NOT_RECORDED


def commits(rows: Rows) -> str:
    """The commits of ``rows``, each once, with their ``+dirty`` mark."""
    found = sorted({short(r["commit"]) for r in rows if _recorded(r.get("commit"))})
    return ", ".join(found) if found else NOT_RECORDED


def torch_versions(rows: Rows) -> str:
    """The torch versions that made ``rows``, each once."""
    found = sorted({str(v) for v in (_first(r, "torch") for r in rows) if v is not None})
    return ", ".join(found) if found else NOT_RECORDED


def timed(rows: Rows) -> str:
    """Whether ``rows`` were timed with nothing else on the machine: ``timed alone``,
    ``not timed alone``, or how many of them were."""
    flags = [bool(r["timed_alone"]) for r in rows if _recorded(r.get("timed_alone"))]
    if not flags:
        return f"timed alone: {NOT_RECORDED}"
    missing = len(rows) - len(flags)
    if missing:
        return f"timed alone: {sum(flags)} of {len(rows)} rows, {missing} {NOT_RECORDED}"
    if all(flags):
        return "timed alone"
    if not any(flags):
        return "not timed alone"
    return f"timed alone: {sum(flags)} of {len(rows)} rows"


def provenance(rows: Rows, commit_label: str = "commit", with_timing: bool = True) -> str:
    """Where ``rows`` come from, in one clause: ``precision bf16; on AMD EPYC (2 cores,
    1 thread); timed alone; commit b460301+dirty``. ``commit_label`` names what the commits
    did (``trained at``); ``with_timing`` False leaves out the timing for a note that says
    it in its own words."""
    parts = [f"precision {precisions(rows)}", f"on {machines(rows)}"]
    if with_timing:
        parts.append(timed(rows))
    parts.append(f"{commit_label} {commits(rows)}")
    return "; ".join(parts)


def source_note(rows: Rows, source: str) -> str:
    """A note that names the file of ``rows`` and their provenance."""
    return f"{len(rows)} rows of `results/{source}.json`: {provenance(rows)}."


def _placeholder(path: str, writes: bool) -> str:
    """``path`` with no machine's folders: inside the checkout relative to it, in the shared
    folder ``SHARED/...``, elsewhere ``OUT/NAME`` (written) or ``DATA/NAME`` (read)."""
    pure = PurePosixPath(path)
    for folder, name in ((SHARED, "SHARED"), (ROOT, "")):
        try:
            inside = pure.relative_to(folder.as_posix()).as_posix()
        except ValueError:
            continue
        if not name:
            return inside
        return name if inside == "." else f"{name}/{inside}"
    return f"{'OUT' if writes else 'DATA'}/{pure.name}"


def portable(command: str) -> str:
    """``command`` with every absolute path replaced by a placeholder (see
    :func:`_placeholder`), so that a doc never names a machine's folders; the path after
    ``--out`` or ``--results`` is what the command writes."""

    def replace(match: re.Match) -> str:
        writes = re.search(r"--(out|results)[= ]$", command[: match.start()]) is not None
        return _placeholder(match.group(0), writes)

    return _ABSOLUTE.sub(replace, command)


def commands(rows: Rows, key: str = "command", ordered: bool = False) -> str:
    """The rows' commands, each once in backticks with no machine's paths, joined by ``; ``:
    sorted, or in the rows' order when ``ordered``."""
    found = [portable(r[key]) for r in rows if r.get(key)]
    unique = list(dict.fromkeys(found)) if ordered else sorted(set(found))
    return "; ".join(f"`{c}`" for c in unique)
