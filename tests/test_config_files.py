"""The shipped recipes in configs/: each loads, and none copies another's settings.

A recipe that shares settings with another names it as its ``base:`` (a second stage its first
stage, a variant what it varies, several recipes a ``base_*.yaml`` that is not a recipe
itself), so a change to the shared settings is made in one file.
"""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import pytest
import yaml

from captioning.config import BASE_KEY, config_to_dict, load_config, read_yaml

CONFIGS = Path(__file__).resolve().parent.parent / "configs"
PATHS = sorted(CONFIGS.glob("*.yaml"))


def own_sections(path: Path) -> dict[str, Any]:
    """The sections a config file itself holds, its ``base:`` key left out."""
    values = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    values.pop(BASE_KEY, None)
    return {name: body or {} for name, body in values.items()}


def bases_of(path: Path) -> list[Path]:
    """The files a config names as its bases (one, a list, or none)."""
    bases = (yaml.safe_load(path.read_text(encoding="utf-8")) or {}).get(BASE_KEY) or []
    return [
        (path.parent / base).resolve() for base in ([bases] if isinstance(bases, str) else bases)
    ]


def chain_above(path: Path) -> dict[str, Any]:
    """What a config's bases give it, merged in order (the file's own sections left out)."""
    given: dict[str, Any] = {}
    for base in bases_of(path):
        for name, body in read_yaml(base).items():
            given.setdefault(name, {}).update(body)
    return given


@pytest.mark.parametrize("path", PATHS, ids=lambda p: p.name)
def test_every_shipped_config_loads(path: Path) -> None:
    # Loading follows the whole base chain, which read_yaml refuses when it comes back to a
    # file (tests/test_config.py), so this also finds a cycle among the shipped configs.
    load_config(path)


def test_a_base_file_says_it_is_no_recipe_and_has_a_recipe() -> None:
    bases = {p.resolve() for p in PATHS if p.name.startswith("base_")}
    assert bases, "no base_*.yaml shipped"
    named = {base for p in PATHS for base in bases_of(p)}
    for path in bases:
        first = path.read_text(encoding="utf-8").splitlines()[0]
        assert first.startswith("# A base, not a recipe"), f"{path.name}: {first!r}"
        assert path in named, f"no config names {path.name} as its base"


def test_no_two_configs_hold_the_same_section() -> None:
    # A section of one setting is the change a variant makes (model.attention: hard), which
    # variants of different recipes share; two settings or more are a copy.
    sections = {p.name: own_sections(p) for p in PATHS}
    for (a, ours), (b, theirs) in itertools.combinations(sections.items(), 2):
        for name in ours.keys() & theirs.keys():
            assert not (len(ours[name]) > 1 and ours[name] == theirs[name]), (
                f"{a} and {b} hold the same {name} section; move it into a base both extend"
            )


def test_no_config_repeats_settings_its_base_chain_gives() -> None:
    for path in PATHS:
        given = chain_above(path)  # the whole chain above the file, merged
        for name, body in own_sections(path).items():
            repeated = [
                k for k, v in body.items() if k in given.get(name, {}) and given[name][k] == v
            ]
            assert len(repeated) < 2, f"{path.name} repeats its base chain's {name}.{repeated}"


def test_a_second_stage_keeps_its_first_stages_model() -> None:
    # --init refuses a checkpoint of another architecture, so a self-critical stage takes its
    # model section from the cross-entropy stage it extends.
    stages = [
        p
        for p in PATHS
        if not p.name.startswith("base_") and load_config(p).train.objective == "scst"
    ]
    assert len(stages) >= 4, "the self-critical stages are not found"
    for path in stages:
        bases = bases_of(path)
        assert bases, f"{path.name} names no first stage (base:)"
        if (
            bases[0] in stages
        ):  # a variant of another stage (flickr8k_best_scst): tests/test_config.py
            continue
        first = config_to_dict(load_config(bases[0]))  # the first stage comes first
        assert config_to_dict(load_config(path))["model"] == first["model"], path.name
