"""Which object category a caption's word names: COCO's 80 categories by their English words.

The map ships with the package as data, ``category_words.json``: one entry per word,
``"puppy": "dog"``, singular and plural forms and common names (``man``, ``women``,
``player`` are ``person``; ``bike`` is ``bicycle``; ``table`` is ``dining table``). A user's
file of the same form (JSON or YAML, word to category) adds words or moves them to another
category, and a word mapped to ``null`` is dropped::

    {"cowboy": "person", "glass": null}

A word the map does not hold names the category of the same name, if any (the shapes
data's ``circle``).
"""

from __future__ import annotations

from collections.abc import Mapping
from functools import cache
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

from captioning.errors import ConfigError

SHIPPED = "category_words.json"
# A map is a few hundred words; a file many times that is not one.
MAX_ENTRIES = 100_000


@cache
def shipped_category_words() -> dict[str, str]:
    """The package's own map of words to COCO categories (read once)."""
    text = resources.files("captioning.metrics").joinpath(SHIPPED).read_text("utf-8")
    return dict(_checked(yaml.safe_load(text), SHIPPED))


def load_category_words(path: str | Path | None = None) -> dict[str, str]:
    """The shipped map, with the entries of the user's file at ``path`` over it (a word
    mapped to null is dropped).

    Raises:
        ConfigError: the file is missing, not JSON or YAML, or not a map of words to
            category names (one line naming the file and the entry).
    """
    words = dict(shipped_category_words())
    if path is None:
        return words
    for word, category in read_category_words(path).items():
        if category is None:
            words.pop(word, None)
        else:
            words[word] = category
    return words


def read_category_words(path: str | Path) -> dict[str, str | None]:
    """A user's file of words to categories, checked; see :func:`load_category_words`."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(
            f"category words file {path} does not exist; give a JSON or YAML "
            "file of word: category entries"
        )
    try:
        values = yaml.safe_load(path.read_bytes())
    except (UnicodeDecodeError, yaml.YAMLError) as exc:
        first = " ".join(str(exc).split())[:160]
        raise ConfigError(
            f"category words file {path} is not JSON or YAML text ({first}); "
            "write one word: category entry a line"
        ) from exc
    return _checked(values, str(path), allow_null=True)


def _checked(values: Any, source: str, allow_null: bool = False) -> dict[str, Any]:
    """``values`` as a map of lower-case single words to category names."""
    if not isinstance(values, dict) or not values:
        raise ConfigError(
            f'category words file {source} must map words to categories, e.g. {{"puppy": "dog"}}'
        )
    if len(values) > MAX_ENTRIES:
        raise ConfigError(
            f"category words file {source} holds more than {MAX_ENTRIES:,} "
            "entries; a map of words is a few hundred"
        )
    checked: dict[str, Any] = {}
    for word, category in values.items():
        if not isinstance(word, str) or not word.strip() or len(word.split()) != 1:
            raise ConfigError(
                f"category words file {source}: {word!r} is not a single word; "
                "each entry maps one word of a caption to a category"
            )
        if category is None and allow_null:
            checked[word.strip().lower()] = None
            continue
        if not isinstance(category, str) or not category.strip():
            hint = " or null to drop the word" if allow_null else ""
            raise ConfigError(
                f"category words file {source}: {word!r} maps to {category!r}; "
                f"give a category name{hint}"
            )
        checked[word.strip().lower()] = category.strip()
    return checked


def category_of(word: str, words: Mapping[str, str], categories: set[str]) -> str | None:
    """The category among ``categories`` that ``word`` names, or None: through ``words``,
    else the category of the word's own name."""
    category = words.get(word.lower(), word.lower())
    return category if category in categories else None


def named_category(word: str, words: Mapping[str, str]) -> str | None:
    """The category ``word`` names in the map (whether or not an image has one), or None."""
    return words.get(word.lower())
