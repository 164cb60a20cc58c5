"""The README and docs/ say where things are truthfully: every relative link and anchor leads
somewhere, and the layer table of docs/layout.md is the package's import graph."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.test_structure import import_graph

ROOT = Path(__file__).resolve().parents[1]
_FENCE = re.compile(r"^```.*?^```", re.S | re.M)
_CODE = re.compile(r"`[^`\n]*`")
_LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
_HEADING = re.compile(r"^#{1,6} +(.+?) *#*$", re.M)
_TOP = "captioning|configs|tools|benchmarks|tests|results"
_PATH = re.compile(rf"(?<![\w/.])((?:{_TOP})/[\w./-]*\w/?)")


def documents(root: Path = ROOT) -> list[Path]:
    return [root / "README.md", *sorted((root / "docs").glob("*.md"))]


def anchors(path: Path) -> set[str]:
    """The anchors GitHub gives the headings of a Markdown file: lower case, punctuation
    dropped, spaces as hyphens, a repeated one numbered."""
    seen: dict[str, int] = {}
    out = set()
    for heading in _HEADING.findall(_FENCE.sub("", path.read_text(encoding="utf-8"))):
        text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link keeps its text
        slug = re.sub(r"[^\w\- ]", "", text.lower()).replace(" ", "-")
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        out.add(slug if count == 0 else f"{slug}-{count}")
    return out


def broken_links(path: Path) -> list[str]:
    """Each relative link of ``path`` (outside code) whose file or anchor does not exist."""
    text = _CODE.sub("", _FENCE.sub("", path.read_text(encoding="utf-8")))
    broken = []
    for target in _LINK.findall(text):
        if re.match(r"[a-z]+:", target):  # https:, mailto:
            continue
        file_part, _, anchor = target.partition("#")
        linked = (path.parent / file_part).resolve() if file_part else path
        if not linked.exists():
            broken.append(f"{path.name}: {target} (no such file)")
        elif anchor and linked.suffix == ".md" and anchor not in anchors(linked):
            broken.append(f"{path.name}: {target} (no such heading)")
    return broken


def test_every_relative_link_in_the_readme_and_docs_resolves() -> None:
    paths = documents()
    assert len(paths) > 5
    broken = [problem for path in paths for problem in broken_links(path)]
    assert not broken, "\n".join(broken)


def test_the_readme_is_a_front_door() -> None:
    lines = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
    assert len(lines) <= 400, f"README.md has {len(lines)} lines; move detail into docs/"
    assert any("make test" in line for line in lines)  # CI runs what the README says


def test_a_broken_link_or_anchor_is_found(tmp_path: Path) -> None:
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.md").write_text("# Title\n\n## Two words (`x.py`)\n\n## Title\n")
    (tmp_path / "README.md").write_text(
        "[ok](docs/a.md) [ok](docs/a.md#two-words-xpy) [ok](docs/a.md#title-1) [ok](#top)\n"
        "# Top\n[web](https://example.org/x) `[code](nowhere.md)`\n"
        "```\n[fenced](nowhere.md)\n```\n"
        "[gone](docs/b.md) [no heading](docs/a.md#three) ![img](docs/missing.png)\n"
    )
    assert broken_links(tmp_path / "README.md") == [
        "README.md: docs/b.md (no such file)",
        "README.md: docs/a.md#three (no such heading)",
        "README.md: docs/missing.png (no such file)",
    ]


def layer_rows(text: str) -> list[list[str]]:
    """The modules named in each row of the table between ``<!-- layers -->`` markers, as
    dotted names (``models/`` is ``captioning.models``)."""
    table = text.split("<!-- layers -->\n")[1].split("<!-- end layers -->")[0]
    rows = []
    for line in table.splitlines()[2:]:
        first = line.split("|")[1]
        names = re.findall(r"`([\w/]+?)(?:\.py|/)`", first)
        rows.append([f"captioning.{name.replace('/', '.')}" for name in names])
    return rows


def _within(module: str, name: str) -> bool:
    """``module`` is ``name`` or lies in the package ``name``."""
    return module == name or module.startswith(name + ".")


def _row_of(module: str, rows: list[list[str]]) -> int | None:
    """The row that names ``module`` or the package that holds it."""
    for index, names in enumerate(rows):
        if any(_within(module, name) for name in names):
            return index
    return None


def layer_violations(rows: list[list[str]], graph: dict[str, set[str]]) -> list[str]:
    """Modules missing from the table, names of the table that are no module, and imports of a
    module from its own row or below."""
    problems = [
        f"{name} names no module of the package"
        for names in rows
        for name in names
        if not any(_within(module, name) for module in graph)
    ]
    for module in sorted(graph):
        if module == "captioning":  # the package root: a lazy door to api.py
            continue
        row = _row_of(module, rows)
        if row is None:
            problems.append(f"{module} is in no row of the layer table")
            continue
        for target in sorted(graph[module]):
            target_row = _row_of(target, rows)
            same_package = any(_within(module, n) and _within(target, n) for n in rows[row])
            if target_row is not None and target_row >= row and not same_package:
                problems.append(f"{module} (row {row + 1}) imports {target} (row {target_row + 1})")
    return problems


def test_the_layer_table_matches_the_import_graph() -> None:
    rows = layer_rows((ROOT / "docs" / "layout.md").read_text(encoding="utf-8"))
    assert len(rows) > 5 and all(rows)
    problems = layer_violations(rows, import_graph())
    assert not problems, "docs/layout.md: " + "; ".join(problems)


def test_a_wrong_layer_table_is_caught() -> None:
    text = "<!-- layers -->\n| modules | hold |\n| --- | --- |\n| `a.py` | x |\n| `b/` | y |\n"
    rows = layer_rows(text + "<!-- end layers -->\n")
    assert rows == [["captioning.a"], ["captioning.b"]]
    graph = {"captioning.a": set(), "captioning.b.c": {"captioning.a", "captioning.b.d"}}
    graph["captioning.b.d"] = set()
    assert layer_violations(rows, graph) == []  # downwards, and inside its own package
    graph["captioning.a"] = {"captioning.b.d"}
    graph["captioning.e"] = set()
    assert layer_violations(rows + [["captioning.gone"]], graph) == [
        "captioning.gone names no module of the package",
        "captioning.a (row 1) imports captioning.b.d (row 2)",
        "captioning.e is in no row of the layer table",
    ]


@pytest.mark.parametrize("path", documents(), ids=lambda p: p.name)
def test_paths_named_in_code_spans_exist(path: Path) -> None:
    """Every ``captioning/...``, ``configs/...``, ``tools/...``, ``benchmarks/...``,
    ``tests/...`` or ``results/...`` path in a code span names a file or folder of the
    checkout."""
    spans = _CODE.findall(_FENCE.sub("", path.read_text(encoding="utf-8")))
    named = {m for span in spans for m in re.findall(_PATH, span)}
    missing = sorted(p for p in named if not (ROOT / p).exists())
    assert not missing, f"{path.name} names paths that do not exist: {missing}"
