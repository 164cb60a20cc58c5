"""Greedy, sampling and batched beam search."""

import math

import pytest
import torch

from captioning.inference.decoding import beam_search, greedy_decode, sample_decode
from captioning.models.attention import AttentionOutput
from captioning.models.decoder import Decoder, DecoderState, StepOutput
from captioning.models.trace import AttentionTrace

from .test_models import batch, tiny_model

END, A, B, C = 2, 4, 5, 6


class ToyDecoder:
    """Next-word probabilities that depend only on the previous word."""

    def __init__(self, table, vocab=7):
        self.table = {}
        for prev, probs in table.items():
            row = torch.full((vocab,), 1e-9)
            for word, p in probs.items():
                row[word] = p
            self.table[prev] = torch.log(row / row.sum())
        self.ending = torch.full((vocab,), -30.0).index_fill(0, torch.tensor([END]), 0.0)

    def prepare(self, features):
        return features

    def word_grid(self, features):
        return features

    def init_state(self, features, per_image=1):
        zeros = torch.zeros(features.shape[0] * per_image, 1)
        return DecoderState(zeros, zeros)

    def step(self, tokens, state, features, keys, hard=None):
        # words outside the table (reached only through 1e-9 choices) end the caption
        logits = torch.stack([self.table.get(int(t), self.ending) for t in tokens])
        cells = features.shape[1]
        alpha = torch.full((tokens.shape[0], cells), 1.0 / cells)
        return StepOutput(
            logits, state, AttentionOutput(features.mean(dim=1), AttentionTrace(alpha))
        )


# From <start>: "a" 0.6, "b" 0.4. After "a" nothing is likely; after "b", <end> is.
# Greedy says "a ..." (at best 0.6 * 0.35 = 0.21); the best caption is "b" (0.4 * 0.9 = 0.36).
TRAP = {
    1: {A: 0.6, B: 0.4},
    A: {END: 0.35, C: 0.35, A: 0.3},
    B: {END: 0.9, C: 0.1},
    C: {END: 1.0},
}


def test_beam_finds_what_greedy_misses():
    decoder = ToyDecoder(TRAP)
    features = torch.zeros(2, 4, 3)
    greedy = greedy_decode(decoder, features, max_length=5)
    assert greedy.tokens[0, 0].item() == A
    beam = beam_search(decoder, features, beam_size=2, max_length=5)
    assert beam.tokens[:, 0].tolist() == [B, B] and beam.lengths.tolist() == [1, 1]
    assert beam.scores[0].item() == pytest.approx(math.log(0.36), abs=1e-4)
    assert beam.scores[0] > greedy.scores[0]


@pytest.mark.parametrize("beam_size", [3, 4, 5])
def test_more_beams_than_half_the_vocabulary(beam_size):
    """With 7 words, 2K candidates outnumber the first step's 7: the search still works and
    a wider beam still finds the best caption."""
    beam = beam_search(ToyDecoder(TRAP), torch.zeros(2, 4, 3), beam_size=beam_size, max_length=5)
    assert beam.tokens[:, 0].tolist() == [B, B] and beam.lengths.tolist() == [1, 1]
    assert beam.scores.tolist() == pytest.approx([math.log(0.36)] * 2, abs=1e-4)


def test_no_finished_beam_returns_the_best_unfinished_one():
    decoder = ToyDecoder({1: {A: 0.7, B: 0.3}, A: {A: 0.9, C: 0.1}, B: {B: 1.0}, C: {C: 1.0}})
    decoder.ending = decoder.table[C]
    result = beam_search(decoder, torch.zeros(3, 4, 3), beam_size=3, max_length=6)
    assert result.lengths.tolist() == [6, 6, 6]
    assert result.tokens[0].tolist() == [A] * 6
    assert result.alphas.shape == (3, 6, 4)


