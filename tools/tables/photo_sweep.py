"""The photo sweeps' tables (rows of ``tools/photo_sweep.py``): the recipe's levers and
self-critical training (``results/photo_sweep.json``), the recipe cut to a 10-minute budget
(``results/photo_budget.json``), and the attention family on photos."""

from __future__ import annotations

import statistics
from typing import Any

from tools.tables.common import PLUMBING, Rows, commands, line, provenance, spread


def _sweep_groups(rows: Rows) -> tuple[dict[str, Any] | None, dict[str, Rows]]:
    """The sweep's nearest-neighbour row, and its other rows by job name, seeds in order."""
    nn = next((r for r in rows if r["name"] == "nn"), None)
    groups: dict[str, Rows] = {}
    for row in sorted((r for r in rows if r["name"] != "nn"), key=lambda r: r["seed"]):
        groups.setdefault(row["name"], []).append(row)
    return nn, groups


def _sweep_line(name: str, group: Rows, setting: str, nn: float | None) -> str:
    test = [r["test_CIDEr_beam3"] for r in group]
    each = ", ".join(f"{t:.3f} ({r['seed']})" for t, r in zip(test, group))
    above = "–" if nn is None else f"{sum(t > nn for t in test)} of {len(test)}"
    return line([name, setting, spread([r["val_best"] for r in group]), spread(test), each, above])


def _sweep_note(rows: Rows, nn: dict[str, Any] | None, source: str = "photo_sweep") -> str:
    tokenizers = sorted({r["tokenizer"] for r in rows})
    text = (
        f"{len(rows)} rows of `results/{source}.json`: {provenance(rows)}. Test split of "
        "293 photos, beam 3; seeds in brackets, ± the standard deviation across seeds."
    )
    if nn is not None:
        text += (
            f" The nearest neighbour, on the same grids: test {nn['test_CIDEr_beam3']:.3f} at "
            f"k = {nn['k']} (val {nn['val_CIDEr_by_k'][str(nn['k'])]:.3f})."
        )
    if tokenizers == ["python"]:
        text += (
            " Captions tokenized in Python (no Java on that machine), so scores differ "
            "slightly from `results/photos.json`'s: compare rows within this table."
        )
    return text + f" Commands: {commands(rows)}."


def photo_sweep(rows: Rows, source: str = "photo_sweep") -> str:
    """Cross-entropy levers and self-critical training on the photo recipe
    (``tools/photo_sweep.py``): per job, validation and test CIDEr-D over seeds, and on how
    many seeds the test score beats the nearest neighbour of the same run."""
    rows = [r for r in rows if not r["name"].startswith("family-")]
    nn, groups = _sweep_groups(rows)
    lines = [
        "| run | settings (beyond the recipe) | val CIDEr-D | test CIDEr-D | each seed (test) "
        "| above nn |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    order = sorted(groups, key=lambda n: (groups[n][0]["init"] is not None, n != "recipe", n))
    for name in order:
        group = groups[name]
        changed = [o for o in group[0]["set"] if not o.startswith(PLUMBING)]
        setting = ", ".join(f"`{o}`" for o in changed) or "(the config as it is)"
        if group[0]["init"]:
            setting = f"from `{group[0]['init']}`: " + setting
        lines.append(_sweep_line(name, group, setting, nn and nn["test_CIDEr_beam3"]))
    return "\n".join([*lines, "", _sweep_note(rows, nn, source)]) + "\n"


def photo_budget(rows: Rows) -> str:
    """The photo recipe cut to the 10-minute budget on a 2-core CPU
    (``tools/photo_sweeps/budget.json``), in the form of :func:`photo_sweep`."""
    return photo_sweep(rows, "photo_budget")


def photo_family(rows: Rows) -> str:
    """The attention family on the photo recipe (``tools/photo_sweep.py`` with
    ``tools/photo_sweeps/family.json``), the recipe's additive score (``recipe``) among them,
    best test mean first."""
    nn, groups = _sweep_groups(rows)
    members = {n: g for n, g in groups.items() if n.startswith("family-") or n == "recipe"}
    lines = [
        "| member | settings | val CIDEr-D | test CIDEr-D | each seed (test) | above nn |",
        "| --- | --- | --- | --- | --- | --- |",
    ]

    def mean_test(name: str) -> float:
        return statistics.mean(r["test_CIDEr_beam3"] for r in members[name])

    for name in sorted(members, key=lambda n: -mean_test(n)):
        group = members[name]
        setting = ", ".join(f"`{o}`" for o in group[0]["set"]) or "(additive, the recipe)"
        label = "soft" if name == "recipe" else name.removeprefix("family-")
        lines.append(_sweep_line(label, group, setting, nn and nn["test_CIDEr_beam3"]))
    used = [r for n in members for r in members[n]] + ([nn] if nn else [])
    return "\n".join([*lines, "", _sweep_note(used, nn)]) + "\n"
