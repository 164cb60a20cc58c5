"""Caption generation: pure functions over :meth:`Decoder.step`.

Every strategy takes grid features (B, L, D), decodes the whole batch at once, and returns a
:class:`Decoded` with token ids, scores and each word's attention record (its map, and
whatever else the model's attention reports: see :mod:`captioning.models.trace`).
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from captioning.config import DecodeConfig
from captioning.data.vocab import Vocabulary
from captioning.models.attention import HardContext
from captioning.models.decoder import Decoder
from captioning.models.packing import packed_weights
from captioning.models.trace import AttentionTrace, TraceLayout


@dataclass
class Decoded:
    """Generated captions for a batch.

    Attributes:
        tokens: (B, T) word ids; ``<end>`` excluded, ``<pad>`` after the caption.
        lengths: (B,) number of words in each caption.
        scores: (B,) total log-probability of each caption (``<end>`` included).
        trace: (B, T, ...) the attention record of each word: ``alpha`` (B, T, L), the map
            that produced it, and the fields the model's attention adds.
    """

    tokens: torch.Tensor
    lengths: torch.Tensor
    scores: torch.Tensor
    trace: AttentionTrace

    @property
    def alphas(self) -> torch.Tensor:
        """(B, T, L) the attention map that produced each word."""
        return self.trace.alpha

    def captions(self, vocab: Vocabulary) -> list[str]:
        return [vocab.decode(row[:n].tolist()) for row, n in zip(self.tokens, self.lengths)]

    def row(self, index: int) -> Decoded:
        """Image ``index`` alone, on the CPU: tokens (T,), lengths (), scores (), and its
        trace (T, ...) with floating fields in fp32."""
        return Decoded(
            tokens=self.tokens[index].cpu(),
            lengths=self.lengths[index].cpu(),
            scores=self.scores[index].cpu(),
            trace=self.trace[index].portable(),
        )


def _mask_logits(
    log_probs: torch.Tensor, step: int, min_length: int, suppress_unk: bool
) -> torch.Tensor:
    if suppress_unk:
        log_probs[:, Vocabulary.unk_id] = float("-inf")
    if step < min_length:
        log_probs[:, Vocabulary.end_id] = float("-inf")
    # <start> and <pad> are never words
    log_probs[:, Vocabulary.start_id] = float("-inf")
    log_probs[:, Vocabulary.pad_id] = float("-inf")
    return log_probs


@torch.no_grad()
@packed_weights()
def _step_by_step(
    decoder: Decoder,
    features: torch.Tensor,
    choose,
    max_length: int,
    min_length: int,
    suppress_unk: bool,
    hard_context: str,
    samples: int = 1,
) -> Decoded:
    """Greedy or sampled decoding: ``choose(log_probs (B, V)) -> ids (B,)``; with
    ``samples`` > 1, that many captions per image (B*samples rows, image-major), the grid
    projected once per image."""
    keys = decoder.prepare(features)  # (B, L, K)
    state = decoder.init_state(features, samples)  # (B*samples, H) each
    features = decoder.word_grid(features)
    batch = state.h.shape[0]
    tokens = torch.full((batch,), Vocabulary.start_id, device=features.device)
    finished = torch.zeros(batch, dtype=torch.bool, device=features.device)
    lengths = torch.zeros(batch, dtype=torch.long, device=features.device)
    scores = torch.zeros(batch, device=features.device)
    words, traces = [], []
    hard = HardContext(mode=hard_context)
    for step in range(max_length):
        out = decoder.step(tokens, state, features, keys, hard)
        log_probs = torch.log_softmax(out.logits.float(), dim=1)  # (B, V)
        log_probs = _mask_logits(log_probs, step, min_length, suppress_unk)
        tokens = choose(log_probs)  # (B,)
        scores += torch.where(finished, 0.0, log_probs.gather(1, tokens[:, None]).squeeze(1))
        ended = tokens == Vocabulary.end_id
        lengths += (~finished & ~ended).long()
        words.append(torch.where(finished | ended, Vocabulary.pad_id, tokens))
        traces.append(out.attention.trace)
        finished |= ended
        state = out.state
        if bool(finished.all()):
            break
    return Decoded(
        tokens=torch.stack(words, dim=1),  # (B, T)
        lengths=lengths,
        scores=scores,
        trace=AttentionTrace.stack(traces, dim=1),  # (B, T, ...)
    )


def greedy_decode(
    decoder: Decoder,
    features: torch.Tensor,
    max_length: int = 20,
    min_length: int = 1,
    suppress_unk: bool = True,
    hard_context: str = "expectation",
) -> Decoded:
    """The most likely word at every step."""
    return _step_by_step(
        decoder,
        features,
        lambda log_probs: log_probs.argmax(dim=1),
        max_length,
        min_length,
        suppress_unk,
        hard_context,
    )


def sample_decode(
    decoder: Decoder,
    features: torch.Tensor,
    max_length: int = 20,
    min_length: int = 1,
    suppress_unk: bool = True,
    temperature: float = 1.0,
    top_k: int = 0,
    hard_context: str = "expectation",
    generator: torch.Generator | None = None,
    samples: int = 1,
) -> Decoded:
    """Words drawn from the softmax at ``temperature``, optionally from the ``top_k`` only;
    ``samples`` captions per image (rows image-major)."""

    def choose(log_probs: torch.Tensor) -> torch.Tensor:
        scaled = log_probs / max(temperature, 1e-6)
        if top_k > 0:
            kth = scaled.topk(min(top_k, scaled.shape[1]), dim=1).values[:, -1:]
            scaled = scaled.masked_fill(scaled < kth, float("-inf"))
        probs = torch.softmax(scaled, dim=1)
        return torch.multinomial(probs, 1, generator=generator).squeeze(1)

    return _step_by_step(
        decoder, features, choose, max_length, min_length, suppress_unk, hard_context, samples
    )


def _slots(prefix: torch.Tensor, max_length: int, fill: float) -> torch.Tensor:
    """(B, n, ...) → (B, max_length, ...): the prefix, then ``fill``."""
    out = prefix.new_full((prefix.shape[0], max_length, *prefix.shape[2:]), fill)
    out[:, : prefix.shape[1]] = prefix
    return out


def _keep(mask: torch.Tensor, new: torch.Tensor, old: torch.Tensor) -> torch.Tensor:
    """Rows of ``new`` where ``mask`` (B,) is set, else rows of ``old``."""
    return torch.where(mask.view(-1, *[1] * (new.dim() - 1)), new, old)


def _length_penalty(length: torch.Tensor, alpha: float) -> torch.Tensor:
    """GNMT's ((5 + |Y|) / 6) ** alpha; 1 when alpha is 0."""
    return ((5.0 + length.float()) / 6.0) ** alpha