def test_min_length_and_unk_suppression():
    decoder = ToyDecoder({1: {END: 0.8, 3: 0.15, A: 0.05}, A: {END: 1.0}, 3: {END: 1.0}})
    features = torch.zeros(1, 4, 3)
    assert greedy_decode(decoder, features, min_length=0).lengths.item() == 0
    # <unk> is never chosen unless a study allows it
    assert greedy_decode(decoder, features, min_length=1).tokens[0, 0].item() == A
    assert beam_search(decoder, features, beam_size=2, min_length=1).tokens[0, 0].item() == A
    out = greedy_decode(decoder, features, min_length=1, suppress_unk=False)
    assert out.tokens[0, 0].item() == 3  # <unk>
    out = beam_search(decoder, features, beam_size=2, min_length=1, suppress_unk=False)
    assert out.tokens[0, 0].item() == 3


@pytest.mark.parametrize("attention", ["soft", "hard", "none"])
def test_beam_size_one_is_greedy(attention):
    model = tiny_model(f"model.attention={attention}").eval()
    images, _ = batch(size=5)
    with torch.no_grad():
        features = model.encoder(images)
    mode = "argmax" if attention == "hard" else "expectation"
    greedy = greedy_decode(model.decoder, features, max_length=8, hard_context=mode)
    beam = beam_search(model.decoder, features, beam_size=1, max_length=8, hard_context=mode)
    assert torch.equal(greedy.tokens, beam.tokens) and torch.equal(greedy.lengths, beam.lengths)
    assert torch.allclose(greedy.scores, beam.scores, atol=1e-5)
    assert torch.allclose(greedy.alphas, beam.alphas, atol=1e-6)
    if attention == "hard":
        assert torch.equal(greedy.trace.cell, beam.trace.cell)


@pytest.mark.parametrize(
    ("beam_size", "variant"),
    [
        (2, []),
        (5, []),
        (5, ["model.score=location"]),
        (5, ["model.values=projected", "model.value_dim=6"]),
        (3, ["model.heads=2", "model.attention_dim=12"]),
        (3, ["model.attention=local"]),
        (3, ["model.query=current", "model.context_to_lstm=false"]),
    ],
)
def test_batch_gives_the_same_captions_as_one_image_at_a_time(beam_size, variant):
    torch.manual_seed(3)
    model = tiny_model("model.hidden_dim=40", *variant).eval()
    with torch.no_grad():
        for p in model.decoder.out.parameters():
            p.mul_(8)  # sharper word distributions: longer, more varied captions
        features = model.encoder(batch(size=6)[0])
    together = beam_search(
        model.decoder, features, beam_size=beam_size, max_length=10, length_penalty=0.7
    )
    for i in range(6):
        alone = beam_search(
            model.decoder,
            features[i : i + 1],
            beam_size=beam_size,
            max_length=10,
            length_penalty=0.7,
        )
        n = int(alone.lengths[0])
        assert int(together.lengths[i]) == n
        assert torch.equal(together.tokens[i, :n], alone.tokens[0, :n])
        assert torch.allclose(together.scores[i], alone.scores[0], atol=1e-5)
        assert torch.allclose(together.alphas[i, : n + 1], alone.alphas[0, : n + 1], atol=1e-5)
        for extra in ("heads", "centre"):  # multi-head weights, local centres
            if getattr(alone.trace, extra) is None:
                assert getattr(together.trace, extra) is None
                continue
            assert torch.allclose(
                getattr(together.trace, extra)[i, : n + 1],
                getattr(alone.trace, extra)[0, : n + 1],
                atol=1e-5,
            )
    if "model.heads=2" in variant:
        shape = (6, together.tokens.shape[1], 2, together.alphas.shape[2])
        assert together.trace.heads.shape == shape
    if "model.attention=local" in variant:
        assert together.trace.centre.shape == (6, together.tokens.shape[1], 2)


def replay(decoder, features, tokens):
    """The attention outputs of re-running ``decoder`` over ``tokens`` (T,) of one image:
    one per word, and one for ``<end>``."""
    state = decoder.init_state(features)
    keys = decoder.prepare(features)
    inputs = torch.cat([torch.tensor([1]), tokens])  # <start>, then the words
    outputs = []
    with torch.no_grad():
        for token in inputs:
            out = decoder.step(token.view(1), state, features, keys)
            outputs.append(out.attention)
            state = out.state
    return outputs


