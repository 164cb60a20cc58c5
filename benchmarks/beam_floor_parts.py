"""The parts of the beam-search floor (:mod:`benchmarks.beam_floor`): the dense layers of one
word, the additive score, the word choice, each timed alone and then in a word's order."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch

from benchmarks.timing import median_seconds
from benchmarks.workload import coco_size
from captioning.models import Decoder, packing
from captioning.models import fused_score as kernel

# The benchmark's COCO size: its vocabulary and widths, and the grid of its ResNet-101 at
# 448 px (14 x 14 cells of 2048 features), which is not built here.
COCO = coco_size()
VOCAB, WIDTH = COCO.vocab_size, COCO.config.model.hidden_dim
FEATURE_DIM, CELLS = 2048, 14 * 14


def dense_step(decoder: Decoder, images: int, beams: int) -> tuple[Callable[[], object], float]:
    """One word's dense layers on images*beams rows, and their GFLOP.

    Args:
        decoder: a COCO-size decoder, whose layers are run.
        images: B.
        beams: K, the live beams per image.
    """
    rows = images * beams
    g = torch.Generator().manual_seed(0)
    features = torch.randn(images, CELLS, FEATURE_DIM, generator=g)
    alpha = torch.softmax(torch.randn(images, beams, CELLS, generator=g), dim=2)
    h, c = torch.randn(rows, WIDTH, generator=g), torch.randn(rows, WIDTH, generator=g)
    embedded = torch.randn(rows, WIDTH, generator=g)
    score = decoder.attention.score

    def run() -> object:
        score.query_proj(h)
        context = torch.bmm(alpha, features).view(rows, FEATURE_DIM)
        decoder.gate(h)
        h2, _ = decoder.lstm(torch.cat([embedded, context], dim=1), (h, c))
        deep = decoder.hidden_to_out(h2) + decoder.context_to_out(context)
        return decoder.out(deep)

    macs = rows * (
        CELLS * FEATURE_DIM  # context
        + WIDTH * WIDTH  # query projection
        + WIDTH  # scalar gate
        + (2 * WIDTH + FEATURE_DIM) * 4 * WIDTH  # LSTM cell
        + (WIDTH + FEATURE_DIM) * WIDTH  # deep output
        + WIDTH * VOCAB  # vocabulary
    )
    return run, 2 * macs / 1e9


@contextmanager
def product_form(form: str) -> Iterator[None]:
    """The decoder's few-row products in ``form`` (``plain``, ``transposed`` or ``packed``:
    see :mod:`captioning.models.packing`) inside the block."""
    previous, packing.FORM = packing.FORM, form
    try:
        with packing.packed_weights(enabled=True):
            yield
    finally:
        packing.FORM = previous


def product_forms() -> list[str]:
    """The forms of the few-row products this CPU can run (:data:`packing.FORMS`)."""
    return [f for f in packing.FORMS if f != "packed" or packing.packing_available()]


def fused_score(keys: torch.Tensor, query: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """(B, 1, L, A) keys, (B, K, 1, A) queries → (B, K, L) scores, as one reduction."""
    return (torch.tanh(keys + query) * weight).sum(dim=3)


class Floor:
    """The floor's parts for beam search with ``beams`` beams (1: greedy) over ``images``
    images and captions of ``max_length`` words, timed by :meth:`measure`."""

    def __init__(
        self, decoder: Decoder, beams: int, images: int, max_length: int, fused: bool
    ) -> None:
        self.decoder = decoder
        self.beams, self.images, self.later = beams, images, max_length - 1
        self.first, first_gflop = dense_step(decoder, images, 1)
        self.step, step_gflop = dense_step(decoder, images, beams)
        self.grid = torch.randn(images, CELLS, FEATURE_DIM)
        self.gflop = (
            2 * images * CELLS * FEATURE_DIM * WIDTH / 1e9 + first_gflop + self.later * step_gflop
        )
        self.square = torch.randn(2048, 2048)
        self.activations = images * (1 + self.later * beams) * CELLS * WIDTH
        self.compiled = torch.compile(fused_score) if fused else None

    @torch.no_grad()
    def measure(self, repeats: int) -> dict[str, float]:
        """Seconds over a whole caption: the parts timed alone (``dense``, in the fastest
        form of the few-row products, and ``dense_FORM`` in each form; ``add``, ``tanh``,
        ``sigmoid``, ``projection``, ``sequence``: the three passes in turn with the faster
        of tanh and sigmoid, ``kernel``: the C kernel where it is built, ``choice``, and
        ``fused`` when compiled), the floors with each word's parts run in turn (``eager``,
        with the faster of ``sequence`` and ``kernel``, and ``compiled``), and ``peak``, the
        GFLOP/s of one large square product."""
        k, b, later = self.beams, self.images, self.later
        parts = {}
        keys_seconds = median_seconds(
            lambda: self.decoder.attention.project_keys(self.grid), repeats
        )
        # the dense layers in the fastest form of their few-row products on this CPU
        dense = {}
        for form in product_forms():
            with product_form(form):
                first = median_seconds(self.first, repeats)
                dense[form] = (first, first + later * median_seconds(self.step, repeats))
        form = min(dense, key=lambda name: dense[name][1])
        dense_first = dense[form][0]
        parts["dense"] = keys_seconds + dense[form][1]
        for name, (_, seconds) in dense.items():
            parts[f"dense_{name}"] = keys_seconds + seconds
        parts["peak"] = (
            2 * 2048**3 / 1e9 / median_seconds(lambda: self.square @ self.square, repeats)
        )

        # the eager score on one image's block at a time, as ours runs it: cache-resident
        image_keys, queries = torch.randn(1, CELLS, WIDTH), torch.randn(k, 1, WIDTH)
        block, weight = torch.empty(k, CELLS, WIDTH), torch.randn(WIDTH)
        scores = torch.empty(k, CELLS)
        # tanh(x), or the same function as 2 sigmoid(2x) - 1 (the 2s folded into the add and
        # the projection), as ours runs it where the sigmoid is faster
        passes = {
            "add": lambda: torch.add(image_keys, queries, out=block),
            "tanh": lambda: block.tanh_(),
            "sigmoid": lambda: block.sigmoid_(),
            "projection": lambda: torch.matmul(block, weight, out=scores),
        }
        for name, fn in passes.items():
            parts[name] = median_seconds(fn, repeats * 10) * self.activations / block.numel()
        squash = torch.Tensor.tanh_ if parts["tanh"] <= parts["sigmoid"] else torch.Tensor.sigmoid_
        # The passes timed alone, each on the block the same pass just wrote, are a bound no
        # code reaches: one after the other over every image's own keys, as a word must run
        # them, they take longer. That sequence is the eager floor's score.
        all_keys, all_queries = torch.randn(b, 1, CELLS, WIDTH), torch.randn(b, k, 1, WIDTH)

        def word() -> None:
            for image in range(b):
                torch.add(all_keys[image], all_queries[image], out=block)
                squash(block)
                torch.matmul(block, weight, out=scores)

        parts["sequence"] = median_seconds(word, repeats) * self.activations / (b * block.numel())
        # the same score as one C kernel over every image's keys (captioning.models.
        # fused_score), where it is built; the floor takes the faster of the two
        score_word = word
        if kernel.available(all_keys):
            bias = torch.zeros(1)

            def kernel_word() -> None:
                kernel.forward(all_keys, all_queries, weight, bias)

            seconds = median_seconds(kernel_word, repeats)
            parts["kernel"] = seconds * self.activations / (b * block.numel())
            if parts["kernel"] < parts["sequence"]:
                score_word = kernel_word
        score = min(parts["sequence"], parts.get("kernel", parts["sequence"]))

        # every search normalises each row's scores over the vocabulary and keeps the best
        # K continuations of each image (the first word: of its one row)
        first_logits, logits = torch.randn(b, VOCAB), torch.randn(b * k, VOCAB)

        def choose(rows: torch.Tensor) -> object:
            log_probs = torch.log_softmax(rows, dim=1)
            return log_probs.view(b, -1).topk(k, dim=1)

        choice_first = median_seconds(lambda: choose(first_logits), repeats)
        parts["choice"] = choice_first + later * median_seconds(lambda: choose(logits), repeats)

        # A word runs all of it in turn, and each part finds the caches as the others left
        # them (the weights, the keys); timed so, a word costs more than its parts alone.
        def whole_word() -> None:
            self.step()
            score_word()
            choose(logits)

        first_word = dense_first + choice_first + score * b * CELLS * WIDTH / self.activations
        with product_form(form):  # one block: packs made once, as a decoding makes them
            whole = median_seconds(whole_word, repeats)
        parts["eager"] = keys_seconds + first_word + later * whole

        if self.compiled is not None:
            query_first = all_queries[:, :1]
            compiled = self.compiled
            fused_first = median_seconds(lambda: compiled(all_keys, query_first, weight), repeats)
            parts["fused"] = fused_first + later * median_seconds(
                lambda: compiled(all_keys, all_queries, weight), repeats
            )

            def whole_compiled_word() -> None:
                self.step()
                compiled(all_keys, all_queries, weight)
                choose(logits)

            first_word = dense_first + fused_first + choice_first
            with product_form(form):
                whole = median_seconds(whole_compiled_word, repeats)
            parts["compiled"] = keys_seconds + first_word + later * whole
        return parts
