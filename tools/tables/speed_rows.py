"""What the speed page's tables share: the rows of one benchmark, and the line under each
table that says where its rows came from."""

from __future__ import annotations

from tools.tables.common import Rows, commands, provenance, torch_versions


def of_kind(rows: Rows, kind: str) -> Rows:
    """The rows one benchmark wrote (its ``kind``)."""
    return [r for r in rows if r.get("kind") == kind]


def by_host_and_size(rows: Rows, kind: str) -> Rows:
    """The rows one benchmark wrote, by host, then the COCO size first, then size and
    precision."""
    return sorted(
        of_kind(rows, kind),
        key=lambda r: (r["device"], r["size"] != "coco", r["size"], r["precision"]),
    )


def speed_provenance(rows: Rows, what: str) -> str:
    """One line: where the rows came from (machine, precision, timing, commits, commands)."""
    flags = [r.get("timed_alone") for r in rows]
    if not all(
        isinstance(f, bool) for f in flags
    ):  # the note's timing says how many rows recorded it
        where = f": {provenance(rows)}"
    else:
        alone = "an otherwise idle machine" if all(flags) else "a machine doing other work too"
        where = f", on {alone}: {provenance(rows, with_timing=False)}"
    return (
        f"{len(rows)} {what} rows of `results/speed.json`{where}; torch "
        f"{torch_versions(rows)}. Made by {commands(rows)}."
    )


def seconds_cell(value: float | None) -> str:
    """A time for a table's cell: 3 significant digits, or a dash when there is none."""
    if value is None:
        return "–"
    return f"{value:.3g} s"