@dataclass
class _Search:
    """Beam search state of the b images still searching, with n live beams each.

    Attributes:
        image: (b,) their rows in the batch.
        scores: (b, n) log-probabilities of the live beams.
        words: (b, n, t) the live beams' words so far.
        maps: (b, n, t, W) what each of those words records, its trace's fields side by side
            (see :class:`~captioning.models.trace.TraceLayout`; W = L for a plain map).
        best: (b,) normalised score of the best finished caption, -inf while there is none.
        best_raw: (b,) its log-probability.
        best_words: (b, T) its words, ``<pad>`` after them.
        best_maps: (b, T, W) its words' records, ``<end>``'s included.
        best_length: (b,) its number of words.
    """

    image: torch.Tensor
    scores: torch.Tensor
    words: torch.Tensor
    maps: torch.Tensor
    best: torch.Tensor
    best_raw: torch.Tensor
    best_words: torch.Tensor
    best_maps: torch.Tensor
    best_length: torch.Tensor

    @classmethod
    def start(cls, batch: int, width: int, max_length: int, device: torch.device) -> _Search:
        """Every image with one live beam (all K beams of an image would be the same), and
        ``width`` (W) values recorded per word."""

        def full(*shape: int, fill: float = 0, dtype: torch.dtype = torch.float) -> torch.Tensor:
            return torch.full(shape, fill, dtype=dtype, device=device)

        return cls(
            image=torch.arange(batch, device=device),
            scores=full(batch, 1),
            words=full(batch, 1, 0, dtype=torch.long),
            maps=full(batch, 1, 0, width),
            best=full(batch, fill=float("-inf")),
            best_raw=full(batch),
            best_words=full(batch, max_length, fill=Vocabulary.pad_id, dtype=torch.long),
            best_maps=full(batch, max_length, width),
            best_length=full(batch, dtype=torch.long),
        )

    def take(self, rows: torch.Tensor) -> _Search:
        """The search of images ``rows`` (b',) only."""
        return _Search(
            **{f.name: getattr(self, f.name).index_select(0, rows) for f in fields(self)}
        )

    def record(
        self,
        mask: torch.Tensor,
        raw: torch.Tensor,
        length: int,
        words: torch.Tensor,
        maps: torch.Tensor,
    ) -> None:
        """Make a caption the answer of the images in ``mask`` (b,): its log-probability
        ``raw`` (b,), ``length`` words ``words`` (b, t) and word records ``maps``
        (b, t', W)."""
        max_length = self.best_words.shape[1]
        self.best_raw = torch.where(mask, raw, self.best_raw)
        self.best_length = torch.where(
            mask, torch.full_like(self.best_length, length), self.best_length
        )
        self.best_words = _keep(mask, _slots(words, max_length, Vocabulary.pad_id), self.best_words)
        self.best_maps = _keep(mask, _slots(maps, max_length, 0.0), self.best_maps)

    def finish(
        self,
        top: _Candidates,
        norm: torch.Tensor,
        step: int,
        step_map: torch.Tensor,
    ) -> None:
        """Keep, per image, the best of this step's candidates that end (scored by ``norm``
        (b, 2K), the length-normalised log-probability) if it beats its finished pool. The
        caption is the words before ``<end>``; its records include ``<end>``'s, from
        ``step_map`` (b, n, W)."""
        norm = torch.where(top.ended, norm, float("-inf"))
        cand_score, cand_rank = norm.max(dim=1)  # (b,)
        better = cand_score > self.best
        if not bool(better.any()):
            return
        rows = top.rows
        beam = top.beam[rows, cand_rank]  # (b,)
        self.best = torch.where(better, cand_score, self.best)
        self.record(
            better,
            top.scores[rows, cand_rank],
            step,
            self.words[rows, beam],
            torch.cat([self.maps[rows, beam], step_map[rows, beam, None]], dim=1),
        )

    def advance(
        self,
        top: _Candidates,
        beam_size: int,
        step_map: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The best ``beam_size`` candidates that did not end become the live beams (a stable
        sort keeps score order). Returns their parent beams (b, K) and words (b*K,)."""
        order = torch.sort(top.is_end.float(), dim=1, stable=True).indices[:, :beam_size]
        self.scores = top.scores.gather(1, order)  # (b, K)
        parent = top.beam.gather(1, order)  # (b, K)
        tokens = top.token.gather(1, order)  # (b, K)
        steps, width = self.words.shape[2], step_map.shape[2]
        by_parent = parent[:, :, None].expand(-1, -1, steps)  # (b, K, t)
        self.words = torch.cat([self.words.gather(1, by_parent), tokens.unsqueeze(2)], dim=2)
        parent_map = step_map.gather(1, parent[:, :, None].expand(-1, -1, width))  # (b, K, W)
        self.maps = torch.cat(
            [
                self.maps.gather(1, parent[:, :, None, None].expand(-1, -1, steps, width)),
                parent_map.unsqueeze(2),
            ],
            dim=2,
        )
        return parent, tokens.view(-1)

    def settle(self, out: _Answer) -> None:
        """Write these images' answers into ``out``: the best finished caption, or, for an
        image where none finished, its best live beam, unfinished."""
        unfinished = torch.isinf(self.best)  # (b,)
        if bool(unfinished.any()):
            rows = torch.arange(len(self.image), device=self.image.device)
            beam = self.scores.argmax(dim=1)  # (b,)
            self.record(
                unfinished,
                self.scores[rows, beam],
                self.words.shape[2],
                self.words[rows, beam],
                self.maps[rows, beam],
            )
        out.tokens[self.image] = self.best_words
        out.lengths[self.image] = self.best_length
        out.maps[self.image] = self.best_maps
        out.scores[self.image] = self.best_raw


@dataclass
class _Answer:
    """What beam search's images settle into, in batch order: ``tokens`` (B, T), ``lengths``
    (B,), their words' records ``maps`` (B, T, W) and ``scores`` (B,)."""

    tokens: torch.Tensor
    lengths: torch.Tensor
    maps: torch.Tensor
    scores: torch.Tensor


@dataclass
class _Candidates:
    """One step's best 2K continuations of each of the b searching images.

    Attributes:
        rows: (b,) 0..b-1.
        scores: (b, 2K) their log-probabilities, best first.
        beam: (b, 2K) the live beam each continues.
        token: (b, 2K) the word each adds.
        is_end: (b, 2K) the word is ``<end>``.
        ended: (b, 2K) an ending that counts: among the top K, with a finite score.
    """

    rows: torch.Tensor
    scores: torch.Tensor
    beam: torch.Tensor
    token: torch.Tensor
    is_end: torch.Tensor
    ended: torch.Tensor

    @classmethod
    def top(cls, search: _Search, log_probs: torch.Tensor, beam_size: int) -> _Candidates:
        """The candidates from the live beams' scores and this step's ``log_probs`` (b*n, V)."""
        images, live = search.scores.shape
        vocab = log_probs.shape[1]
        # in place: this step's log-probabilities are not needed apart from the sums
        candidates = log_probs.view(images, live, vocab).add_(search.scores.unsqueeze(2))
        width = min(2 * beam_size, live * vocab)
        scores, index = candidates.view(images, -1).topk(width, dim=1)  # (b, 2K)
        token = index % vocab  # (b, 2K)
        is_end = token == Vocabulary.end_id
        # An ending counts only among the top K, as in the usual formulation: with K = 1
        # this is exactly greedy decoding.
        in_top_k = torch.arange(width, device=scores.device) < beam_size  # (2K,)
        return cls(
            rows=torch.arange(images, device=scores.device),
            scores=scores,
            beam=index // vocab,
            token=token,
            is_end=is_end,
            ended=is_end & in_top_k & torch.isfinite(scores),
        )


@torch.no_grad()
@packed_weights()
def beam_search(
    decoder: Decoder,
    features: torch.Tensor,
    beam_size: int = 3,
    max_length: int = 20,
    min_length: int = 1,
    length_penalty: float = 0.0,
    suppress_unk: bool = True,
    hard_context: str = "expectation",
) -> Decoded:
    """Beam search over all images and beams at once, in one (B * K) batch.

    At each step the best 2K continuations of every image are taken; those that end go to
    that image's finished pool (ranked by log-probability / GNMT length penalty), the best K
    others stay active. Finished beams are masked, never removed one by one. An image's
    search stops when none of its active beams can beat its best finished caption, or at
    ``max_length``; an image with no finished beam returns its best unfinished one.
    Images whose search has stopped leave the batch together, so later steps run only the
    rows still searching. ``beam_size=1`` is greedy.

    Returns the best caption per image with the attention record of each word (its map, and
    what else the model's attention reports) and its total log-probability.
    """
    batch, device = features.shape[0], features.device
    # The grid and its keys stay one copy per image: the step scores the beams of an image
    # against it as a group. The search starts from one live beam per image, so the first
    # step runs B rows, not B*K identical ones.
    keys = decoder.prepare(features)  # (B, L, A)
    state = decoder.init_state(features)  # (B, H)
    features = decoder.word_grid(features)
    tokens = torch.full((batch,), Vocabulary.start_id, device=device)
    if max_length < 1:
        raise ValueError(f"max_length must be at least 1, got {max_length}")
    longest_penalty = _length_penalty(torch.tensor(max_length), length_penalty)
    hard = HardContext(mode=hard_context)
    for step in range(max_length):
        out = decoder.step(tokens, state, features, keys, hard)
        if step == 0:  # the first step shows what the model records per word
            layout, search, answer = _begin(out.attention.trace, batch, max_length, device)
        log_probs = torch.log_softmax(out.logits.float(), dim=1)  # (b*n, V)
        log_probs = _mask_logits(log_probs, step, min_length, suppress_unk)
        candidates = _Candidates.top(search, log_probs, beam_size)
        images, live = search.scores.shape
        step_map = layout.pack(out.attention.trace).view(images, live, layout.width)  # (b, n, W)
        norm = candidates.scores / _length_penalty(torch.tensor(step + 1), length_penalty)
        search.finish(candidates, norm, step, step_map)
        parent, tokens = search.advance(candidates, beam_size, step_map)
        state = out.state.select((candidates.rows[:, None] * live + parent).view(-1))  # (b*K)

        # An image is done when no active beam can still beat its best finished caption:
        # scores only fall as captions grow, and the penalty is largest at max_length.
        done = search.best >= search.scores.max(dim=1).values / longest_penalty  # (b,)
        if bool(done.all()):
            break
        if bool(done.any()):  # the done images leave the batch together
            search.take(done.nonzero().squeeze(1)).settle(answer)
            keep = (~done).nonzero().squeeze(1)  # (b',)
            search = search.take(keep)
            features, keys = features.index_select(0, keep), keys.index_select(0, keep)
            beams = search.scores.shape[1]
            beam_rows = keep[:, None] * beams + torch.arange(beams, device=device)  # (b', K)
            state = state.select(beam_rows.view(-1))
            tokens = tokens.index_select(0, beam_rows.view(-1))
    search.settle(answer)
    return _trimmed(answer, layout)


def _begin(
    first: AttentionTrace, batch: int, max_length: int, device: torch.device
) -> tuple[TraceLayout, _Search, _Answer]:
    """How each word's record lies in W values (from ``first``, the first step's trace),
    the search with one live beam per image, and the answer its images settle into."""
    layout = TraceLayout.of(first)
    search = _Search.start(batch, layout.width, max_length, device)
    answer = _Answer(
        tokens=search.best_words.clone(),  # (B, T)
        lengths=search.best_length.clone(),  # (B,)
        maps=search.best_maps.clone(),  # (B, T, W)
        scores=search.best_raw.clone(),  # (B,)
    )
    return layout, search, answer


def _trimmed(answer: _Answer, layout: TraceLayout) -> Decoded:
    """The settled ``answer`` cut to its longest caption and that caption's ``<end>``, its
    records unpacked into the trace."""
    width = max(int(answer.lengths.max()) + 1, 1)
    return Decoded(
        tokens=answer.tokens[:, :width],
        lengths=answer.lengths,
        scores=answer.scores,
        trace=layout.unpack(answer.maps[:, :width]),  # (B, T, ...)
    )


def decode(decoder: Decoder, features: torch.Tensor, cfg: DecodeConfig) -> Decoded:
    """Decode with the strategy and settings of ``cfg``."""
    common = dict(
        max_length=cfg.max_length,
        min_length=cfg.min_length,
        suppress_unk=not cfg.allow_unk,
        hard_context=cfg.hard_context,
    )
    if cfg.strategy == "greedy":
        return greedy_decode(decoder, features, **common)
    if cfg.strategy == "sample":
        return sample_decode(
            decoder, features, temperature=cfg.temperature, top_k=cfg.top_k, **common
        )
    return beam_search(
        decoder, features, beam_size=cfg.beam_size, length_penalty=cfg.length_penalty, **common
    )
