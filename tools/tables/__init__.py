"""The docs' result tables, generated from the committed result rows in ``results/*.json``.

    python -m tools.tables            # rewrite every generated table in README.md and docs/
    python -m tools.tables --check    # exit 1 when a table differs from what its rows give

A generated table sits between two marker lines in a Markdown file::

    <!-- table: photos -->
    ...
    <!-- end table -->

``photos`` names both the rows (``results/photos.json``) and the function of ``TABLES`` that
renders them (``SOURCES`` names the rows of a table that shares another's file). Each study's
tables live in their own module of this package; :mod:`tools.tables.common` holds what they
share, the provenance note under each table among it. Nothing between the markers is typed
by hand: edit the rows (by re-running the study that writes them) or the renderer, then run
this module.
"""

from __future__ import annotations

import argparse
import json
import re
from collections.abc import Callable
from pathlib import Path

from tools.tables.attention import (
    _chosen_lr,  # noqa: F401  (tools/compare_attention.py's choice is tested against it)
    attention_family,
    attention_family_blocks,
    attention_family_sweep,
    multi_head,
)
from tools.tables.colour_trace import colour_trace, family_trace, score_start, score_trace
from tools.tables.common import ROOT, Rows
from tools.tables.flickr8k import (
    flickr8k,
    flickr8k_attention,
    flickr8k_beams,
    flickr8k_headline,
    flickr8k_levers,
)
from tools.tables.flickr8k_decoding import flickr8k_brevity, flickr8k_dev_decode
from tools.tables.flickr8k_time import flickr8k_step_cost, flickr8k_targets, flickr8k_time
from tools.tables.grid_probe import grid_probe
from tools.tables.grounding import (
    grounding,
    grounding_categories,
    grounding_levers,
    grounding_words,
)
from tools.tables.hard import (
    ESTIMATOR_COLUMNS,  # noqa: F401  (tools/compare_estimators.py prints its columns)
    HARD_LR,  # noqa: F401
    estimator_variance,
    hard_authors,
    hard_estimators,
    hard_estimators_paper_wiring,
    hard_recipe,
)
from tools.tables.index import results_index
from tools.tables.looks import (
    flickr8k_keep,
    grounding_localiser,
    grounding_looks,
    grounding_references,
    looks_screen,
)
from tools.tables.photo_sweep import photo_budget, photo_family, photo_sweep
from tools.tables.photos import RECIPE_SCST, photo_budget_timed, photo_levers, photos  # noqa: F401
from tools.tables.scst import scst_shapes
from tools.tables.serve import serve_latency
from tools.tables.shapes import (
    SHAPES_RECIPE,  # noqa: F401
    SHAPES_TARGETS,  # noqa: F401
    _at_target,  # noqa: F401
    shapes_recipe,
    shapes_seeds,
    shapes_targets,
)
from tools.tables.speed import (
    roofline,
    speed_bench,
    speed_encoder,
    speed_profile,
    speed_quality,
    speed_sharing,
)
from tools.tables.speed_floors import speed_allocator, speed_floor, speed_train_floor

DOCUMENTS = ("README.md", "docs/*.md")
_BLOCK = re.compile(r"(<!-- table: (\w+) -->\n)(.*?)(<!-- end table -->)", re.S)

