"""Caption generation: pure functions over :meth:`Decoder.step`.

Every strategy takes grid features (B, L, D), decodes the whole batch at once, and returns a
:class:`Decoded` with token ids, per-word attention maps and scores.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from captioning.config import DecodeConfig
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
    """

    tokens: torch.Tensor
    lengths: torch.Tensor
    alphas: torch.Tensor
    scores: torch.Tensor
    cells: torch.Tensor | None = None

    def captions(self, vocab: Vocabulary) -> list[str]:
        return [vocab.decode(row[:n].tolist()) for row, n in zip(self.tokens, self.lengths)]


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
    hard_mode: str,
) -> Decoded:
    """Greedy or sampled decoding: ``choose(log_probs (B, V)) -> ids (B,)``."""
    batch = features.shape[0]
    keys = decoder.prepare(features)  # (B, L, K)
    state = decoder.init_state(features)
    tokens = torch.full((batch,), Vocabulary.start_id, device=features.device)
    finished = torch.zeros(batch, dtype=torch.bool, device=features.device)
    lengths = torch.zeros(batch, dtype=torch.long, device=features.device)
    scores = torch.zeros(batch, device=features.device)
    words, alphas, cells = [], [], []
    for step in range(max_length):
        out = decoder.step(tokens, state, features, keys, mode=hard_mode)
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
    )


def greedy_decode(
    decoder: Decoder,
    features: torch.Tensor,
    max_length: int = 20,
    min_length: int = 1,
    suppress_unk: bool = False,
    hard_mode: str = "expectation",
) -> Decoded:
    """The most likely word at every step."""
    return _step_by_step(
        decoder,
        features,
        lambda log_probs: log_probs.argmax(dim=1),
        max_length,
        min_length,
        suppress_unk,
        hard_mode,
    )


