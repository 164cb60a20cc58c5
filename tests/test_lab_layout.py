"""The lab (``benchmarks/``, ``tools/`` and their library ``lab/``) is a set of modules run
as ``python -m NAME``: no script edits ``sys.path`` to find the repository, none outgrows 400
lines, and the run instructions in the README, the docs, the Makefile and the lab itself give
the module form."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MAX_LINES = 400
FORBIDDEN = "sys." + "path"  # spelt apart so that this file does not name it
# `python tools/x.py`, `python benchmarks/x.py`: a script form (spelt apart, as above)
SCRIPT_FORM = re.compile(r"python3? (?:tools|benchmarks)" + "/")


def _lab(folder: str) -> list[Path]:
    files = sorted((ROOT / folder).rglob("*.py"))
    assert files
    return files


def _name(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


@pytest.mark.parametrize("folder", ["benchmarks", "tools", "lab"])
def test_no_lab_module_edits_sys_path(folder: str):
    offenders = [_name(f) for f in _lab(folder) if FORBIDDEN in f.read_text(encoding="utf-8")]
    assert not offenders, f"{FORBIDDEN} edited in {', '.join(offenders)}: run them with python -m"


@pytest.mark.parametrize("folder", ["benchmarks", "tools", "lab"])
def test_no_lab_module_exceeds_400_lines(folder: str):
    long = {
        _name(f): n
        for f in _lab(folder)
        if (n := len(f.read_text(encoding="utf-8").splitlines())) > MAX_LINES
    }
    assert not long, f"over {MAX_LINES} lines: {long}"


def test_run_instructions_give_the_module_form():
    prose = [ROOT / "README.md", ROOT / "Makefile", *sorted((ROOT / "docs").glob("*.md"))]
    files = [
        *prose,
        *_lab("benchmarks"),
        *_lab("tools"),
        *_lab("lab"),
        *sorted(ROOT.glob("notebooks/*.ipynb")),
    ]
    offenders = [
        f"{_name(f)}:{number}"
        for f in files
        if f.is_file()
        for number, line in enumerate(f.read_text(encoding="utf-8").splitlines(), 1)
        if SCRIPT_FORM.search(line)
    ]
    assert not offenders, f"run the lab as python -m tools.NAME / benchmarks.NAME: {offenders}"
