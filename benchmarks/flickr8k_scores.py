"""The rows of the Flickr8k table (:mod:`benchmarks.flickr8k`) from a finished run's decoded
test split: the paper's metrics and ours (BLEU with and without the brevity penalty, METEOR,
ROUGE-L, CIDEr-D), what a reader of the captions sees, the seconds of every stage and what the
training loss reported of the attention.
"""

from __future__ import annotations

import functools
import json
import math
import statistics
from pathlib import Path
from typing import Any

from lab.provenance import portable


def references(out: Path, split: str) -> dict[int, list[str]]:
    """The reference captions of ``split`` in ``OUT/data``, by image id."""
    coco = json.loads((out / "data" / "annotations" / f"captions_{split}.json").read_text())
    refs: dict[int, list[str]] = {}
    for annotation in coco["annotations"]:
        refs.setdefault(annotation["image_id"], []).append(annotation["caption"])
    return refs


def score(predictions: dict[int, str], refs: dict[int, list[str]]) -> dict[str, Any]:
    """The paper's metrics and ours of ``predictions``, with what a reader of the captions
    sees: how many differ, and how many say ``<unk>``."""
    from captioning.metrics import caption_metrics

    scores = caption_metrics(predictions, refs)
    scores["distinct_captions"] = len(set(predictions.values()))
    scores["unk_captions"] = sum("<unk>" in caption for caption in predictions.values())
    scores["mean_words"] = round(statistics.mean(len(c.split()) for c in predictions.values()), 2)
    return scores


def rows_of_job(
    out: Path,
    folder: Path,
    job: dict[str, Any],
    refs: dict[int, list[str]],
    first: float = 0.0,
    cuts: tuple[int, ...] = (),
) -> list[dict[str, Any]]:
    """One row per decoded beam size of the finished run in ``folder`` (its ``job.json`` is
    ``job``; ``first``: the training seconds of the run it started from); with ``cuts``, also
    one per cut of its beam-3 captions to their first N words (variant ``cutN``, scored
    only), which shows what BLEU without the brevity penalty rewards."""
    job = dict(job)
    stages = job.pop("stages")
    history = job.pop("history", None) or [{}]
    before = (stages.get("prepare") or 0) + (stages.get("extract") or 0)
    rows = []
    for beam, seconds in job.pop("evaluate_seconds").items():
        found = json.loads((folder / f"test_beam{beam}" / "predictions.json").read_text())
        predictions = {p["image_id"]: p["caption"] for p in found}
        rows.append(
            {
                **{k: job[k] for k in ("variant", "model", "seed")},
                "beam_size": int(beam),
                **score(predictions, refs),
                **{
                    k: job[k]
                    for k in ("select_metric", "best_val", "best_epoch", "epochs", "steps")
                },
                "training": {**_training_trace(history), **even_entropy(out, folder)},
                "seconds": {
                    "prepare": stages.get("prepare"),
                    "extract": stages.get("extract"),
                    "first_stage": first,
                    "train": job["train_seconds"],
                    "evaluate": seconds,
                    "recipe": round(before + first + job["train_seconds"] + seconds, 1),
                },
                "config": job["config"],
                "overrides": [portable(o, {"OUT": out}) for o in job["settings"]],
                **{k: job[k] for k in ("precision", "device", "cpu", "threads", "timed_alone")},
                "commit": job["commit"],
                "command": job["command"],
            }
        )
        if beam == "3":
            for words in cuts:
                cut = {i: " ".join(c.split()[:words]) for i, c in predictions.items()}
                rows.append({**rows[-1], **score(cut, refs), "variant": f"cut{words}"})
    return rows


# what the training loss reports of the attention (per caption, summed over its words): the
# doubly stochastic penalty and, for hard attention, the entropy of the maps it samples from;
# with a word localiser, its own loss and the KL from its maps to the attention's per word
TRACED = (
    "nll_per_token",
    "penalty",
    "entropy",
    "word_presence",
    "map_kl_per_word",
    "expected_nll_per_token",
)


def _training_trace(history: list[dict[str, Any]]) -> dict[str, Any]:
    """The first and last epoch's :data:`TRACED` values: whether the maps moved."""
    return {
        which: {k: round(epoch[k], 3) for k in TRACED if epoch.get(k) is not None}
        for which, epoch in (("first_epoch", history[0]), ("last_epoch", history[-1]))
    }


@functools.cache
def _mean_steps(captions: Path, max_length: int) -> float:
    """The mean number of steps a training caption of ``captions`` gives the decoder: its
    words, cut to ``max_length`` as the training dataset cuts them, and ``<end>``."""
    from captioning.data.vocab import tokenize

    coco = json.loads(captions.read_text())
    return statistics.mean(
        min(len(tokenize(a["caption"])), max_length) + 1 for a in coco["annotations"]
    )


def even_entropy(out: Path, folder: Path) -> dict[str, Any]:
    """An even map's entropy per training caption on the run's grid, ln L over each step of a
    training caption of ``OUT/data`` (one caption per image an epoch, drawn at random, so
    the mean over all of them): the yardstick of the traced ``entropy``. Empty for a run
    without attention maps or without its checkpoint."""
    checkpoint = folder / "train" / "best.pt"
    if not checkpoint.is_file():
        return {}
    from captioning.api import load

    model = load(checkpoint, "cpu")
    if model.config.model.attention == "none":
        return {}
    rows, cols = model.grid_shape
    captions = out / "data" / "annotations" / "captions_train.json"
    steps = _mean_steps(captions, model.config.data.max_caption_length)
    return {"even_entropy": round(steps * math.log(rows * cols), 3)}