@pytest.mark.parametrize(
    "variant", [["model.heads=2", "model.attention_dim=12"], ["model.attention=local"]]
)
@pytest.mark.parametrize("beam_size", [1, 3])
def test_heads_and_centres_are_those_of_the_words_said(variant, beam_size):
    """Each word's recorded heads (centre) are what the model's attention gives when it is run
    again over the caption: greedy decoding and beam search record the right beam's."""
    torch.manual_seed(3)
    model = tiny_model("model.hidden_dim=40", *variant).eval()
    with torch.no_grad():
        for p in model.decoder.out.parameters():
            p.mul_(8)
        if "model.heads=2" in variant:  # the heads start as copies of one: part them
            for p in model.decoder.attention.heads[1].parameters():
                p.add_(0.5 * torch.randn_like(p))
        features = model.encoder(batch(size=4)[0])
    # at least four words, whatever the random model prefers
    if beam_size == 1:
        out = greedy_decode(model.decoder, features, max_length=10, min_length=4)
    else:
        out = beam_search(model.decoder, features, beam_size=beam_size, max_length=10, min_length=4)
    multi_head = "model.heads=2" in variant
    heads, centres = out.trace.heads, out.trace.centre
    assert (heads is not None) == multi_head and (centres is not None) != multi_head
    steps = 0
    for i in range(4):
        n = int(out.lengths[i])
        again = replay(model.decoder, features[i : i + 1], out.tokens[i, :n])
        steps += n + 1
        for t, attention in enumerate(again):  # the words, and <end> when it was said
            if t == out.tokens.shape[1]:
                break
            torch.testing.assert_close(out.alphas[i, t], attention.alpha[0])
            if multi_head:
                torch.testing.assert_close(heads[i, t], attention.trace.heads[0])  # (H, L)
                torch.testing.assert_close(heads[i, t].mean(dim=0), out.alphas[i, t])
                assert not torch.allclose(heads[i, t, 0], heads[i, t, 1])
            else:
                torch.testing.assert_close(centres[i, t], attention.trace.centre[0])  # (2,)
    assert steps > 8  # the captions have words
    row = out.row(2)
    extra = row.trace.heads if multi_head else row.trace.centre
    assert extra.device.type == "cpu" and extra.dtype == torch.float32
    assert extra.shape[0] == out.tokens.shape[1]


def test_a_plain_model_records_no_heads_or_centres():
    model = tiny_model().eval()
    with torch.no_grad():
        features = model.encoder(batch(size=2)[0])
    for out in (
        greedy_decode(model.decoder, features, max_length=5),
        beam_search(model.decoder, features, beam_size=2, max_length=5),
    ):
        assert out.trace.heads is None and out.trace.centre is None
        assert out.alphas.shape[2] == features.shape[1]
        assert out.row(0).trace.heads is None and out.row(0).trace.centre is None


class CountdownDecoder(ToyDecoder):
    """Image i says ``A`` (0.6) or ``B`` (0.4) for ``features[i, 0, 0]`` words, then
    ``<end>`` (0.9). The state counts the words said; each step records its row count."""

    def __init__(self):
        super().__init__({})
        self.rows = []

    def step(self, tokens, state, features, keys, hard=None):
        self.rows.append(tokens.shape[0])
        per_image = tokens.shape[0] // features.shape[0]
        target = features[:, 0, 0].repeat_interleave(per_image)  # (rows,) from its image
        said = state.h[:, 0]  # (rows,)
        speak = torch.full((7,), 1e-9).index_put_((torch.tensor([A, B]),), torch.tensor([0.6, 0.4]))
        stop = torch.full((7,), 1e-9).index_put_(
            (torch.tensor([END, B]),), torch.tensor([0.9, 0.1])
        )
        probs = torch.where((said >= target)[:, None], stop, speak)  # (rows, V)
        cells = features.shape[1]
        alpha = torch.full((tokens.shape[0], cells), 1.0 / cells)
        new = DecoderState((said + 1)[:, None], state.c)
        return StepOutput(
            torch.log(probs / probs.sum(1, keepdim=True)),
            new,
            AttentionOutput(torch.zeros(tokens.shape[0], 3), AttentionTrace(alpha)),
        )


