"""Speed benchmark: training steps and decoding, ours against a naive reference.

    captioning bench --sizes shapes,coco --device all [--compile] [--out runs/bench/bench.json]
    python tools/bench.py ...                          (the same command)

What is timed, as medians over ``--repeats`` runs after ``--warmup`` runs:

- ``decoder_step``: one decoder training step (forward, loss, backward, gradient clipping,
  Adam) on cached features, a random (B, L, D) tensor;
- ``full_step``: the same with the encoder in front (images → encoder → decoder). The size's
  ``fine_tune`` says whether the encoder trains (shapes: ``all``) or runs frozen under
  no_grad (coco: ``none``, a random-init ResNet-101 at 448 px, so nothing downloads);
- ``greedy``, ``beam3``, ``beam5``: captioning one batch, in images/s and words/s. Every
  caption runs to the size's ``max_length`` (``<end>`` is masked through ``min_length``), so
  the work does not depend on where random weights happen to end a caption.

Each is timed for our code and for a reference written the way popular tutorial code does it
(:class:`ReferenceDecoder`, :func:`reference_greedy`, :func:`reference_beam_search`): the same
weights, but the grid is re-projected at every word, the output layer runs one step at a
time, and decoding goes one image at a time. Before timing, the two are checked against each
other: teacher-forced logits in fp32, and captions in fp64 so that the different batch shapes
cannot flip near-ties between candidates. The caption check runs with the random weights and
again with the ``<end>`` logit raised until about half of our captions end (random weights
end all or none of them), so that finished and live beams compete.

Peak memory is the high-water mark during set-up, warm-up and repeats minus the memory in
use just before: for a training step the copy of the weights, the gradients, Adam's state and
the activations; for decoding its working memory. On CUDA it comes from
``torch.cuda.max_memory_allocated``. On CPU it is the process's resident set (``VmHWM`` of
/proc/self/status, reset through /proc/self/clear_refs, after ``malloc_trim`` has handed
freed heap pages back); it counts everything the process touches, allocator caches included,
so read it as an approximation. Where /proc is missing it falls back to the growth of
``ru_maxrss``, which stays at zero until a measurement exceeds every earlier peak.
"""

from __future__ import annotations

import copy
import ctypes
import dataclasses
import json
import logging
import math
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import torch
from torch import nn

from captioning.config import Config, config_from_dict, config_to_dict, load_config
from captioning.decoding import Decoded, beam_search, greedy_decode
from captioning.errors import CaptioningError
from captioning.losses import caption_loss
from captioning.models import Captioner, build_model
from captioning.models.attention import HardAttention, SoftAttention
from captioning.models.decoder import Decoder, DecoderOutput
from captioning.train import autocast, build_optimizer
from captioning.vocab import SPECIALS, Vocabulary

logger = logging.getLogger("captioning")

REPO_ROOT = Path(__file__).resolve().parent.parent
LOGITS_TOLERANCE = 1e-5
SCORE_TOLERANCE = 1e-4
# Speed-ups to report (not assert), by (size, device, task).
TARGETS = {("coco", "cpu", "decoder_step"): 5.0, ("coco", "cpu", "beam5"): 20.0}
TASK_LABELS = {
    "decoder_step": "decoder train step (cached features)",
    "full_step": "full train step",
    "greedy": "greedy",
    "beam3": "beam k=3",
    "beam5": "beam k=5",
}

# --------------------------------------------------------------------------- reference


