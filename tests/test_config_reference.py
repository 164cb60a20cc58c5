"""docs/config.md is what tools/config_reference.py makes of captioning/config.py, and the
script reads types, defaults and comments the way the source states them."""

from __future__ import annotations

import dataclasses
import importlib.util
import sys
import textwrap
from pathlib import Path

from captioning.config import Config

ROOT = Path(__file__).resolve().parents[1]


def _load(name: str, path: Path):
    """Import the file at ``path`` as module ``name`` (kept in sys.modules: dataclasses and
    typing.get_type_hints resolve a class's annotations through its module)."""
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


def _tool():
    return _load("config_reference", ROOT / "tools" / "config_reference.py")


def test_the_committed_reference_is_current() -> None:
    committed = (ROOT / "docs" / "config.md").read_text(encoding="utf-8")
    assert _tool().render() == committed, (
        "docs/config.md differs from captioning/config.py; run python -m tools.config_reference"
    )


def test_every_key_of_every_section_has_a_row() -> None:
    text = _tool().render()
    for section in dataclasses.fields(Config):
        for key in dataclasses.fields(section.default_factory()):
            assert f"| `{section.name}.{key.name}` |" in text


TOY = '''
from __future__ import annotations
from dataclasses import dataclass, field
from typing import Literal


@dataclass
class PartConfig:
    """A part.

    Second paragraph with ``code``.
    """

    size: int = 3  # cells per side
    # loading
    # how files are read: every line of this block
    # is one description
    mode: Literal["fast", "safe"] = "safe"
    names: dict[str, str] = field(
        default_factory=lambda: {"a": "b"}
    )
    limit: float | None = None  # a | b, at most *two*
    # encoder
    frozen: bool = True


@dataclass
class ToyConfig:
    """The whole toy."""

    part: PartConfig = field(default_factory=PartConfig)
'''


def _toy(tmp_path: Path, monkeypatch):
    path = tmp_path / "toy_config.py"
    path.write_text(textwrap.dedent(TOY))
    monkeypatch.delitem(sys.modules, "toy_config", raising=False)  # removed again afterwards
    return _load("toy_config", path)


def test_comments_above_and_beside_a_key_describe_it(tmp_path: Path, monkeypatch) -> None:
    toy = _toy(tmp_path, monkeypatch)
    tool = _tool()
    keys = {key.name: key for key in tool.read_keys(toy.PartConfig)}
    assert list(keys) == ["size", "mode", "names", "limit", "frozen"]
    assert keys["size"].meaning == "cells per side"
    assert keys["mode"].headings == ["loading"]
    assert keys["mode"].meaning == "how files are read: every line of this block is one description"
    assert keys["names"].meaning == ""  # a tool's comment (fmt: skip) is no description
    assert keys["frozen"].headings == ["encoder"] and keys["frozen"].meaning == ""


def test_a_section_renders_types_defaults_ranges_and_headings(tmp_path: Path, monkeypatch) -> None:
    toy = _toy(tmp_path, monkeypatch)
    text = _toy_render(toy)
    assert "## `part`\n\nA part. Second paragraph with `code`.\n" in text
    rows = text.split("| --- | --- | --- | --- | --- |\n")[1].splitlines()
    assert rows[:6] == [
        "| `part.size` | `int` | `3` | at least 1 | cells per side |",
        "| **loading** | | | | |",
        "| `part.mode` | `'fast' \\| 'safe'` | `safe` |  | how files are read: every line of "
        "this block is one description |",
        "| `part.names` | `dict[str, str]` | `{a: b}` |  |  |",
        "| `part.limit` | `float \\| null` | `null` |  | a \\| b, at most \\*two\\* |",
        "| **encoder** | | | | |",
    ]
    assert rows[6] == "| `part.frozen` | `bool` | `true` |  |  |"
    assert "| `part.old` | `part.size` |" in text


def _toy_render(toy) -> str:
    return _tool().render(
        toy.ToyConfig,
        ranges={"part.size": "at least 1"},
        renamed={"part.old": "part.size"},
        source="toy_config.py",
    )


def test_check_reports_a_stale_file_and_writing_fixes_it(tmp_path: Path, capsys) -> None:
    tool = _tool()
    target = tmp_path / "config.md"
    target.write_text("stale\n")
    assert tool.main(["--check"], target=target) == 1
    assert "out of date" in capsys.readouterr().out
    assert target.read_text() == "stale\n"  # --check changes nothing
    assert tool.main([], target=target) == 0
    assert tool.main(["--check"], target=target) == 0
    assert target.read_text(encoding="utf-8") == tool.render()