TABLES: dict[str, Callable[[Rows], str]] = {
    "roofline": roofline,
    "photos": photos,
    "photo_levers": photo_levers,
    "photo_budget_timed": photo_budget_timed,
    "serve_latency": serve_latency,
    "attention_family": attention_family,
    "attention_family_sweep": attention_family_sweep,
    "attention_family_blocks": attention_family_blocks,
    "multi_head": multi_head,
    "hard_estimators": hard_estimators,
    "hard_estimators_paper_wiring": hard_estimators_paper_wiring,
    "hard_recipe": hard_recipe,
    "hard_authors": hard_authors,
    "shapes_seeds": shapes_seeds,
    "shapes_recipe": shapes_recipe,
    "shapes_targets": shapes_targets,
    "colour_trace": colour_trace,
    "score_trace": score_trace,
    "score_start": score_start,
    "family_trace": family_trace,
    "photo_sweep": photo_sweep,
    "photo_family": photo_family,
    "photo_budget": photo_budget,
    "estimator_variance": estimator_variance,
    "scst_shapes": scst_shapes,
    "speed_quality": speed_quality,
    "speed_bench": speed_bench,
    "speed_floor": speed_floor,
    "speed_train_floor": speed_train_floor,
    "speed_allocator": speed_allocator,
    "speed_profile": speed_profile,
    "speed_sharing": speed_sharing,
    "speed_encoder": speed_encoder,
    "flickr8k": flickr8k,
    "flickr8k_headline": flickr8k_headline,
    "flickr8k_beams": flickr8k_beams,
    "flickr8k_dev_decode": flickr8k_dev_decode,
    "flickr8k_levers": flickr8k_levers,
    "flickr8k_attention": flickr8k_attention,
    "flickr8k_brevity": flickr8k_brevity,
    "flickr8k_time": flickr8k_time,
    "flickr8k_targets": flickr8k_targets,
    "flickr8k_step_cost": flickr8k_step_cost,
    "flickr8k_keep": flickr8k_keep,
    "grounding": grounding,
    "grounding_categories": grounding_categories,
    "grounding_words": grounding_words,
    "grounding_levers": grounding_levers,
    "grounding_looks": grounding_looks,
    "grounding_localiser": grounding_localiser,
    "grounding_references": grounding_references,
    "looks_screen": looks_screen,
    "grid_probe": grid_probe,
    "results_index": results_index,
}
# tables whose rows are in another table's file
SOURCES = {
    "flickr8k_headline": "flickr8k",
    "photo_levers": "photos",
    "photo_budget_timed": "photos",
    "attention_family_sweep": "attention_family",
    "attention_family_blocks": "attention_family",
    "multi_head": "attention_family",
    "photo_family": "photo_sweep",
    "shapes_recipe": "shapes_seeds",
    "shapes_targets": "shapes_seeds",
    "score_trace": "colour_trace",
    "score_start": "colour_trace",
    "family_trace": "colour_trace",
    "hard_recipe": "attention_family",
    "speed_quality": "speed",
    "speed_bench": "speed",
    "speed_floor": "speed",
    "speed_train_floor": "speed",
    "speed_allocator": "speed",
    "speed_profile": "speed",
    "speed_sharing": "speed",
    "speed_encoder": "speed",
    "flickr8k_beams": "flickr8k",
    "flickr8k_dev_decode": "flickr8k",
    "flickr8k_levers": "flickr8k",
    "flickr8k_attention": "flickr8k",
    "flickr8k_brevity": "flickr8k",
    "flickr8k_time": "flickr8k",
    "flickr8k_targets": "flickr8k",
    "flickr8k_step_cost": "speed",
    "flickr8k_keep": "flickr8k",
    "grounding_categories": "grounding",
    "grounding_words": "grounding",
    "grounding_levers": "grounding",
    "grounding_looks": "grounding",
    "grounding_localiser": "grounding",
    "grounding_references": "grounding",
    "results_index": "*",  # every results file
}


def load_rows(name: str, results: Path = ROOT / "results") -> Rows:
    """The committed rows of ``results/<name>.json``; a file that is not JSON exits with a
    one-line message."""
    path = results / f"{name}.json"
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as error:
        raise SystemExit(f"{path}: not valid JSON ({error}); restore it from git") from None


def render(text: str, results: Path = ROOT / "results") -> str:
    """``text`` with every generated table replaced by what its rows give; a block that
    names no table of ``TABLES`` exits with a one-line message."""

    def replace(match: re.Match) -> str:
        name = match.group(2)
        if name not in TABLES:
            raise SystemExit(f"unknown table {name!r}; known: {', '.join(TABLES)}")
        source = SOURCES.get(name, name)
        if source == "*":
            files = [
                {"file": p.stem, "rows": load_rows(p.stem, results)}
                for p in sorted(results.glob("*.json"))
            ]
            return match.group(1) + TABLES[name](files) + match.group(4)
        if not (results / f"{source}.json").is_file():  # a study not yet run: say so
            return match.group(1) + f"(results/{source}.json is not there yet.)\n" + match.group(4)
        return match.group(1) + TABLES[name](load_rows(source, results)) + match.group(4)

    return _BLOCK.sub(replace, text)


def documents(root: Path = ROOT) -> list[Path]:
    """The Markdown files that may hold generated tables."""
    return sorted(p for pattern in DOCUMENTS for p in root.glob(pattern))


def main(argv: list[str] | None = None, root: Path = ROOT) -> int:
    """Rewrite the generated tables of the documents under ``root`` (or, with ``--check``,
    only report them); returns the exit status: 1 when ``--check`` finds a stale table."""
    parser = argparse.ArgumentParser(
        prog="python -m tools.tables", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument(
        "--check", action="store_true", help="change nothing; exit 1 if a table is out of date"
    )
    args = parser.parse_args(argv)
    stale = []
    for path in documents(root):
        text = path.read_text(encoding="utf-8")
        new = render(text, root / "results")
        if new != text:
            stale.append(path)
            if not args.check:
                path.write_text(new, encoding="utf-8")
    for path in stale:
        verb = "out of date" if args.check else "rewritten"
        print(f"{path.relative_to(root)}: {verb}")
    if args.check and stale:
        print("run `python -m tools.tables` to regenerate them")
    return 1 if args.check and stale else 0
