"""Caption generation: pure functions over :meth:`Decoder.step`.

Every strategy takes grid features (B, L, D), decodes the whole batch at once, and returns a
:class:`Decoded` with token ids, per-word attention maps and scores (and, from the models
that have them, each word's chosen cell, heads' maps or local centre).
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from captioning.config import DecodeConfig
from captioning.models.attention import AttentionOutput, HardContext
from captioning.models.decoder import Decoder
from captioning.vocab import Vocabulary


@dataclass
class Decoded:
    """Generated captions for a batch.

    Attributes:
        tokens: (B, T) word ids; ``<end>`` excluded, ``<pad>`` after the caption.
        lengths: (B,) number of words in each caption.
        alphas: (B, T, L) the attention map that produced each word.
        scores: (B,) total log-probability of each caption (``<end>`` included).
        cells: (B, T) the cell chosen at each word by a hard-attention model, else None.
        heads: (B, T, H, L) each head's map at each word (multi-head attention; ``alphas``
            is their mean), else None.
        centres: (B, T, 2) local attention's predicted centre at each word (row, column, in
            cells; cell centres are at index + 0.5), else None.
    """

    tokens: torch.Tensor
    lengths: torch.Tensor
    alphas: torch.Tensor
    scores: torch.Tensor
    cells: torch.Tensor | None = None
    heads: torch.Tensor | None = None
    centres: torch.Tensor | None = None

    def captions(self, vocab: Vocabulary) -> list[str]:
        return [vocab.decode(row[:n].tolist()) for row, n in zip(self.tokens, self.lengths)]

    def row(self, index: int) -> Decoded:
        """Image ``index`` alone, on the CPU: tokens (T,), lengths (), alphas (T, L) in fp32,
        scores (), cells (T,), heads (T, H, L) and centres (T, 2) in fp32, or None."""

        def fp32(values: torch.Tensor | None) -> torch.Tensor | None:
            return None if values is None else values[index].float().cpu()

        return Decoded(
            tokens=self.tokens[index].cpu(),
            lengths=self.lengths[index].cpu(),
            alphas=fp32(self.alphas),
            scores=self.scores[index].cpu(),
            cells=None if self.cells is None else self.cells[index].cpu(),
            heads=fp32(self.heads),
            centres=fp32(self.centres),
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
def _step_by_step(
    decoder: Decoder,
    features: torch.Tensor,
    choose,
    max_length: int,
    min_length: int,
    suppress_unk: bool,
    hard_context: str,
) -> Decoded:
    """Greedy or sampled decoding: ``choose(log_probs (B, V)) -> ids (B,)``."""
    batch = features.shape[0]
    keys = decoder.prepare(features)  # (B, L, K)
    state = decoder.init_state(features)
    tokens = torch.full((batch,), Vocabulary.start_id, device=features.device)
    finished = torch.zeros(batch, dtype=torch.bool, device=features.device)
    lengths = torch.zeros(batch, dtype=torch.long, device=features.device)
    scores = torch.zeros(batch, device=features.device)
    words, alphas, cells, heads, centres = [], [], [], [], []
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
        alphas.append(out.attention.alpha)
        if out.attention.cell is not None:
            cells.append(out.attention.cell)
        if out.attention.heads is not None:
            heads.append(out.attention.heads)
        if out.attention.centre is not None:
            centres.append(out.attention.centre)
        finished |= ended
        state = out.state
        if bool(finished.all()):
            break
    return Decoded(
        tokens=torch.stack(words, dim=1),  # (B, T)
        lengths=lengths,
        alphas=torch.stack(alphas, dim=1),  # (B, T, L)
        scores=scores,
        cells=torch.stack(cells, dim=1) if cells else None,
        heads=torch.stack(heads, dim=1) if heads else None,  # (B, T, H, L)
        centres=torch.stack(centres, dim=1) if centres else None,  # (B, T, 2)
    )


def greedy_decode(
    decoder: Decoder,
    features: torch.Tensor,
    max_length: int = 20,
    min_length: int = 1,
    suppress_unk: bool = False,
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
    suppress_unk: bool = False,
    temperature: float = 1.0,
    top_k: int = 0,
    hard_context: str = "expectation",
    generator: torch.Generator | None = None,
) -> Decoded:
    """Words drawn from the softmax at ``temperature``, optionally from the ``top_k`` only."""

    def choose(log_probs: torch.Tensor) -> torch.Tensor:
        scaled = log_probs / max(temperature, 1e-6)
        if top_k > 0:
            kth = scaled.topk(min(top_k, scaled.shape[1]), dim=1).values[:, -1:]
            scaled = scaled.masked_fill(scaled < kth, float("-inf"))
        probs = torch.softmax(scaled, dim=1)
        return torch.multinomial(probs, 1, generator=generator).squeeze(1)

    return _step_by_step(
        decoder, features, choose, max_length, min_length, suppress_unk, hard_context
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


@dataclass(frozen=True)
class _WordRecord:
    """What beam search keeps of each word besides its token: the attention map (L values)
    and, from a model that has them, its heads' maps (H * L) and its local centre (2), side
    by side in one vector of W values. The search then moves one tensor through parent
    selection, finished captions and answers, whatever the model reports; a model with
    neither keeps the plain map (W = L) and pays nothing.

    Attributes:
        cells: L.
        heads: H, or 0 without multi-head weights.
        centre: whether each word has a centre.
    """

    cells: int
    heads: int = 0
    centre: bool = False

    @classmethod
    def of(cls, attention: AttentionOutput) -> _WordRecord:
        """The layout of what one step's ``attention`` reports."""
        heads = 0 if attention.heads is None else attention.heads.shape[1]
        return cls(attention.alpha.shape[1], heads, attention.centre is not None)

    @property
    def width(self) -> int:
        """W, the values kept per word."""
        return self.cells * (1 + self.heads) + (2 if self.centre else 0)

    def pack(self, attention: AttentionOutput) -> torch.Tensor:
        """One step's record of each row: (R, W)."""
        if self.width == self.cells:
            return attention.alpha  # (R, L)
        parts = [attention.alpha]
        if self.heads:
            parts.append(attention.heads.flatten(1).to(attention.alpha.dtype))  # (R, H*L)
        if self.centre:
            parts.append(attention.centre.to(attention.alpha.dtype))  # (R, 2)
        return torch.cat(parts, dim=1)  # (R, W)

    def unpack(
        self, maps: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """Records (B, T, W) → alphas (B, T, L), heads (B, T, H, L) or None, centres
        (B, T, 2) or None."""
        batch, steps, _ = maps.shape
        alphas = maps[..., : self.cells]  # (B, T, L)
        end = self.cells * (1 + self.heads)
        heads = None
        if self.heads:
            heads = maps[..., self.cells : end].reshape(batch, steps, self.heads, self.cells)
        centres = maps[..., end : end + 2] if self.centre else None  # (B, T, 2)
        return alphas, heads, centres


@dataclass
class _Search:
    """Beam search state of the b images still searching, with n live beams each.

    Attributes:
        image: (b,) their rows in the batch.
        scores: (b, n) log-probabilities of the live beams.
        words: (b, n, t) the live beams' words so far.
        maps: (b, n, t, W) what each of those words records (see :class:`_WordRecord`):
            its attention map (W = L), or the map and its extras side by side.
        cells: (b, n, t) the cell chosen for each word (hard attention; else unused).
        best: (b,) normalised score of the best finished caption, -inf while there is none.
        best_raw: (b,) its log-probability.
        best_words: (b, T) its words, ``<pad>`` after them.
        best_maps: (b, T, W) its words' records, ``<end>``'s included.
        best_cells: (b, T) its chosen cells.
        best_length: (b,) its number of words.
    """

    image: torch.Tensor
    scores: torch.Tensor
    words: torch.Tensor
    maps: torch.Tensor
    cells: torch.Tensor
    best: torch.Tensor
    best_raw: torch.Tensor
    best_words: torch.Tensor
    best_maps: torch.Tensor
    best_cells: torch.Tensor
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
            cells=full(batch, 1, 0, dtype=torch.long),
            best=full(batch, fill=float("-inf")),
            best_raw=full(batch),
            best_words=full(batch, max_length, fill=Vocabulary.pad_id, dtype=torch.long),
            best_maps=full(batch, max_length, width),
            best_cells=full(batch, max_length, dtype=torch.long),
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
        cells: torch.Tensor | None,
    ) -> None:
        """Make a caption the answer of the images in ``mask`` (b,): its log-probability
        ``raw`` (b,), ``length`` words ``words`` (b, t), word records ``maps`` (b, t', W) and
        chosen ``cells`` (b, t') (None without hard attention)."""
        max_length = self.best_words.shape[1]
        self.best_raw = torch.where(mask, raw, self.best_raw)
        self.best_length = torch.where(
            mask, torch.full_like(self.best_length, length), self.best_length
        )
        self.best_words = _keep(mask, _slots(words, max_length, Vocabulary.pad_id), self.best_words)
        self.best_maps = _keep(mask, _slots(maps, max_length, 0.0), self.best_maps)
        if cells is not None:
            self.best_cells = _keep(mask, _slots(cells, max_length, 0), self.best_cells)

    def finish(
        self,
        top: _Candidates,
        norm: torch.Tensor,
        step: int,
        step_map: torch.Tensor,
        step_cell: torch.Tensor | None,
    ) -> None:
        """Keep, per image, the best of this step's candidates that end (scored by ``norm``
        (b, 2K), the length-normalised log-probability) if it beats its finished pool. The
        caption is the words before ``<end>``; the maps (cells) include ``<end>``'s, from
        ``step_map`` (b, n, W) and ``step_cell`` (b, n)."""
        norm = torch.where(top.ended, norm, float("-inf"))
        cand_score, cand_rank = norm.max(dim=1)  # (b,)
        better = cand_score > self.best
        if not bool(better.any()):
            return
        rows = top.rows
        beam = top.beam[rows, cand_rank]  # (b,)
        self.best = torch.where(better, cand_score, self.best)
        cells = None
        if step_cell is not None:
            cells = torch.cat([self.cells[rows, beam], step_cell[rows, beam, None]], dim=1)
        self.record(
            better,
            top.scores[rows, cand_rank],
            step,
            self.words[rows, beam],
            torch.cat([self.maps[rows, beam], step_map[rows, beam, None]], dim=1),
            cells,
        )

    def advance(
        self,
        top: _Candidates,
        beam_size: int,
        step_map: torch.Tensor,
        step_cell: torch.Tensor | None,
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
            [self.maps.gather(1, parent[:, :, None, None].expand(-1, -1, steps, width)),
             parent_map.unsqueeze(2)], dim=2)  # fmt: skip
        if step_cell is not None:
            self.cells = torch.cat(
                [self.cells.gather(1, by_parent), step_cell.gather(1, parent).unsqueeze(2)],
                dim=2,
            )
        return parent, tokens.view(-1)

    def settle(self, out: Decoded) -> None:
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
                self.cells[rows, beam] if out.cells is not None else None,
            )
        out.tokens[self.image] = self.best_words
        out.lengths[self.image] = self.best_length
        out.alphas[self.image] = self.best_maps
        out.scores[self.image] = self.best_raw
        if out.cells is not None:
            out.cells[self.image] = self.best_cells


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
def beam_search(
    decoder: Decoder,
    features: torch.Tensor,
    beam_size: int = 3,
    max_length: int = 20,
    min_length: int = 1,
    length_penalty: float = 0.0,
    suppress_unk: bool = False,
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

    Returns the best caption per image with the attention map of each word (and its heads'
    maps, local centre or chosen cell, for the models that have them) and its total
    log-probability.
    """
    batch, device = features.shape[0], features.device
    # The grid and its keys stay one copy per image: the step scores the beams of an image
    # against it as a group. The search starts from one live beam per image, so the first
    # step runs B rows, not B*K identical ones.
    keys = decoder.prepare(features)  # (B, L, A)
    state = decoder.init_state(features)  # (B, H)
    tokens = torch.full((batch,), Vocabulary.start_id, device=device)
    if max_length < 1:
        raise ValueError(f"max_length must be at least 1, got {max_length}")
    longest_penalty = _length_penalty(torch.tensor(max_length), length_penalty)
    hard = HardContext(mode=hard_context)
    for step in range(max_length):
        out = decoder.step(tokens, state, features, keys, hard)
        if step == 0:  # the first step shows what the model reports per word
            record, search, answer = _begin(out.attention, batch, max_length, device)
        log_probs = torch.log_softmax(out.logits.float(), dim=1)  # (b*n, V)
        log_probs = _mask_logits(log_probs, step, min_length, suppress_unk)
        candidates = _Candidates.top(search, log_probs, beam_size)
        images, live = search.scores.shape
        step_map = record.pack(out.attention).view(images, live, record.width)  # (b, n, W)
        step_cell = None if answer.cells is None else out.attention.cell.view(images, live)
        norm = candidates.scores / _length_penalty(torch.tensor(step + 1), length_penalty)
        search.finish(candidates, norm, step, step_map, step_cell)
        parent, tokens = search.advance(candidates, beam_size, step_map, step_cell)
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
    return _trimmed(answer, record)


def _begin(
    attention: AttentionOutput, batch: int, max_length: int, device: torch.device
) -> tuple[_WordRecord, _Search, Decoded]:
    """What each word records (from the first step's ``attention``), the search with one
    live beam per image, and the answer its images settle into: tokens (B, T), lengths
    (B,), records (B, T, W) in ``alphas``, scores (B,), and cells (B, T) when the model
    chooses them."""
    record = _WordRecord.of(attention)
    search = _Search.start(batch, record.width, max_length, device)
    answer = Decoded(
        tokens=search.best_words.clone(),  # (B, T)
        lengths=search.best_length.clone(),  # (B,)
        alphas=search.best_maps.clone(),  # (B, T, W)
        scores=search.best_raw.clone(),  # (B,)
        cells=None if attention.cell is None else search.best_cells.clone(),  # (B, T)
    )
    return record, search, answer


def _trimmed(answer: Decoded, record: _WordRecord) -> Decoded:
    """The settled ``answer`` cut to its longest caption and that caption's ``<end>``, its
    records split into alphas, heads and centres."""
    width = max(int(answer.lengths.max()) + 1, 1)
    alphas, heads, centres = record.unpack(answer.alphas[:, :width])
    return Decoded(
        tokens=answer.tokens[:, :width],
        lengths=answer.lengths,
        alphas=alphas,  # (B, T, L)
        scores=answer.scores,
        cells=answer.cells[:, :width] if answer.cells is not None else None,
        heads=heads,  # (B, T, H, L) or None
        centres=centres,  # (B, T, 2) or None
    )


def decode(decoder: Decoder, features: torch.Tensor, cfg: DecodeConfig) -> Decoded:
    """Decode with the strategy and settings of ``cfg``."""
    common = dict(
        max_length=cfg.max_length,
        min_length=cfg.min_length,
        suppress_unk=cfg.suppress_unk,
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