def test_images_that_are_done_leave_the_batch():
    """Rows stop being decoded once their image's search is over, and every image still gets
    its own answer."""
    targets = [1, 4, 6, 2, 3, 5]
    features = torch.zeros(6, 4, 3)
    features[:, 0, 0] = torch.tensor(targets, dtype=torch.float)
    decoder = CountdownDecoder()
    out = beam_search(decoder, features, beam_size=3, max_length=10)
    assert out.lengths.tolist() == targets
    for i, n in enumerate(targets):
        assert out.tokens[i, :n].tolist() == [A] * n
        assert out.scores[i].item() == pytest.approx(n * math.log(0.6) + math.log(0.9), abs=1e-4)
    # One beam per image first, then K. The image of n words finds its <end> at step n
    # (from 0), when no live beam can beat it any more, and leaves: 3 rows fewer each step.
    assert decoder.rows == [6, 18, 15, 12, 9, 6, 3]


def test_sampling_is_seeded_and_top_k_restricts():
    decoder = ToyDecoder({1: {A: 0.5, B: 0.3, C: 0.2}, A: {END: 1.0}, B: {END: 1.0}, C: {END: 1.0}})
    features = torch.zeros(200, 4, 3)
    g = torch.Generator().manual_seed(0)
    first = sample_decode(decoder, features, generator=g).tokens[:, 0]
    g = torch.Generator().manual_seed(0)
    assert torch.equal(first, sample_decode(decoder, features, generator=g).tokens[:, 0])
    assert set(first.tolist()) == {A, B, C}
    top1 = sample_decode(decoder, features, top_k=1).tokens[:, 0]
    assert set(top1.tolist()) == {A}
    cold = sample_decode(decoder, features, temperature=0.05).tokens[:, 0]
    assert (cold == A).float().mean() > 0.95


@pytest.mark.parametrize("attention", ["soft", "hard"])
def test_several_samples_per_image_equal_sampling_a_repeated_grid(attention):
    """``samples=K`` draws K captions per image against one copy of the grid: with the same
    generator, the very captions, scores and maps drawn from the grid repeated K times."""
    model = tiny_model(f"model.attention={attention}").eval()
    images, _ = batch(size=3)
    with torch.no_grad():
        features = model.encode(images)
        runs = []
        for grid, samples in ((features, 4), (features.repeat_interleave(4, dim=0), 1)):
            torch.manual_seed(5)
            runs.append(
                sample_decode(
                    model.decoder,
                    grid,
                    max_length=6,
                    samples=samples,
                    hard_context="sample" if attention == "hard" else "expectation",
                )
            )
    grouped, repeated = runs
    assert grouped.tokens.shape[0] == 12
    assert torch.equal(grouped.tokens, repeated.tokens)
    assert torch.equal(grouped.lengths, repeated.lengths)
    torch.testing.assert_close(grouped.scores, repeated.scores, rtol=0, atol=1e-5)
    torch.testing.assert_close(grouped.trace.alpha, repeated.trace.alpha, rtol=0, atol=1e-5)
    assert len(set(map(tuple, grouped.tokens[:4].tolist()))) > 1  # four different draws


@pytest.mark.parametrize(
    "variant",
    [
        [],
        ["model.attention=hard"],
        ["model.attention=none"],
        ["model.attention=local"],
        ["model.heads=2", "model.attention_dim=12"],
        ["model.values=projected", "model.value_dim=6"],
        ["model.query=current", "model.context_to_lstm=false"],
    ],
)
def test_the_grid_cast_once_under_autocast_decodes_the_same_numbers(variant, monkeypatch):
    """Under bf16 autocast the grid is cast once per batch instead of at every word (hard
    attention's is left as it is)."""
    model = tiny_model("model.hidden_dim=40", *variant).eval()
    images, _ = batch(size=5)
    with torch.no_grad():
        features = model.encoder(images).float()

    def decode():
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            mode = "argmax" if "model.attention=hard" in variant else "expectation"
            return [
                greedy_decode(model.decoder, features, max_length=8, hard_context=mode),
                beam_search(model.decoder, features, beam_size=3, max_length=8, hard_context=mode),
            ]

    once = decode()
    monkeypatch.setattr(Decoder, "word_grid", lambda self, grid: grid)
    every_word = decode()
    for ours, theirs in zip(once, every_word):
        assert torch.equal(ours.tokens, theirs.tokens)
        assert torch.equal(ours.scores, theirs.scores)
        assert torch.equal(ours.alphas, theirs.alphas)
