"""The configuration reference, docs/config.md, generated from captioning/config.py.

    python -m tools.config_reference            # rewrite docs/config.md
    python -m tools.config_reference --check    # exit 1 when docs/config.md is out of date

Every key of every section of ``Config``: its type, its default, its range (from the table
``_RANGES`` that the config checks) and what the source says of it. What a key means is read
from the comments in ``config.py``:

- the comment block right above a key and the comment beside it describe that key;
- the first line of a comment block, when it is at most three plain lower-case words
  (``# encoder``), is a group heading instead, printed as a row of its own above the keys
  that follow it.

A section's docstring opens its table. Nothing in docs/config.md is typed by hand: change the
comment in config.py, then run this script.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import io
import re
import sys
import textwrap
import tokenize
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from lab import ROOT

TARGET = ROOT / "docs" / "config.md"
SOURCE = "captioning/config.py"
_HEADING = re.compile(r"[a-z]+( [a-z]+){0,2}")
_TOOL_COMMENT = re.compile(r"(fmt|noqa|type|pragma)\b")


@dataclass
class Key:
    """One config key as the source states it.

    Args:
        name: the field's name.
        headings: group headings printed above it (comment lines such as ``# encoder``).
        above: the comment block right above it, its lines joined.
        beside: the comment on its own line(s).
    """

    name: str
    headings: list[str] = field(default_factory=list)
    above: str = ""
    beside: str = ""

    @property
    def meaning(self) -> str:
        return " ".join(part for part in (self.above, self.beside) if part)


def _comments(source: str) -> tuple[dict[int, str], set[int]]:
    """Comment text per line number of ``source``, and the lines that hold only a comment."""
    text: dict[int, str] = {}
    alone: set[int] = set()
    lines = source.splitlines()
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type != tokenize.COMMENT:
            continue
        body = token.string.lstrip("#").strip()
        if _TOOL_COMMENT.match(body):
            continue
        row, col = token.start
        text[row] = body
        if not lines[row - 1][:col].strip():
            alone.add(row)
    return text, alone


def read_keys(cls: type) -> list[Key]:
    """The fields of dataclass ``cls`` in source order, with their comments."""
    source = textwrap.dedent(inspect.getsource(cls))
    comments, alone = _comments(source)
    class_node = ast.parse(source).body[0]
    keys, previous_end = [], class_node.lineno  # the class line (decorators come before it)
    for node in class_node.body:
        if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
            previous_end = node.end_lineno
            continue
        key = Key(node.target.id)
        above = []
        for row in range(previous_end + 1, node.lineno):
            if row not in alone:
                continue
            if row - 1 not in alone and _HEADING.fullmatch(comments[row]):
                key.headings.append(comments[row])
            else:
                above.append(comments[row])
        key.above = " ".join(above)
        key.beside = " ".join(
            comments[row]
            for row in range(node.lineno, node.end_lineno + 1)
            if row in comments and row not in alone
        )
        keys.append(key)
        previous_end = node.end_lineno
    return keys


def type_name(tp: Any) -> str:
    """A type annotation as a reader of YAML needs it: ``int | null``, ``'coco' | 'karpathy'``."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is Literal:
        return " | ".join(f"'{a}'" for a in args)
    if origin in (typing.Union, types.UnionType):
        return " | ".join(type_name(a) for a in args)
    if origin in (list, dict):
        return f"{origin.__name__}[{', '.join(type_name(a) for a in args)}]"
    if tp is type(None):
        return "null"
    return getattr(tp, "__name__", str(tp))


def yaml_value(value: Any) -> str:
    """A default as it would be written in a config file."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return value if value else '""'
    if isinstance(value, list):
        return "[" + ", ".join(yaml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {yaml_value(v)}" for k, v in value.items()) + "}"
    return repr(value)


def _cell(text: str) -> str:
    """Text that is safe inside a Markdown table cell."""
    return text.replace("|", "\\|").replace("*", "\\*").replace("<", "&lt;")


def _code(text: str) -> str:
    return "`" + text.replace("|", "\\|") + "`"


def section_table(name: str, cls: type, ranges: dict[str, str]) -> str:
    """The reference table of one section: its docstring, then one row per key."""
    hints = typing.get_type_hints(cls)
    defaults = cls()
    doc = inspect.cleandoc(cls.__doc__ or "").replace("``", "`")  # reST literals to Markdown
    lines = [f"## `{name}`", ""]
    if doc:
        lines += [" ".join(doc.split()), ""]
    lines += ["| key | type | default | range | meaning |", "| --- | --- | --- | --- | --- |"]
    for key in read_keys(cls):
        lines += [f"| **{_cell(h)}** | | | | |" for h in key.headings]
        dotted = f"{name}.{key.name}"
        limits = ranges.get(dotted, "")
        cells = [
            _code(dotted),
            _code(type_name(hints[key.name])),
            _code(yaml_value(getattr(defaults, key.name))),
            limits,
            _cell(key.meaning),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def render(
    config: type | None = None,
    ranges: dict[str, str] | None = None,
    renamed: dict[str, str] | None = None,
    source: str = SOURCE,
) -> str:
    """The whole reference for the config class ``config`` (default: the project's).

    Args:
        config: the top-level dataclass; each of its fields is one section.
        ranges: dotted key -> its range in words (``at least 1``), from ``config._RANGES``.
        renamed: old dotted key -> new one, as ``config.RENAMED_KEYS``.
        source: the path of the file the reference is made from, for its first lines.
    """
    retired: dict[str, str] = {}
    if config is None:
        from captioning import config as module

        config, renamed, retired = module.Config, module.RENAMED_KEYS, module.RETIRED_KEYS
        ranges = {key: module._describe_range(*limits) for key, limits in module._RANGES.items()}
    ranges, renamed = ranges or {}, renamed or {}
    link = "../" + source
    parts = [
        "# Configuration reference\n",
        f"Generated from [`{source}`]({link}) by `python -m tools.config_reference`; a "
        "test checks that it is current, so edit the comments in the source, not this page.\n",
        "A config file holds only what differs from these defaults, or from the config it "
        "extends (a top-level `base: FILE`, relative to the file; bases may have bases), "
        "`--set section.key=value` overrides one key on top, and an unknown key or a value "
        "of the wrong type or out of its range is refused in one line that names the key. "
        "A key whose value is `null` is not range-checked.\n",
    ]
    for section in dataclasses.fields(config):
        parts.append(section_table(section.name, section.default_factory().__class__, ranges))
    if renamed:
        parts.append(
            "## Renamed keys\n\nA config file or `--set` that uses an old name is refused with "
            "the new one; checkpoints written before the change are upgraded when read.\n\n"
            "| old | new |\n| --- | --- |\n"
            + "".join(f"| `{old}` | `{new}` |\n" for old, new in renamed.items())
        )
    if retired:
        parts.append(
            "## Retired keys\n\nKeys replaced by another of a different meaning: a config file "
            "or `--set` that uses one is refused with what to use; checkpoints written before "
            "lose the key when read, and take the new key's default.\n\n"
            "| old | use |\n| --- | --- |\n"
            + "".join(f"| `{old}` | {_cell(use)} |\n" for old, use in retired.items())
        )
    return "\n".join(parts)


def main(argv: list[str] | None = None, target: Path = TARGET) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tools.config_reference", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument(
        "--check", action="store_true", help="change nothing; exit 1 if the file is out of date"
    )
    args = parser.parse_args(argv)
    text = render()
    current = target.read_text(encoding="utf-8") if target.is_file() else None
    if current == text:
        return 0
    if args.check:
        print(f"{target.name}: out of date; run python -m tools.config_reference")
        return 1
    target.write_text(text, encoding="utf-8")
    print(f"{target.name}: rewritten")
    return 0


if __name__ == "__main__":
    sys.exit(main())