def sample_decode(
    decoder: Decoder,
    features: torch.Tensor,
    max_length: int = 20,
    min_length: int = 1,
    suppress_unk: bool = False,
    temperature: float = 1.0,
    top_k: int = 0,
    hard_mode: str = "expectation",
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

    return _step_by_step(decoder, features, choose, max_length, min_length, suppress_unk, hard_mode)


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


@torch.no_grad()
def beam_search(
    decoder: Decoder,
    features: torch.Tensor,
    beam_size: int = 3,
    max_length: int = 20,
    min_length: int = 1,
    length_penalty: float = 0.0,
    suppress_unk: bool = False,
    hard_mode: str = "expectation",
) -> Decoded:
    """Beam search over all images and beams at once, in one (B * K) batch.

    At each step the best 2K continuations of every image are taken; those that end go to
    that image's finished pool (ranked by log-probability / GNMT length penalty), the best K
    others stay active. Finished beams are masked, never removed one by one. Search stops
    when no active beam can beat the best finished one, or at ``max_length``; an image
    with no finished beam returns its best unfinished one. ``beam_size=1`` is greedy.

    Returns the best caption per image with the attention map of each word and its total
    log-probability.
    """
    batch, cells, _ = features.shape
    k = beam_size
    device = features.device
    # The grid and its keys stay one copy per image: the step scores the beams of an image
    # against it as a group. The search starts from one live beam per image, so the first
    # step runs B rows, not B*K identical ones.
    keys = decoder.prepare(features)  # (B, L, A)
    state = decoder.init_state(features)  # (B, H)
    tokens = torch.full((batch,), Vocabulary.start_id, device=device)
    beam_scores = torch.zeros(batch, 1, device=device)  # (B, live beams)
    history = torch.zeros(batch, 1, 0, dtype=torch.long, device=device)  # (B, live, t)
    alpha_history = torch.zeros(batch, 1, 0, cells, device=device)  # (B, live, t, L)
    cell_history = torch.zeros(batch, 1, 0, dtype=torch.long, device=device)
    best_score = torch.full((batch,), float("-inf"), device=device)  # normalised
    best_raw = torch.zeros(batch, device=device)
    best_tokens = torch.full((batch, max_length), Vocabulary.pad_id, device=device)
    best_alphas = torch.zeros(batch, max_length, cells, device=device)
    best_cells = torch.zeros(batch, max_length, dtype=torch.long, device=device)
    best_length = torch.zeros(batch, dtype=torch.long, device=device)
    rows = torch.arange(batch, device=device)
    hard = False
    for step in range(max_length):
        out = decoder.step(tokens, state, features, keys, mode=hard_mode)
        log_probs = torch.log_softmax(out.logits.float(), dim=1)  # (B*K, V)
        log_probs = _mask_logits(log_probs, step, min_length, suppress_unk)
        live, vocab = beam_scores.shape[1], log_probs.shape[1]  # live: 1 at first, then K
        candidates = beam_scores.unsqueeze(2) + log_probs.view(batch, live, vocab)  # (B, n, V)
        width = min(2 * k, live * vocab)
        top_scores, top_index = candidates.view(batch, -1).topk(width, dim=1)  # (B, 2K)
        top_beam = top_index // vocab  # (B, 2K)
        top_token = top_index % vocab  # (B, 2K)
        # An ending counts only among the top K, as in the usual formulation: with K = 1
        # this is exactly greedy decoding.
        in_top_k = torch.arange(width, device=device) < k  # (2K,)
        is_end = top_token == Vocabulary.end_id
        ended = is_end & in_top_k & torch.isfinite(top_scores)

        step_alpha = out.attention.alpha.view(batch, live, cells)  # (B, n, L)
        step_cell = out.attention.cell
        hard = step_cell is not None
        if hard:
            step_cell = step_cell.view(batch, live)

        # Finished candidates: keep each image's best (normalised) one.
        norm = top_scores / _length_penalty(torch.tensor(step + 1), length_penalty)
        norm = torch.where(ended, norm, float("-inf"))
        cand_score, cand_rank = norm.max(dim=1)  # (B,)
        better = cand_score > best_score
        if bool(better.any()):
            beam = top_beam[rows, cand_rank]  # (B,)
            best_score = torch.where(better, cand_score, best_score)
            best_raw = torch.where(better, top_scores[rows, cand_rank], best_raw)
            best_length = torch.where(better, torch.full_like(best_length, step), best_length)
            # the words before <end>, and the maps of every step including <end>'s
            words = _slots(history[rows, beam], max_length, Vocabulary.pad_id)
            best_tokens = _keep(better, words, best_tokens)
            maps = torch.cat([alpha_history[rows, beam], step_alpha[rows, beam, None]], dim=1)
            best_alphas = _keep(better, _slots(maps, max_length, 0.0), best_alphas)
            if hard:
                chosen = torch.cat([cell_history[rows, beam], step_cell[rows, beam, None]], dim=1)
                best_cells = _keep(better, _slots(chosen, max_length, 0), best_cells)

        # The best K candidates that did not end stay active (a stable sort keeps score order).
        order = torch.sort(is_end.float(), dim=1, stable=True).indices[:, :k]  # (B, K)
        beam_scores = top_scores.gather(1, order)  # (B, K)
        parent = top_beam.gather(1, order)  # (B, K)
        tokens = top_token.gather(1, order)  # (B, K)
        steps = history.shape[2]
        history = torch.cat([history.gather(1, parent[:, :, None].expand(-1, -1, steps)),
                             tokens.unsqueeze(2)], dim=2)  # fmt: skip
        parent_alpha = step_alpha.gather(1, parent[:, :, None].expand(-1, -1, cells))
        alpha_history = torch.cat(
            [alpha_history.gather(1, parent[:, :, None, None].expand(-1, -1, steps, cells)),
             parent_alpha.unsqueeze(2)], dim=2)  # fmt: skip
        if hard:
            cell_history = torch.cat(
                [cell_history.gather(1, parent[:, :, None].expand(-1, -1, steps)),
                 step_cell.gather(1, parent).unsqueeze(2)], dim=2)  # fmt: skip
        flat_parent = (rows[:, None] * live + parent).view(-1)  # (B*K,)
        state = out.state.select(flat_parent)
        tokens = tokens.view(-1)

        # Stop when no active beam can still beat the best finished caption: scores only
        # fall as captions grow, and the penalty is largest at max_length.
        bound = beam_scores.max(dim=1).values / _length_penalty(
            torch.tensor(max_length), length_penalty
        )
        if bool((best_score >= bound).all()):
            break

    # Images with no finished beam: their best active beam, unfinished.
    none_finished = torch.isinf(best_score)
    if bool(none_finished.any()):
        steps = history.shape[2]
        beam = beam_scores.argmax(dim=1)  # (B,)
        best_raw = torch.where(none_finished, beam_scores[rows, beam], best_raw)
        best_length = torch.where(none_finished, torch.full_like(best_length, steps), best_length)
        words = _slots(history[rows, beam], max_length, Vocabulary.pad_id)
        best_tokens = _keep(none_finished, words, best_tokens)
        maps = _slots(alpha_history[rows, beam], max_length, 0.0)
        best_alphas = _keep(none_finished, maps, best_alphas)
        if hard:
            best_cells = _keep(none_finished, _slots(cell_history[rows, beam], max_length, 0),
                               best_cells)  # fmt: skip

    width = max(int(best_length.max()) + 1, 1)
    return Decoded(
        tokens=best_tokens[:, :width],
        lengths=best_length,
        alphas=best_alphas[:, :width],
        scores=best_raw,
        cells=best_cells[:, :width] if hard else None,
    )


def decode(decoder: Decoder, features: torch.Tensor, cfg: DecodeConfig) -> Decoded:
    """Decode with the strategy and settings of ``cfg``."""
    common = dict(
        max_length=cfg.max_length,
        min_length=cfg.min_length,
        suppress_unk=cfg.suppress_unk,
        hard_mode=cfg.hard_decode,
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