class ReferenceDecoder(nn.Module):
    """Our decoder's weights, computed the way tutorial code does it: a Python loop over
    words in which every step re-projects the whole grid into attention keys and applies the
    output layer on its own.

    The modules are the decoder's own, not copies: a training step of the reference updates
    ``decoder``. Only soft attention is supported.

    Args:
        decoder: the :class:`Decoder` whose layers are used.
    """

    def __init__(self, decoder: Decoder) -> None:
        super().__init__()
        attention = decoder.attention
        if not isinstance(attention, SoftAttention) or isinstance(attention, HardAttention):
            raise ValueError("the reference decoder supports soft attention only")
        self.decoder = decoder

    def init_state(self, features: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """h_0, c_0 (B, H) each from ``features`` (B, L, D)."""
        decoder = self.decoder
        mean = features.mean(dim=1)  # (B, D)
        h = decoder.init_activation(decoder.init_h(mean))  # (B, H)
        c = decoder.init_activation(decoder.init_c(mean))  # (B, H)
        return h, c

    def step(
        self, words: torch.Tensor, h: torch.Tensor, c: torch.Tensor, features: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """One word for B rows: previous ``words`` (B,), state (B, H) each, ``features``
        (B, L, D) → logits (B, V), h, c, alpha (B, L), mean gate beta (B,)."""
        decoder = self.decoder
        score = decoder.attention.score
        keys = score.project_keys(features)  # (B, L, A): the whole grid again, every word
        alpha = torch.softmax(score(keys, h).float(), dim=1)  # (B, L)
        context = (features * alpha.unsqueeze(2).to(features.dtype)).sum(dim=1)  # (B, D)
        if decoder.gate is not None:
            gate = torch.sigmoid(decoder.gate(h))  # (B, 1) or (B, D)
            context = gate * context
            beta = gate.mean(dim=1)  # (B,)
        else:
            beta = context.new_ones(context.shape[0])
        embedded = decoder.embedding(words)  # (B, E)
        lstm_input = embedded  # (B, E), or (B, E + D) with the context
        if decoder.context_to_lstm:
            lstm_input = torch.cat([embedded, context], dim=1)
        h, c = decoder.lstm(lstm_input, (h, c))
        if decoder.deep_output:
            deep = torch.tanh(
                embedded
                + decoder.hidden_to_out(decoder.dropout(h))
                + decoder.context_to_out(context)
            )
            logits = decoder.out(decoder.dropout(deep))  # (B, V)
        else:
            logits = decoder.out(decoder.dropout(h))  # (B, V)
        return logits, h, c, alpha, beta

    def forward(self, features: torch.Tensor, tokens: torch.Tensor) -> DecoderOutput:
        """Teacher forcing: ``features`` (B, L, D), input ``tokens`` (B, T) → T steps of
        logits (B, T, V), alphas (B, T, L) and betas (B, T), as :meth:`Decoder.forward`."""
        h, c = self.init_state(features)
        logits, alphas, betas = [], [], []
        for t in range(tokens.shape[1]):
            step_logits, h, c, alpha, beta = self.step(tokens[:, t], h, c, features)
            logits.append(step_logits)
            alphas.append(alpha)
            betas.append(beta)
        return DecoderOutput(
            logits=torch.stack(logits, dim=1),  # (B, T, V)
            alphas=torch.stack(alphas, dim=1),  # (B, T, L)
            betas=torch.stack(betas, dim=1),  # (B, T)
        )


def _reference_log_probs(
    logits: torch.Tensor, step: int, min_length: int, suppress_unk: bool
) -> torch.Tensor:
    """log p over the vocabulary (fp32, as ours) with the words that may not come next at
    -inf: ``<pad>`` and ``<start>`` always, ``<unk>`` on request, ``<end>`` before
    ``min_length``."""
    log_probs = torch.log_softmax(logits.float(), dim=1)  # (n, V)
    banned = [Vocabulary.pad_id, Vocabulary.start_id]
    if suppress_unk:
        banned.append(Vocabulary.unk_id)
    if step < min_length:
        banned.append(Vocabulary.end_id)
    log_probs[:, banned] = float("-inf")
    return log_probs


# One decoded caption: its words (no <end>), one attention map per step, its log-probability.
_Caption = tuple[list[int], list[torch.Tensor], float]


def _pack(captions: list[_Caption], width: int, cells: int, device: torch.device) -> Decoded:
    """Per-image captions → a :class:`Decoded` of ``width`` steps, padded as ours pads."""
    batch = len(captions)
    tokens = torch.full((batch, width), Vocabulary.pad_id, dtype=torch.long, device=device)
    alphas = torch.zeros(batch, width, cells, device=device)
    for row, (words, maps, _) in enumerate(captions):
        tokens[row, : len(words)] = torch.tensor(words, dtype=torch.long)
        if maps:
            alphas[row, : len(maps)] = torch.stack(maps[:width]).float()  # (t, L)
    return Decoded(
        tokens=tokens,  # (B, width)
        lengths=torch.tensor([len(w) for w, _, _ in captions], device=device),
        alphas=alphas,  # (B, width, L)
        scores=torch.tensor([s for _, _, s in captions], device=device),
    )


@torch.no_grad()
def reference_greedy(
    reference: ReferenceDecoder,
    features: torch.Tensor,
    max_length: int = 20,
    min_length: int = 1,
    suppress_unk: bool = False,
) -> Decoded:
    """Greedy decoding one image at a time, with the result semantics of
    :func:`captioning.decoding.greedy_decode`."""
    captions: list[_Caption] = []
    for grid in features.split(1):  # (1, L, D): one image at a time, as the tutorials do
        h, c = reference.init_state(grid)
        word = torch.full((1,), Vocabulary.start_id, device=grid.device)
        words: list[int] = []
        maps: list[torch.Tensor] = []
        # fp32 and summed word by word, in the same order as ours: the same float result
        score = torch.zeros((), device=grid.device)
        for step in range(max_length):
            logits, h, c, alpha, _ = reference.step(word, h, c, grid)
            log_probs = _reference_log_probs(logits, step, min_length, suppress_unk)  # (1, V)
            word = log_probs.argmax(dim=1)  # (1,)
            score = score + log_probs[0, word[0]]
            maps.append(alpha[0])
            if int(word) == Vocabulary.end_id:
                break
            words.append(int(word))
        captions.append((words, maps, float(score)))
    width = max(len(maps) for _, maps, _ in captions)
    return _pack(captions, width, features.shape[1], features.device)


def _reference_beam_one(
    reference: ReferenceDecoder,
    grid: torch.Tensor,
    beam_size: int,
    max_length: int,
    min_length: int,
    suppress_unk: bool,
) -> _Caption:
    """Beam search for one image ``grid`` (1, L, D), tutorial style: the live beams shrink
    and grow as Python lists, and a beam that ends leaves the beam there and then."""
    k = beam_size
    h, c = reference.init_state(grid)  # (1, H) each
    words = torch.full((1,), Vocabulary.start_id, device=grid.device)  # (n,) last words
    seqs = torch.zeros(1, 0, dtype=torch.long, device=grid.device)  # (n, t)
    seq_alphas = torch.zeros(1, 0, grid.shape[1], device=grid.device)  # (n, t, L)
    beam_scores = torch.zeros(1, device=grid.device)  # (n,) fp32, as ours
    best: _Caption | None = None
    for step in range(max_length):
        n = words.shape[0]
        logits, h, c, alpha, _ = reference.step(words, h, c, grid.expand(n, -1, -1))
        log_probs = _reference_log_probs(logits, step, min_length, suppress_unk)  # (n, V)
        vocab = log_probs.shape[1]
        candidates = (beam_scores.unsqueeze(1) + log_probs).view(-1)  # (n * V,)
        top_scores, top_index = candidates.topk(min(2 * k, candidates.numel()))  # (2K,)
        parents, next_words, next_scores = [], [], []
        for rank, (score, index) in enumerate(zip(top_scores.tolist(), top_index.tolist())):
            parent, word = divmod(index, vocab)
            if word == Vocabulary.end_id:
                # Only an ending among the top K finishes a caption (K = 1 is greedy); any
                # ending leaves the beam.
                if rank < k and math.isfinite(score) and (best is None or score > best[2]):
                    maps = list(seq_alphas[parent]) + [alpha[parent]]
                    best = (seqs[parent].tolist(), maps, score)
                continue
            if len(parents) < k and math.isfinite(score):
                parents.append(parent)
                next_words.append(word)
                next_scores.append(score)
        if not parents:
            break
        index = torch.tensor(parents, device=grid.device)  # (n',)
        words = torch.tensor(next_words, device=grid.device)  # (n',)
        seqs = torch.cat([seqs[index], words.unsqueeze(1)], dim=1)  # (n', t + 1)
        seq_alphas = torch.cat([seq_alphas[index], alpha[index].unsqueeze(1)], dim=1)
        h, c = h[index], c[index]
        # python floats hold the fp32 scores exactly, so this is no rounding
        beam_scores = torch.tensor(next_scores, device=grid.device)  # (n',)
        # Scores only fall as a caption grows: no live beam can beat a finished caption
        # that already scores at least as well as the best of them.
        if best is not None and best[2] >= max(next_scores):
            break
    if best is None:  # no beam ended: the best live one, unfinished
        i = int(beam_scores.argmax())
        best = (seqs[i].tolist(), list(seq_alphas[i]), float(beam_scores[i]))
    return best


@torch.no_grad()
def reference_beam_search(
    reference: ReferenceDecoder,
    features: torch.Tensor,
    beam_size: int = 3,
    max_length: int = 20,
    min_length: int = 1,
    length_penalty: float = 0.0,
    suppress_unk: bool = False,
) -> Decoded:
    """Beam search one image at a time, with the result semantics of
    :func:`captioning.decoding.beam_search` (same candidates, same rule for which endings
    count, same stopping, same answer when no beam ends). Without a length penalty only."""
    if length_penalty != 0.0:
        raise ValueError("the reference beam search supports length_penalty=0 only")
    captions = [
        _reference_beam_one(reference, grid, beam_size, max_length, min_length, suppress_unk)
        for grid in features.split(1)  # (1, L, D)
    ]
    width = min(max(len(words) for words, _, _ in captions) + 1, max_length)
    return _pack(captions, width, features.shape[1], features.device)


# Our decoding and the reference's, by task name: (ours, reference).
DECODERS: dict[str, tuple[Callable[..., Decoded], Callable[..., Decoded]]] = {
    "greedy": (greedy_decode, reference_greedy),
    "beam3": (partial(beam_search, beam_size=3), partial(reference_beam_search, beam_size=3)),
    "beam5": (partial(beam_search, beam_size=5), partial(reference_beam_search, beam_size=5)),
}


def captions_equal(ours: Decoded, reference: Decoded) -> list[bool]:
    """Per image: the same number of words and the same words."""
    return [
        int(n) == int(m) and torch.equal(a[: int(n)].cpu(), b[: int(m)].cpu())
        for a, n, b, m in zip(ours.tokens, ours.lengths, reference.tokens, reference.lengths)
    ]


def end_biased(
    decoder: Decoder,
    features: torch.Tensor,
    tokens: torch.Tensor,
    decode: Callable[[Decoder, torch.Tensor], Decoded],
    max_length: int,
    target: float = 0.5,
    iterations: int = 7,
) -> tuple[Decoder, float]:
    """A copy of ``decoder`` whose ``<end>`` logit is raised until ``decode`` (ours) ends
    about ``target`` of the captions of ``features`` (B, L, D) before ``max_length``.

    Random weights end all captions at once or none, and a bias that ends every caption at
    its first allowed word would test little more; the mixed regime in between is where
    finished and live beams compete. The bias is searched by bisection over quantiles of the
    teacher-forced gap between the best word and ``<end>`` on ``tokens`` (B, T), which puts
    it on the scale of these weights. Returns the copy and the quantile used.
    """
    biased = copy.deepcopy(decoder).eval()
    end = Vocabulary.end_id
    with torch.no_grad():
        logits = biased(features, tokens[:, :-1]).logits.double()  # (B, T-1, V)
        words = logits.clone()
        words[..., [Vocabulary.pad_id, Vocabulary.start_id, end]] = float("-inf")
        gap = (words.max(dim=2).values - logits[..., end]).flatten()  # (B * (T-1),)
        base = float(biased.out.bias[end])

        def ended_share(quantile: float) -> float:
            biased.out.bias[end] = base + float(torch.quantile(gap, quantile))
            lengths = decode(biased, features).lengths
            return float((lengths < max_length).double().mean())

        low, high = 0.0, 0.5
        for _ in range(iterations):
            middle = (low + high) / 2
            if ended_share(middle) < target:
                low = middle
            else:
                high = middle
        ended_share(high)
    return biased, high


# --------------------------------------------------------------------------- sizes


@dataclass
class BenchSize:
    """One problem size.

    Attributes:
        name: the preset's name.
        config: the model section builds the model; ``train`` gives the optimiser settings
            and ``decode.max_length`` the longest decoded caption.
        vocab_size: V.
        caption_length: tokens per training caption, ``<start>`` and ``<end>`` included.
        batch_size: images per training step and per decoded batch.
        slow_repeats: repeats of the reference and of the full step unless the command line
            sets them (None: ``--repeats``).
        check_images: images in the reference checks (None: the whole batch).
    """

    name: str
    config: Config
    vocab_size: int
    caption_length: int
    batch_size: int
    slow_repeats: int | None = None
    check_images: int | None = None


def shapes_size() -> BenchSize:
    """The shapes default: configs/shapes_soft.yaml (small CNN, 96 px → 12x12x128 grid)."""
    path = REPO_ROOT / "configs" / "shapes_soft.yaml"
    if path.is_file():
        config = load_config(path)
    else:  # an installed package without the configs folder: the same values
        config = config_from_dict({
            "model": {"encoder": "small_cnn", "image_size": 96, "fine_tune": "all",
                      "positional": "sinusoidal", "cnn_channels": [16, 32, 64, 128],
                      "attention_dim": 128, "embed_dim": 64, "hidden_dim": 512, "dropout": 0.1,
                      "context_to_lstm": False},
            "train": {"batch_size": 64, "lr": 2e-3, "encoder_lr": 2e-3},
            "decode": {"max_length": 24},
        })  # fmt: skip
    return BenchSize("shapes", config, vocab_size=35, caption_length=16, batch_size=64)


def coco_size() -> BenchSize:
    """COCO scale: a random-init ResNet-101 at 448 px (14x14x2048 grid, frozen), embedding,
    attention and LSTM of 512, 10 000 words, 20-token captions, 32 images."""
    config = config_from_dict({
        "model": {"encoder": "resnet101", "weights": None, "image_size": 448,
                  "fine_tune": "none", "attention_dim": 512, "embed_dim": 512,
                  "hidden_dim": 512},
        "train": {"batch_size": 32},
        "decode": {"max_length": 20},
    })  # fmt: skip
    return BenchSize(
        "coco", config, vocab_size=10_000, caption_length=20, batch_size=32,
        slow_repeats=2, check_images=8,
    )  # fmt: skip


def tiny_size() -> BenchSize:
    """A seconds-long size for tests and smoke runs (4x4x16 grid, 20 words)."""
    config = config_from_dict({
        "model": {"encoder": "small_cnn", "image_size": 16, "fine_tune": "all",
                  "cnn_channels": [8, 16, 16], "attention_dim": 16, "embed_dim": 16,
                  "hidden_dim": 32, "dropout": 0.1},
        "decode": {"max_length": 8},
    })  # fmt: skip
    return BenchSize("tiny", config, vocab_size=20, caption_length=8, batch_size=6)


SIZES: dict[str, Callable[[], BenchSize]] = {
    "shapes": shapes_size,
    "coco": coco_size,
    "tiny": tiny_size,
}


# --------------------------------------------------------------------------- options


@dataclass
class BenchOptions:
    """What :func:`run_benchmark` measures and where it writes.

    Attributes:
        sizes: preset names from ``SIZES``.
        device: ``cpu``, ``cuda`` or ``all`` (CPU, and CUDA when available).
        precisions: ``fp32`` and/or ``bf16`` (autocast).
        compile: also time ``torch.compile`` variants of our code; a failure is recorded.
        repeats: timed runs per measurement (the median is reported).
        warmup: untimed runs first.
        ref_repeats: timed runs of the reference (None: the size's ``slow_repeats``).
        full_repeats: timed runs of the full step (None: the size's ``slow_repeats``).
        skip_full: leave out the full step (the encoder is slow on a small CPU).
        batch_size: images per batch for every size (None: each size's own).
        check_images: images in the reference checks (None: each size's own).
        threads: ``torch.set_num_threads`` (None: torch's default).
        seed: seeds the weights and the random data.
        quick: one warm-up and one timed run of everything (smoke tests).
        quiet: no progress lines.
        out: the JSON file; the Markdown table goes beside it (``.md``).
    """

    sizes: list[str] = field(default_factory=lambda: ["shapes", "coco"])
    device: str = "all"
    precisions: list[str] = field(default_factory=lambda: ["fp32", "bf16"])
    compile: bool = False
    repeats: int = 5
    warmup: int = 1
    ref_repeats: int | None = None
    full_repeats: int | None = None
    skip_full: bool = False
    batch_size: int | None = None
    check_images: int | None = None
    threads: int | None = None
    seed: int = 0
    quick: bool = False
    quiet: bool = False
    out: str = "runs/bench/bench.json"


def _validate(options: BenchOptions) -> None:
    unknown = [s for s in options.sizes if s not in SIZES]
    if unknown or not options.sizes:
        raise CaptioningError(f"--sizes must name some of {', '.join(SIZES)}; got {unknown}")
    bad = [p for p in options.precisions if p not in ("fp32", "bf16")]
    if bad or not options.precisions:
        raise CaptioningError(f"--precisions must name fp32 and/or bf16; got {bad}")
    counts = {
        "--repeats": options.repeats,
        "--ref-repeats": options.ref_repeats,
        "--full-repeats": options.full_repeats,
        "--batch-size": options.batch_size,
        "--check-images": options.check_images,
        "--threads": options.threads,
    }
    for flag, value in counts.items():
        if value is not None and value < 1:
            raise CaptioningError(f"{flag} must be at least 1, got {value}")
    if options.warmup < 0:
        raise CaptioningError(f"--warmup must be at least 0, got {options.warmup}")


def resolve_devices(name: str) -> list[torch.device]:
    """``cpu``, ``cuda`` or ``all`` → the devices to benchmark."""
    cuda = torch.cuda.is_available()
    if name == "cpu":
        return [torch.device("cpu")]
    if name == "cuda":
        if not cuda:
            raise CaptioningError("--device cuda but CUDA is not available; use cpu or all")
        return [torch.device("cuda")]
    if name == "all":
        return [torch.device("cpu")] + ([torch.device("cuda")] if cuda else [])
    raise CaptioningError(f"--device must be cpu, cuda or all, got {name!r}")


# --------------------------------------------------------------------------- environment


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _proc_status_mb(key: str) -> float | None:
    """A kB field of /proc/self/status (VmRSS, VmHWM) in MiB, or None without /proc."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def _reset_rss_peak() -> bool:
    """Reset VmHWM to the current resident set (Linux: ``echo 5 > /proc/self/clear_refs``)."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return False
    return True


def _release_free_memory() -> None:
    """Hand freed heap pages back to the system (glibc ``malloc_trim``), so that the next
    measurement's peak is not hidden in pages an earlier one left resident."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _ru_maxrss_mb() -> float:
    import resource

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / 2**20 if sys.platform == "darwin" else peak / 1024  # bytes there, kB here


CPU_MEMORY_METHODS = {
    "vmhwm": "peak resident set (VmHWM, reset by /proc/self/clear_refs after malloc_trim) "
    "minus VmRSS before",
    "ru_maxrss": "growth of ru_maxrss (the process's lifetime peak): a lower bound, often 0",
}


def _cpu_memory_method() -> str:
    return "vmhwm" if _proc_status_mb("VmHWM") is not None and _reset_rss_peak() else "ru_maxrss"


class PeakMemory:
    """Peak memory above the memory in use when :meth:`start` ran, in MiB.

    Args:
        device: CUDA counts tensors (``max_memory_allocated``); CPU counts the resident set
            of the whole process (see the module notes).
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.method = "cuda" if device.type == "cuda" else _cpu_memory_method()
        self.before = 0.0

    def start(self) -> None:
        if self.method == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self.before = torch.cuda.memory_allocated(self.device) / 2**20
        elif self.method == "vmhwm":
            _release_free_memory()
            _reset_rss_peak()
            self.before = _proc_status_mb("VmRSS") or 0.0
        else:
            self.before = _ru_maxrss_mb()

    def stop(self) -> tuple[float, float]:
        """(peak above the start, absolute peak) in MiB."""
        if self.method == "cuda":
            torch.cuda.synchronize(self.device)
            peak = torch.cuda.max_memory_allocated(self.device) / 2**20
        elif self.method == "vmhwm":
            peak = _proc_status_mb("VmHWM") or 0.0
        else:
            peak = _ru_maxrss_mb()
        return max(peak - self.before, 0.0), peak


def environment(devices: list[torch.device]) -> dict[str, Any]:
    """Versions, hardware and threads of this run."""
    cuda = any(d.type == "cuda" for d in devices)
    return {
        "torch": torch.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu": _cpu_model(),
        "cpu_count": os.cpu_count(),
        "threads": torch.get_num_threads(),
        "cuda": torch.version.cuda,
        "gpu": torch.cuda.get_device_name(0) if cuda else None,
        "devices": [d.type for d in devices],
        "cpu_memory": CPU_MEMORY_METHODS[_cpu_memory_method()],
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
    }


# --------------------------------------------------------------------------- data


def random_batch(size: BenchSize, model: Captioner, seed: int) -> dict[str, torch.Tensor]:
    """Random ``features`` (B, L, D), uint8 ``images`` (B, 3, S, S) and caption ``tokens``
    (B, T): ``<start>``, random words, ``<end>``."""
    generator = torch.Generator().manual_seed(seed)
    encoder = model.encoder
    batch, side = size.batch_size, encoder.image_size
    features = torch.randn(
        batch, encoder.num_cells, encoder.out_channels, generator=generator
    )  # (B, L, D)
    images = torch.randint(
        0, 256, (batch, 3, side, side), dtype=torch.uint8, generator=generator
    )  # (B, 3, S, S)
    tokens = torch.randint(
        len(SPECIALS), size.vocab_size, (batch, size.caption_length), generator=generator
    )  # (B, T)
    tokens[:, 0] = Vocabulary.start_id
    tokens[:, -1] = Vocabulary.end_id
    return {"features": features, "images": images, "tokens": tokens}


# --------------------------------------------------------------------------- checks


def check_reference(
    decoder: Decoder,
    features: torch.Tensor,
    tokens: torch.Tensor,
    max_length: int,
    device: torch.device,
) -> dict[str, Any]:
    """Ours against the reference on ``features`` (B, L, D) and ``tokens`` (B, T): the
    largest teacher-forced logit difference (fp32), and per decoding task the share of
    identical captions (fp64), with random weights and with ``<end>`` raised until about
    half of our captions end (:func:`end_biased`, per task)."""
    decoder = copy.deepcopy(decoder).to(device).eval()
    features, tokens = features.to(device), tokens.to(device)
    with torch.no_grad():
        ours = decoder(features, tokens[:, :-1]).logits  # (B, T-1, V)
        reference = ReferenceDecoder(decoder)(features, tokens[:, :-1]).logits
    logits_diff = float((ours - reference).abs().max())

    # fp64: batched and per-image arithmetic then agree to ~1e-15, far below any real gap
    # between two candidates, so a difference in captions is a difference in the search.
    decoder, features = decoder.double(), features.double()
    captions: dict[str, dict[str, dict[str, float]]] = {"random": {}, "end_biased": {}}
    for task, (ours_fn, reference_fn) in DECODERS.items():
        ours_decode = partial(ours_fn, max_length=max_length)
        biased, quantile = end_biased(decoder, features, tokens, ours_decode, max_length)
        for setting, weights in (("random", decoder), ("end_biased", biased)):
            a = ours_decode(weights, features)
            b = reference_fn(ReferenceDecoder(weights), features, max_length=max_length)
            equal = captions_equal(a, b)
            captions[setting][task] = {
                "equal_share": sum(equal) / len(equal),
                "score_max_abs_diff": float((a.scores.double() - b.scores.double()).abs().max()),
                "ended_share": float((a.lengths < max_length).float().mean()),
                "mean_length": float(a.lengths.float().mean()),
            }
        captions["end_biased"][task]["end_bias_quantile"] = quantile
    passed = logits_diff <= LOGITS_TOLERANCE and all(
        result["equal_share"] == 1.0 and result["score_max_abs_diff"] <= SCORE_TOLERANCE
        for tasks in captions.values()
        for result in tasks.values()
    )
    return {
        "images": int(features.shape[0]),
        "logits_max_abs_diff": logits_diff,
        "logits_tolerance": LOGITS_TOLERANCE,
        "captions": captions,
        "passed": passed,
    }


# --------------------------------------------------------------------------- timing


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _train_step(
    forward: Callable[[], DecoderOutput],
    targets: torch.Tensor,
    optimizer: torch.optim.Optimizer,
    device: torch.device,
    precision: str,
    grad_clip: float,
) -> None:
    """One optimisation step as ``train_one_epoch`` takes it (minus bookkeeping)."""
    optimizer.zero_grad(set_to_none=True)
    with autocast(device, precision):
        output = forward()
    loss = caption_loss(output, targets, Vocabulary.pad_id).total
    loss.backward()
    params = [p for group in optimizer.param_groups for p in group["params"]]
    torch.nn.utils.clip_grad_norm_(params, grad_clip)
    optimizer.step()


def _decode(
    fn: Callable[..., Decoded],
    decoder: Any,
    features: torch.Tensor,
    max_length: int,
    device: torch.device,
    precision: str,
) -> Decoded:
    """Timed decoding runs every caption to ``max_length`` words (``<end>`` is masked through
    ``min_length``): random weights end captions after 2 words at one size and never at
    another, and the work must not depend on that."""
    with torch.no_grad(), autocast(device, precision):
        return fn(decoder, features, max_length=max_length, min_length=max_length)


class _CompiledStep:
    """What decoding calls on a decoder (prepare, init_state, step), with ``step`` compiled."""

    def __init__(self, decoder: Decoder) -> None:
        self.prepare = decoder.prepare
        self.init_state = decoder.init_state
        self.step = torch.compile(decoder.step)


@dataclass
class _Job:
    """One measurement: ``make`` builds the timed callable (copies weights, compiles)."""

    task: str
    impl: str  # ours | reference
    make: Callable[[], Callable[[], Any]]
    repeats: int
    words: int | None  # teacher-forced words per call; None counts the decoded words


def _jobs(
    size: BenchSize,
    model: Captioner,
    batch: dict[str, torch.Tensor],
    device: torch.device,
    precision: str,
    compiled: bool,
    options: BenchOptions,
) -> list[_Job]:
    """The measurements of one (size, device, precision, compiled) variant: for each task
    the reference first (uncompiled variants only), then ours."""
    cfg = size.config
    features, images, tokens = batch["features"], batch["images"], batch["tokens"]
    inputs, targets = tokens[:, :-1], tokens[:, 1:]  # (B, T-1) each
    words = int(targets.numel())
    repeats, slow = _repeats(size, options)
    max_length = cfg.decode.max_length
    grad_clip = cfg.train.grad_clip if cfg.train.grad_clip > 0 else float("inf")

    def decoder_step(reference: bool) -> Callable[[], Any]:
        decoder = copy.deepcopy(model.decoder).train()
        forward: nn.Module = ReferenceDecoder(decoder) if reference else decoder
        if compiled:
            forward = torch.compile(forward)
        optimizer = torch.optim.Adam(decoder.parameters(), lr=cfg.train.lr)
        return partial(_train_step, lambda: forward(features, inputs), targets, optimizer,
                       device, precision, grad_clip)  # fmt: skip

    def full_step() -> Callable[[], Any]:
        captioner = copy.deepcopy(model).train()
        forward = torch.compile(captioner) if compiled else captioner
        optimizer = build_optimizer(captioner, cfg)
        return partial(_train_step, lambda: forward(images, tokens), targets, optimizer,
                       device, precision, grad_clip)  # fmt: skip

    def decode(task: str, reference: bool) -> Callable[[], Any]:
        ours_fn, reference_fn = DECODERS[task]
        decoder = model.decoder.eval()
        if reference:
            return partial(_decode, reference_fn, ReferenceDecoder(decoder), features,
                           max_length, device, precision)  # fmt: skip
        target = _CompiledStep(decoder) if compiled else decoder
        return partial(_decode, ours_fn, target, features, max_length, device, precision)

    jobs = []
    if not compiled:
        jobs.append(_Job("decoder_step", "reference", partial(decoder_step, True), slow, words))
    jobs.append(_Job("decoder_step", "ours", partial(decoder_step, False), repeats, words))
    if not options.skip_full:
        full = options.full_repeats or slow
        jobs.append(_Job("full_step", "ours", full_step, 1 if options.quick else full, words))
    for task in DECODERS:
        if not compiled:
            jobs.append(_Job(task, "reference", partial(decode, task, True), slow, None))
        jobs.append(_Job(task, "ours", partial(decode, task, False), repeats, None))
    return jobs


def _repeats(size: BenchSize, options: BenchOptions) -> tuple[int, int]:
    """(repeats of ours, repeats of the reference)."""
    if options.quick:
        return 1, 1
    slow = options.ref_repeats or min(size.slow_repeats or options.repeats, options.repeats)
    return options.repeats, slow


def _first_lines(exc: BaseException) -> str:
    """The error in one line: compiler errors put the cause on their second or third line."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()][:3]
    return f"{type(exc).__name__}: {' / '.join(lines)}"[:300]


def measure(job: _Job, warmup: int, device: torch.device) -> tuple[dict[str, Any], Decoded | None]:
    """Time ``job``: ``warmup`` untimed runs, then ``job.repeats`` timed ones. A failure
    (a compiler that is missing, an unsupported op) is recorded, not raised."""
    memory = PeakMemory(device)
    warm_times: list[float] = []
    times: list[float] = []
    result = None
    error = None
    memory.start()
    try:
        fn = job.make()
        for runs in (warm_times, times):
            for _ in range(warmup if runs is warm_times else job.repeats):
                start = time.perf_counter()
                result = fn()
                _synchronize(device)
                runs.append(time.perf_counter() - start)
    except Exception as exc:  # recorded in the results; the benchmark goes on
        error = _first_lines(exc)
        logger.warning("%s %s failed: %s", job.task, job.impl, error)
    fn = None  # drop the copies before the next measurement
    peak_delta, peak = memory.stop()
    median = statistics.median(times) if times and error is None else None
    decoded = result if isinstance(result, Decoded) and error is None else None
    words = job.words if job.words is not None else (
        int(decoded.lengths.sum()) if decoded is not None else None
    )  # fmt: skip
    return {
        "task": job.task,
        "impl": job.impl,
        "warmup_seconds": warm_times,
        "seconds": times,
        "median_s": median,
        "images_per_s": None,
        "tokens_per_s": words / median if median and words is not None else None,
        "peak_memory_mb": peak_delta if error is None else None,
        "peak_memory_total_mb": peak if error is None else None,
        "error": error,
    }, decoded


def speedups(measurements: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Ours against the reference of the same size, device, precision and task (the
    uncompiled reference for compiled variants): reference time / our time."""
    references = {
        (m["size"], m["device"], m["precision"], m["task"]): m
        for m in measurements
        if m["impl"] == "reference" and m["median_s"]
    }
    ratios = []
    for m in measurements:
        key = (m["size"], m["device"], m["precision"], m["task"])
        if m["impl"] != "ours" or not m["median_s"] or key not in references:
            continue
        speedup = references[key]["median_s"] / m["median_s"]
        target = TARGETS.get((m["size"], m["device"], m["task"]))
        ratios.append({
            "size": m["size"], "device": m["device"], "precision": m["precision"],
            "compiled": m["compiled"], "task": m["task"], "speedup": speedup,
            "target": target, "target_met": None if target is None else speedup >= target,
        })  # fmt: skip
    return ratios


# --------------------------------------------------------------------------- run


def run_benchmark(options: BenchOptions) -> dict[str, Any]:
    """Check and time every size, device, precision and compile setting of ``options``;
    write the JSON file and the Markdown table beside it; return the results."""
    _validate(options)
    if options.threads:
        torch.set_num_threads(options.threads)
    devices = resolve_devices(options.device)
    warmup = 1 if options.quick else options.warmup
    compile_modes = [False, True] if options.compile else [False]
    results: dict[str, Any] = {
        "environment": environment(devices),
        "settings": dataclasses.asdict(options) | {"warmup": warmup},
        "sizes": {},
        "checks": [],
        "measurements": [],
    }
    for name in options.sizes:
        size = SIZES[name]()
        if options.batch_size:
            size = dataclasses.replace(size, batch_size=options.batch_size)
        torch.manual_seed(options.seed)
        model = build_model(size.config.model, size.vocab_size)
        batch = random_batch(size, model, options.seed)
        results["sizes"][name] = _describe(size, model)
        checked = options.check_images or size.check_images or size.batch_size
        for device in devices:
            _progress(options, "%s %s: checking ours against the reference on %d images",
                      name, device.type, min(checked, size.batch_size))  # fmt: skip
            check = check_reference(model.decoder, batch["features"][:checked],
                                    batch["tokens"][:checked], size.config.decode.max_length,
                                    device)  # fmt: skip
            results["checks"].append({"size": name, "device": device.type, **check})
            if not check["passed"]:
                logger.warning("%s %s: ours and the reference disagree: %s", name,
                               device.type, json.dumps(check["captions"]))  # fmt: skip
            results["measurements"] += _time_device(size, model, batch, device, warmup,
                                                    compile_modes, options)  # fmt: skip
    results["speedups"] = speedups(results["measurements"])
    results["passed"] = all(check["passed"] for check in results["checks"])
    _write(results, Path(options.out))
    return results


def _time_device(
    size: BenchSize,
    model: Captioner,
    batch: dict[str, torch.Tensor],
    device: torch.device,
    warmup: int,
    compile_modes: list[bool],
    options: BenchOptions,
) -> list[dict[str, Any]]:
    model = model if device.type == "cpu" else copy.deepcopy(model).to(device)
    batch = {key: value.to(device) for key, value in batch.items()}
    rows = []
    for precision in options.precisions:
        reference_captions: dict[str, Decoded] = {}
        for compiled in compile_modes:
            jobs = _jobs(size, model, batch, device, precision, compiled, options)
            for job in jobs:
                impl = "ours (compiled)" if compiled and job.impl == "ours" else job.impl
                label = f"{size.name} {device.type} {precision} {job.task} {impl}"
                _progress(options, "%s: %d + %d runs", label, warmup, job.repeats)
                row, decoded = measure(job, warmup, device)
                row = {"size": size.name, "device": device.type, "precision": precision,
                       "compiled": compiled, **row}  # fmt: skip
                if row["median_s"]:
                    row["images_per_s"] = size.batch_size / row["median_s"]
                    _progress(options, "%s: median %.4g s", label, row["median_s"])
                if job.task == "full_step":
                    row["fine_tune"] = size.config.model.fine_tune
                if decoded is not None and job.impl == "reference":
                    reference_captions[job.task] = decoded
                elif decoded is not None and job.task in reference_captions:
                    # informational: in fp32/bf16 batched and per-image arithmetic differ
                    # in the last bits, which can flip a near-tie
                    equal = captions_equal(decoded, reference_captions[job.task])
                    row["captions_agree_with_reference"] = sum(equal) / len(equal)
                rows.append(row)
    return rows


def _describe(size: BenchSize, model: Captioner) -> dict[str, Any]:
    return {
        "model": config_to_dict(size.config)["model"],
        "grid": list(model.encoder.grid),
        "feature_dim": model.encoder.out_channels,
        "vocab_size": size.vocab_size,
        "caption_length": size.caption_length,
        "batch_size": size.batch_size,
        "max_length": size.config.decode.max_length,
        "decoder_parameters": sum(p.numel() for p in model.decoder.parameters()),
        "encoder_parameters": sum(p.numel() for p in model.encoder.parameters()),
    }


def _progress(options: BenchOptions, message: str, *args: object) -> None:
    if not options.quiet:
        logger.info("bench " + message, *args)


# --------------------------------------------------------------------------- output


def _number(value: float | None, digits: int = 3) -> str:
    if value is None:
        return "–"
    return f"{value:.{digits}g}" if abs(value) < 10**digits else f"{value:,.0f}"


def format_markdown(results: dict[str, Any]) -> str:
    """The environment, the checks and every measurement as Markdown tables."""
    env = results["environment"]
    lines = [
        "# Benchmark",
        "",
        f"torch {env['torch']}, Python {env['python']}, CPU {env['cpu']} "
        f"({env['threads']} threads of {env['cpu_count']} cores), GPU {env['gpu'] or 'none'}.",
        "",
        "## Ours against the reference",
        "",
        "Teacher-forced logits in fp32; captions in fp64, with random weights and with "
        "`<end>` raised (share of captions that ended: ours).",
        "",
        "| size | device | images | logits max diff | task | same captions (random) "
        "| same captions (end raised) | ended (random / end raised) | passed |",
        "|" + " --- |" * 9,
    ]
    for check in results["checks"]:
        captions = check["captions"]
        for task in DECODERS:
            random, biased = captions["random"][task], captions["end_biased"][task]
            lines.append(
                f"| {check['size']} | {check['device']} | {check['images']} "
                f"| {check['logits_max_abs_diff']:.2g} | {TASK_LABELS[task]} "
                f"| {random['equal_share']:.2f} | {biased['equal_share']:.2f} "
                f"| {random['ended_share']:.2f} / {biased['ended_share']:.2f} "
                f"| {'yes' if check['passed'] else 'NO'} |"
            )
    ratios = {
        (r["size"], r["device"], r["precision"], r["compiled"], r["task"]): r
        for r in results["speedups"]
    }
    lines += [
        "",
        "## Timings",
        "",
        "Medians. Decoding runs every caption to its size's max_length (`<end>` masked), so "
        "the work does not depend on the random weights. words/s counts teacher-forced words "
        "(training) or the words of the returned captions (decoding). Peak MB: above the "
        "memory in use before the measurement; for training steps it includes the copy of "
        f"the weights, gradients and Adam's state (CPU: {env['cpu_memory']}).",
        "",
        "| size | device | precision | task | impl | median s | images/s | words/s | peak MB "
        "| speed-up | target | note |",
        "|" + " --- |" * 12,
    ]
    for m in results["measurements"]:
        key = (m["size"], m["device"], m["precision"], m["compiled"], m["task"])
        ratio = ratios.get(key) if m["impl"] == "ours" else None
        target = "–"
        if ratio and ratio["target"] is not None:
            met = "met" if ratio["target_met"] else "not met"
            target = f"≥{ratio['target']:g}x {met}"
        task = TASK_LABELS[m["task"]]
        if m["task"] == "full_step":
            frozen = ", frozen encoder under no_grad" if m["fine_tune"] == "none" else ""
            task += f" (fine_tune={m['fine_tune']}{frozen})"
        notes = []
        if m.get("captions_agree_with_reference") is not None:
            notes.append(f"same captions as reference: {m['captions_agree_with_reference']:.2f}")
        if m["error"]:
            notes.append(m["error"].replace("|", "/"))
        impl = "ours (compiled)" if m["compiled"] else m["impl"]
        speedup = f"{ratio['speedup']:.1f}x" if ratio else "–"
        lines.append(
            f"| {m['size']} | {m['device']} | {m['precision']} | {task} | {impl} "
            f"| {_number(m['median_s'])} | {_number(m['images_per_s'])} "
            f"| {_number(m['tokens_per_s'])} | {_number(m['peak_memory_mb'])} "
            f"| {speedup} | {target} "
            f"| {'; '.join(notes)} |"
        )
    return "\n".join(lines) + "\n"


def _write(results: dict[str, Any], out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2) + "\n")
    out.with_suffix(".md").write_text(format_markdown(results))


def main(argv: Sequence[str] | None = None) -> int:
    """``python tools/bench.py [args]``: the ``captioning bench`` verb, whose arguments are
    parsed in :mod:`captioning.cli` like every other verb's."""
    from captioning.cli import main as cli_main

    return cli_main(["bench", *(sys.argv[1:] if argv is None else argv)])
