"""benchmarks/photos.py's bookkeeping (the recipe itself is tests/test_photos.py, slow)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import photos


def _row(model: str, seed: int | None, cider: float, variant: str | None = None) -> dict:
    row = {"model": model, "seed": seed, "CIDEr": cider}
    if variant is not None:
        row["variant"] = variant
    return row


def test_merge_keeps_other_variants_and_replaces_the_same_run(tmp_path: Path) -> None:
    path = tmp_path / "results.json"
    earlier = [_row("nn", None, 1.2), _row("soft", 0, 1.1), _row("soft", 0, 1.0, "smooth")]
    path.write_text(json.dumps(earlier))
    merged = photos.merge(path, [_row("soft", 0, 1.3, "smooth"), _row("none", 1, 0.9, "recipe")])
    keys = [(r.get("variant", "recipe"), r["model"], r["seed"], r["CIDEr"]) for r in merged]
    assert keys == [
        ("recipe", "nn", None, 1.2),
        ("recipe", "none", 1, 0.9),
        ("recipe", "soft", 0, 1.1),  # a row without a variant is the recipe's: kept
        ("smooth", "soft", 0, 1.3),  # the same variant, model and seed: replaced
    ]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--variant", "a b"], "--variant must be a plain name"),
        (["--variant", "smooth", "--models", "nn,soft"], "leave nn out of --models"),
    ],
)
def test_bad_variants_are_refused(argv, message, tmp_path: Path, capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        photos.main(["--shared", str(tmp_path), "--out", str(tmp_path / "out"), *argv])
    assert exc.value.code == 2
    assert message in capsys.readouterr().err
