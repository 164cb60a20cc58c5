"""CIDEr-D rewards per training batch: :class:`captioning.metrics.cider.CiderD` against
pycocoevalcap's scorer called on every batch, on the same candidates and references.

A self-critical batch is ``images`` images with ``samples`` sampled captions each, scored
against the references of a training corpus of ``corpus`` images (5 references each). Ours
is built once from the corpus (its build time is reported apart: once per run) and then
scores each batch. pycocoevalcap's ``CiderScorer`` is what a training loop without our class
would call per batch: it is handed the batch's candidates with their references and cooks
and weighs every reference again for every candidate. Its document frequencies come from the
batch's references (it has no other way to get them), which changes the numbers but not the
work; the equality of the two on a shared reference set is checked here too (and, on a few
thousand captions, in tests/test_cider.py).
"""

from __future__ import annotations

import random
import time
from typing import Any

from pycocoevalcap.cider.cider_scorer import CiderScorer

from captioning.metrics.cider import CiderD

WORDS = [f"w{i}" for i in range(40)]


def _caption(rng: random.Random) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(5, 12)))


def _pycocoevalcap(candidates: list[str], references: list[list[str]]) -> list[float]:
    scorer = CiderScorer(n=4, sigma=6.0)
    for candidate, refs in zip(candidates, references):
        scorer += (candidate, refs)
    scorer.compute_doc_freq()
    return [float(s) for s in scorer.compute_cider()]


def bench_cider(
    corpus: int = 8000, images: int = 64, samples: int = 5, repeats: int = 5, seed: int = 0
) -> dict[str, Any]:
    """Time one batch's CIDEr-D both ways; returns the settings, the times, the speed-up
    and the largest difference of the two on a shared reference set."""
    rng = random.Random(seed)
    references = {i: [_caption(rng) for _ in range(5)] for i in range(corpus)}
    start = time.perf_counter()
    ours = CiderD(references)
    build_s = time.perf_counter() - start
    batch = rng.sample(range(corpus), min(images, corpus))
    keys = [image for image in batch for _ in range(samples)]
    candidates = [_caption(rng) for _ in keys]
    batch_refs = [references[k] for k in keys]

    # Interleaved, and the fastest of the repeats (as timeit advises): on a CPU shared with
    # other work, a descheduled run measures the neighbours, not the code.
    times: dict[str, list[float]] = {"ours": [], "pycocoevalcap": []}
    for _ in range(repeats):
        for name, fn in (
            ("ours", lambda: ours.score(candidates, keys)),
            ("pycocoevalcap", lambda: _pycocoevalcap(candidates, batch_refs)),
        ):
            begin = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - begin)
    ours_s, theirs_s = min(times["ours"]), min(times["pycocoevalcap"])
    # equality where both see the same reference set: ours built from the batch's references
    shared = CiderD({n: refs for n, refs in enumerate(batch_refs)})
    difference = max(
        abs(a - b)
        for a, b in zip(
            shared.score(candidates, range(len(keys))), _pycocoevalcap(candidates, batch_refs)
        )
    )
    return {
        "corpus_images": corpus,
        "batch_images": len(batch),
        "samples": samples,
        "candidates": len(keys),
        "repeats": repeats,
        "build_s": build_s,
        "ours_s": ours_s,
        "pycocoevalcap_s": theirs_s,
        "speedup": theirs_s / ours_s,
        "max_abs_diff": difference,
    }


def format_cider(result: dict[str, Any]) -> list[str]:
    """The CIDEr-D section of the Markdown report."""
    return [
        "## CIDEr-D rewards per batch",
        "",
        f"{result['batch_images']} images x {result['samples']} samples = "
        f"{result['candidates']} candidates against a corpus of {result['corpus_images']} "
        f"images (5 references each); fastest of {result['repeats']} interleaved runs. Ours "
        f"is built "
        f"once per run ({result['build_s']:.2f} s); pycocoevalcap's CiderScorer is called on "
        f"every batch. Largest difference on a shared reference set: "
        f"{result['max_abs_diff']:.1e}.",
        "",
        "| ours s | pycocoevalcap s | speed-up |",
        "| --- | --- | --- |",
        f"| {result['ours_s']:.4f} | {result['pycocoevalcap_s']:.4f} | {result['speedup']:.1f}x |",
    ]
