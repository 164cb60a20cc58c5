"""The index of every results file: how many rows it holds and the commands that made them,
so that any committed result can be re-run from one line."""

from __future__ import annotations

from tools.tables.common import Rows, header

SHOWN = 4  # distinct commands listed per file


def results_index(files: Rows) -> str:
    """One line per ``results/*.json`` (``files``: ``{"file": NAME, "rows": [...]}``): the
    rows, the commits, and the distinct commands that wrote them, most used first."""
    lines = header("results file | rows | commands that made them (most rows first)")
    for entry in files:
        counts: dict[str, int] = {}
        for row in entry["rows"]:
            command = row.get("study") or row.get("command")
            if command:
                counts[command] = counts.get(command, 0) + 1
        ranked = sorted(counts.items(), key=lambda kv: -kv[1])
        shown = "<br>".join(f"`{c}` ({n})" for c, n in ranked[:SHOWN])
        if len(ranked) > SHOWN:
            shown += f"<br>and {len(ranked) - SHOWN} more, each row with its own"
        lines.append(
            f"| [`results/{entry['file']}.json`](../results/{entry['file']}.json) | "
            f"{len(entry['rows'])} | {shown or '–'} |"
        )
    return "\n".join(lines) + "\n"
