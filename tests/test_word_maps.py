"""The word localiser (model.word_maps) and the map term that draws attention toward it."""

import math

import pytest
import torch

from captioning.config import ModelConfig, load_config
from captioning.errors import ConfigError
from captioning.models.attention import AttentionSizes, build_attention
from captioning.models.decoder import Decoder
from captioning.models.word_maps import (
    ExpectedWordScore,
    WordLocaliser,
    category_classes,
    map_divergence,
    presence_loss,
)
from captioning.objectives.cross_entropy import caption_loss

CELLS, DIM, WORDS = 9, 16, 12
VOCAB_SIZE = 30  # tests.test_looks._model's vocabulary


def _sample(generator: torch.Generator, batch: int = 64):
    """Two words planted in cells of noise (:func:`tests.test_looks.planted_words`)."""
    from tests.test_looks import planted_words

    return planted_words(generator, CELLS, DIM, WORDS, batch)


def test_the_localiser_pools_by_log_sum_exp_and_maps_each_target():
    torch.manual_seed(0)
    localiser = WordLocaliser(DIM, WORDS, rank=8)
    grid = torch.randn(2, CELLS, DIM)
    targets = torch.tensor([[5, 7, 2, 0], [7, 9, 9, 2]])
    maps = localiser(grid, targets)
    words = torch.tensor([0, 2, 5, 7, 9])  # the batch's tokens, in order
    scores = localiser.scores(grid, words)  # (B, L, C)
    r = localiser.sharpness
    expected = (torch.logsumexp(r * scores, dim=1) - math.log(CELLS)) / r
    torch.testing.assert_close(maps.presence, expected)
    # between the mean and the maximum of the word's scores
    assert (maps.presence <= scores.amax(dim=1) + 1e-6).all()
    assert (maps.presence >= scores.mean(dim=1) - 1e-6).all()
    assert maps.labels.tolist() == [[1, 1, 1, 1, 0], [0, 1, 0, 1, 1]]
    assert maps.candidates.tolist() == [False, False, True, True, True]
    assert maps.words.tolist() == [[True, True, False, False], [True, True, True, False]]
    # each target's map is its word's softmax over the cells, and moves no weight
    own = torch.softmax(r * scores, dim=1)  # (B, L, C)
    torch.testing.assert_close(maps.log_maps[1, 1].exp(), own[1, :, 4])
    torch.testing.assert_close(maps.log_maps[0, 0].exp(), own[0, :, 2])
    assert not maps.log_maps.requires_grad
    # the presence loss leaves out the specials' columns
    bce = torch.nn.functional.binary_cross_entropy_with_logits(
        maps.presence[:, 2:], maps.labels[:, 2:]
    )
    torch.testing.assert_close(presence_loss(maps), bce)


def test_the_map_term_is_the_kl_from_the_localisers_map():
    torch.manual_seed(0)
    localiser = WordLocaliser(DIM, WORDS, rank=8)
    targets = torch.tensor([[5, 7, 2, 0]])
    maps = localiser(torch.randn(1, CELLS, DIM), targets)
    alphas = torch.softmax(torch.randn(1, 4, CELLS), dim=-1)
    divergence = map_divergence(maps, alphas)
    m = maps.log_maps.exp()
    kl = (m * (m.log() - alphas.log())).sum(-1)
    torch.testing.assert_close(divergence[0, :2], kl[0, :2])
    assert divergence[0, 2:].tolist() == [0.0, 0.0]  # <end> and padding name nothing
    assert (divergence >= 0).all()
    same = map_divergence(maps, maps.log_maps.exp())
    torch.testing.assert_close(same[0, :2], torch.zeros(2), atol=1e-6, rtol=0)


def test_the_localiser_finds_each_word_from_the_captions_alone():
    """Trained on whether each word is in the caption (never where), its maps peak on the
    cell that holds the word."""
    generator = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    localiser = WordLocaliser(DIM, WORDS, rank=8)
    optimiser = torch.optim.Adam(localiser.parameters(), lr=1e-2)
    losses = []
    for _ in range(200):
        grid, tokens, _ = _sample(generator)
        loss = presence_loss(localiser(grid, tokens[:, 1:]))
        optimiser.zero_grad()
        loss.backward()
        optimiser.step()
        losses.append(float(loss.detach()))
    grid, tokens, where = _sample(generator)
    with torch.no_grad():
        maps = localiser(grid, tokens[:, 1:]).log_maps[:, :2]  # (B, 2, L)
    hits = (maps.argmax(dim=2) == where).float().mean()
    assert hits > 0.95, hits
    assert sum(losses[-20:]) < 0.5 * sum(losses[:20])


def _weight_on_the_word(map_weight: float, expected_weight: float | None = None) -> float:
    """A decoder trained 300 steps beside a localiser, with ``map_weight`` on the map term
    (and, when ``expected_weight`` is given, the expected-word score with that weight on
    its layer's cross-entropy): the mean weight its maps put on the cell that holds their
    word."""
    generator = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    cfg = ModelConfig(attention_dim=16, hidden_dim=32, embed_dim=16)
    attention = build_attention(cfg, AttentionSizes(DIM, 32, CELLS, (3, 3), DIM))
    localiser = WordLocaliser(DIM, WORDS, rank=8)
    if expected_weight is not None:
        attention.score = ExpectedWordScore(attention.score, localiser, 32, WORDS)
    decoder = Decoder(WORDS, DIM, attention, 16, 32, dropout=0.0)
    parameters = [*decoder.parameters(), *localiser.parameters()]
    optimiser = torch.optim.Adam(parameters, lr=1e-2)
    for _ in range(300):
        grid, tokens, _ = _sample(generator)
        output = decoder(grid, tokens[:, :-1])
        output.word_maps = localiser(grid, tokens[:, 1:])
        if expected_weight is not None:
            output.expected_logits = attention.score.expect(output.queries.detach())
        loss = caption_loss(
            output,
            tokens[:, 1:],
            0,
            penalty_weight=0.0,
            map_weight=map_weight,
            expected_weight=expected_weight or 0.0,
        )
        optimiser.zero_grad()
        loss.total.backward()
        optimiser.step()
    grid, tokens, where = _sample(generator)
    with torch.no_grad():
        alphas = decoder(grid, tokens[:, :-1]).alphas  # (B, 3, L): word 1, word 2, end
    return float(alphas[:, :2].gather(2, where.unsqueeze(2)).mean())


def test_naming_the_coming_word_moves_each_words_attention_onto_its_word():
    """Without the map term, the expected-word score trained to name the coming word looks
    where the localiser finds it; the additive score trained by the captions alone does not.
    (With the expected-word score's loss at weight 0, its maps find the word on most seeds
    too, 0.84-0.96 on seeds 0-4: the margin is over the plain score, 0.76-0.80.)"""
    named, plain = _weight_on_the_word(0.0, 1.0), _weight_on_the_word(0.0)
    assert named > 0.9 and named > plain + 0.1, (named, plain)


def test_the_map_term_moves_each_words_attention_onto_its_word():
    """The initial state sees the mean cell, so the captions can be learnt without looking;
    drawn toward the localiser's maps, each word's attention goes to the cell that holds it."""
    drawn, plain = _weight_on_the_word(1.0), _weight_on_the_word(0.0)
    assert drawn > 0.9 and drawn > plain + 0.1, (drawn, plain)


def test_the_localiser_trains_beside_the_captioner_and_only_by_its_own_loss():
    from tests.test_looks import _images, _model

    model = _model(drop_stages=5, word_maps=True, word_map_rank=8)
    tokens = torch.tensor([[1, 5, 6, 7, 2, 0], [1, 8, 9, 2, 0, 0]])
    grid = model.encoder.backbone(_images())
    output = model(None, tokens, grid=grid)
    plain = caption_loss(output, tokens[:, 1:], 0)
    drawn = caption_loss(output, tokens[:, 1:], 0, map_weight=2.0)
    mask = (tokens[:, 1:] != 0).float()
    divergence = map_divergence(output.word_maps, output.alphas) * mask
    torch.testing.assert_close(drawn.total - plain.total, 2.0 * divergence.sum(1).mean())
    words = (output.word_maps.words.float() * mask).sum()
    assert float(drawn.map_kl) == pytest.approx(float(divergence.detach().sum() / words))
    # the map term's gradient reaches the attention, never the localiser
    term = 2.0 * divergence.sum(1).mean()
    grads = torch.autograd.grad(
        term,
        [model.word_maps.project.weight, *model.decoder.attention.parameters()],
        allow_unused=True,
    )
    assert grads[0] is None
    assert any(g is not None and g.abs().sum() > 0 for g in grads[1:])
    # decoding never reads it: the captions' logits are the same without it
    model.word_maps = None
    torch.testing.assert_close(model(None, tokens, grid=grid).logits, output.logits)


def test_word_map_settings_that_cannot_work_are_refused_in_one_line():
    base = "configs/test_tiny.yaml"
    cases = {
        ("train.word_map_weight=1",): "set model.word_maps=true",
        ("model.word_maps=true", "model.attention=none"): "model.attention=none has no map",
        (
            "model.word_maps=true",
            "model.word_attention=true",
            "model.attention=local",
        ): "use model.attention=soft or hard",
        ("model.word_maps=true", "model.word_map_rank=0"): "model.word_map_rank",
        ("model.word_maps=true", "train.expected_word_weight=1"): "model.word_attention=true",
        ("train.expected_word_weight=-1",): "train.expected_word_weight",
        ("train.word_map_labels=image",): "labels the word localiser's training",
        ("model.word_maps=true", "train.word_map_labels=images"): "train.word_map_labels",
        ("model.word_map_sharpness=20",): "is the word localiser's pooling",
        ("model.word_maps=true", "model.word_map_sharpness=0"): "model.word_map_sharpness",
        ("model.word_map_classes=categories",): "groups the word localiser's classes",
        ("model.word_maps=true", "model.word_map_classes=category"): "model.word_map_classes",
        ("model.word_maps=true", "model.word_map_categories=x.json"): "word_map_classes=cat",
        (
            "model.word_maps=true",
            "model.word_attention=true",
            "model.word_attention_words=categories",
        ): "picks the words the expected-word score",
        ("model.word_maps=true", "model.word_attention_words=categories"): "word_attention=true",
    }
    for overrides, message in cases.items():
        with pytest.raises(ConfigError, match=message):
            load_config(base, list(overrides))


def test_the_localisers_maps_of_decoded_words_are_those_teacher_forcing_draws_toward():
    from tests.test_looks import _model

    model = _model(drop_stages=5, word_maps=True, word_map_rank=8, summary="both")
    torch.manual_seed(1)
    images = torch.randn(2, 3, 64, 64)
    tokens = torch.tensor([[1, 5, 7, 9, 2], [1, 7, 7, 2, 0]])
    with torch.no_grad():
        forced = model(images, tokens).word_maps.log_maps.exp()  # (B, T, L)
        found = model.localiser_maps(model.encode(images), tokens[:, 1:])
    torch.testing.assert_close(found, forced)
    torch.testing.assert_close(found.sum(dim=2), torch.ones(2, 4))
    model.word_maps = None
    with pytest.raises(ValueError, match="no word localiser"):
        model.localiser_maps(model.encode(images), tokens)


def test_the_sharpness_setting_moves_the_pooling_from_the_mean_to_the_maximum():
    from tests.test_looks import _model

    model = _model(drop_stages=5, word_maps=True, word_map_rank=8, word_map_sharpness=40.0)
    assert model.word_maps.sharpness == 40.0
    torch.manual_seed(0)
    grid = torch.randn(2, CELLS, DIM)
    targets = torch.tensor([[5, 7, 2], [7, 9, 2]])
    weights, pooled = WordLocaliser(DIM, WORDS, rank=8).state_dict(), {}
    for r in (1e-3, 5.0, 1e3):
        localiser = WordLocaliser(DIM, WORDS, rank=8, sharpness=r)
        localiser.load_state_dict(weights)
        scores = localiser.scores(grid, torch.tensor([2, 5, 7, 9]))  # (B, L, C)
        pooled[r] = localiser(grid, targets).presence
    torch.testing.assert_close(pooled[1e-3], scores.mean(dim=1), atol=1e-3, rtol=0)
    # the maximum, less the (log L) / r that an even map's pooling pays
    maximum = scores.amax(dim=1) - math.log(CELLS) / 1e3
    torch.testing.assert_close(pooled[1e3], maximum, atol=1e-3, rtol=0)
    assert (pooled[1e-3] < pooled[5.0]).all() and (pooled[5.0] < pooled[1e3]).all()


def test_the_expected_word_score_adds_the_expected_words_localiser_scores():
    from captioning.models.word_maps import ExpectedWordScore
    from tests.test_looks import _images, _model

    model = _model(drop_stages=5, word_maps=True, word_map_rank=8, word_attention=True)
    score = model.decoder.attention.score
    assert isinstance(score, ExpectedWordScore) and score.localiser is model.word_maps
    # one name per weight: the localiser is the captioner's, held by the score unregistered
    names = [k for k in model.state_dict() if ".project." in k and "word" in k]
    assert names == ["word_maps.project.weight", "word_maps.project.bias"]
    grid = model.encode(grid=model.encoder.backbone(_images()))
    cells, _ = model.decoder.split(grid)
    keys = model.decoder.prepare(grid)
    query = torch.randn(2 * 3, 24)  # three queries per image, image-major
    got = score(keys, query)
    expected = torch.softmax(score.expect(query), dim=-1)  # (6, V)
    every = model.word_maps.scores(cells, torch.arange(VOCAB_SIZE))  # (2, L, V)
    every = every.repeat_interleave(3, dim=0)  # (6, L, V)
    own = score.score(score.score.project_keys(cells), query)
    prior = (every * expected.unsqueeze(1)).sum(-1)  # the word biases shift every cell alike
    shift = (got - own - model.word_maps.sharpness * prior).float()
    torch.testing.assert_close(shift - shift[:, :1], torch.zeros_like(shift), atol=1e-4, rtol=0)
    # the captions never train the localiser through the score; the map term trains W_e
    output = model(None, torch.tensor([[1, 5, 6, 2], [1, 8, 2, 0]]), grid=grid)
    localiser = list(model.word_maps.parameters())
    grads = torch.autograd.grad(
        output.logits.logsumexp(-1).sum(), localiser, retain_graph=True, allow_unused=True
    )
    assert all(g is None for g in grads)
    term = map_divergence(output.word_maps, output.alphas).sum()
    (grad,) = torch.autograd.grad(term, [score.expect.weight])
    assert grad.abs().sum() > 0
    # with one word expected, the map is the own map times that word's localiser map
    with torch.no_grad():
        score.expect.weight.zero_()
        score.expect.bias.fill_(-30.0)
        score.expect.bias[7] = 30.0
    alpha = torch.softmax(score(keys, query), dim=-1)
    own_alpha = torch.softmax(own, dim=-1)
    word_map = model.word_maps.maps(cells, torch.tensor([7]))[..., 0].repeat_interleave(3, 0)
    product = own_alpha * word_map
    torch.testing.assert_close(alpha, product / product.sum(-1, keepdim=True), atol=1e-5, rtol=1e-4)


def test_decoding_keeps_the_class_weights_until_the_localiser_changes():
    """Without gradients the score keeps the localiser's class weights between words: the
    same scores as gathering them every time, and new ones once the weights change in
    place (an optimiser's step, a loaded checkpoint) or are replaced."""
    from tests.test_looks import _images, _model

    model = _model(drop_stages=5, word_maps=True, word_map_rank=8, word_attention=True)
    score = model.decoder.attention.score
    grid = model.encode(grid=model.encoder.backbone(_images()))
    keys = model.decoder.prepare(grid).detach()
    query = torch.randn(2 * 3, 24)

    def fresh():  # the scores with the weights gathered anew
        score._kept = None
        return score(keys, query)

    with torch.no_grad():
        first = score(keys, query)
        assert score._kept is not None
        kept = score._kept[1]
        assert torch.equal(score(keys, query), first) and score._kept[1] is kept
        assert torch.equal(first, fresh())
        kept = score._kept[1]
        model.word_maps.words.weight.mul_(2.0)  # in place, as an optimiser steps
        moved = score(keys, query)
        assert score._kept[1] is not kept and not torch.equal(moved, first)
        assert torch.equal(moved, fresh())
        weight = model.word_maps.words.weight
        weight.data = weight.data.flip(0)  # new storage, as .to() or a cast gives
        replaced = score(keys, query)
        assert not torch.equal(replaced, moved) and torch.equal(replaced, fresh())
        state = {k: v.clone() for k, v in model.state_dict().items()}
        state["word_maps.words.weight"].normal_()
        model.load_state_dict(state)  # a checkpoint copies into the same tensors
        loaded = score(keys, query)
        assert not torch.equal(loaded, replaced) and torch.equal(loaded, fresh())
        with torch.autocast("cpu", dtype=torch.bfloat16):  # kept as autocast casts it
            cast = score(keys, query)
            assert score._kept[1].dtype == torch.bfloat16
            assert torch.equal(cast, fresh()) and not torch.equal(cast, loaded)
        assert torch.equal(score(keys, query), loaded)  # and in fp32 again outside


def test_the_expected_word_layer_reads_the_next_word_from_each_query():
    from captioning.objectives.cross_entropy import token_nll
    from tests.test_looks import _images, _model

    model = _model(drop_stages=5, word_maps=True, word_map_rank=8, word_attention=True)
    score = model.decoder.attention.score
    tokens = torch.tensor([[1, 5, 6, 7, 2, 0], [1, 8, 9, 2, 0, 0]])
    grid = model.encode(grid=model.encoder.backbone(_images()))
    output = model(None, tokens, grid=grid)
    # the queries are h_0 .. h_{T-1}, and the layer reads each next word from them
    torch.testing.assert_close(output.queries[:, 0], model.decoder.init_state(grid).h)
    torch.testing.assert_close(output.expected_logits, score.expect(output.queries))
    targets = tokens[:, 1:]
    plain = caption_loss(output, targets, 0)
    named = caption_loss(output, targets, 0, expected_weight=0.5)
    mask = (targets != 0).float()
    nll = token_nll(output.expected_logits, targets, mask)
    torch.testing.assert_close(named.total - plain.total, 0.5 * nll.sum(1).mean())
    assert float(named.expected_nll) == pytest.approx(float(nll.detach().sum() / mask.sum()))
    # it trains the layer only: neither the decoder's state nor the localiser moves
    term = 0.5 * nll.sum(1).mean()
    grads = torch.autograd.grad(
        term,
        [score.expect.weight, model.decoder.lstm.weight_hh, model.word_maps.project.weight],
        allow_unused=True,
    )
    assert grads[0].abs().sum() > 0 and grads[1] is None and grads[2] is None
    output.expected_logits = None
    with pytest.raises(ValueError, match="expected-word score"):
        caption_loss(output, targets, 0, expected_weight=1.0)


def test_each_path_reports_the_queries_the_attention_read():
    """The step loop and the all-words-at-once pass give the same queries, h_0 .. h_{T-1}."""
    torch.manual_seed(0)
    cfg = ModelConfig(attention_dim=16, hidden_dim=32, embed_dim=16)
    attention = build_attention(cfg, AttentionSizes(DIM, 32, CELLS, (3, 3), DIM))
    decoder = Decoder(WORDS, DIM, attention, 16, 32, dropout=0.0, context_to_lstm=False)
    grid, tokens, _ = _sample(torch.Generator().manual_seed(0), batch=4)
    parallel = decoder(grid, tokens[:, :-1])
    decoder.parallel = False
    by_step = decoder(grid, tokens[:, :-1])
    torch.testing.assert_close(parallel.queries, by_step.queries, atol=1e-5, rtol=1e-5)
    state = decoder.init_state(grid)
    for t in range(tokens.shape[1] - 1):
        torch.testing.assert_close(by_step.queries[:, t], state.h)
        state = decoder.step(tokens[:, t], state, grid, decoder.prepare(grid)).state


def test_the_localisers_specials_are_the_vocabularys():
    from captioning.data.vocab import SPECIALS, Vocabulary
    from captioning.models.word_maps import SPECIAL_IDS

    vocab = Vocabulary([*SPECIALS, "dog"])
    assert sorted(SPECIAL_IDS) == sorted(vocab.encode(list(SPECIALS), add_special=False))


def test_hard_attentions_estimators_carry_the_localisers_terms():
    """A hard model with the expected-word score: REINFORCE's loss plus the localiser's
    presence loss, k * the map term and v * the expected-word NLL, on the same samples."""
    from dataclasses import replace

    from captioning.config import Config
    from captioning.objectives import Batch
    from captioning.objectives.cross_entropy import token_nll
    from captioning.objectives.hard_attention import HardAttentionObjective
    from tests.test_looks import _images, _model

    settings = dict(word_maps=True, word_map_rank=8, word_attention=True, attention="hard")
    model = _model(drop_stages=5, **settings)
    tokens = torch.tensor([[1, 5, 6, 7, 2, 0], [1, 8, 9, 2, 0, 0]])
    batch = Batch(tokens=tokens, grid=model.encoder.backbone(_images()), step=3)
    cells = model.grid_shape[0] * model.grid_shape[1]

    def terms(**weights):
        cfg = Config()
        cfg = replace(cfg, train=replace(cfg.train, semi_sampling_p=1.0, **weights))
        objective = HardAttentionObjective(cfg, cells, torch.device("cpu"), "fp32")
        return objective.loss(model, batch)

    plain, weighted = terms(), terms(word_map_weight=0.3, expected_word_weight=0.5)
    plan = HardAttentionObjective(Config(), cells, torch.device("cpu"), "fp32")
    plan.cfg = replace(plan.cfg, semi_sampling_p=1.0)
    output = model(None, tokens, grid=batch.grid, hard=plan.plan(3, 2, 5).hard)
    assert output.log_probs is not None  # the cells were sampled
    targets = tokens[:, 1:]
    mask = (targets != 0).float()
    kl = (map_divergence(output.word_maps, output.alphas) * mask).sum(1).mean()
    nll = token_nll(output.expected_logits, targets, mask).sum(1).mean()
    torch.testing.assert_close(weighted.total - plain.total, 0.3 * kl + 0.5 * nll)
    assert float(plain.presence) > 0 and float(plain.expected_nll) > 0
    assert plain.reinforce is not None


def test_image_labels_make_every_references_word_a_positive():
    """``train.word_map_labels=image``: the words of the image's other references are the
    localiser's positives too (not negatives), and join the candidates; each target's map
    is the same as with the caption's own labels."""
    torch.manual_seed(0)
    localiser = WordLocaliser(DIM, WORDS, rank=8)
    grid = torch.randn(2, CELLS, DIM)
    targets = torch.tensor([[5, 7, 2, 0], [7, 9, 9, 2]])
    present = torch.tensor([[5, 7, 8, 0], [4, 7, 9, 10]])  # padded with <pad>
    maps = localiser(grid, targets, present)
    plain = localiser(grid, targets)
    words = [0, 2, 4, 5, 7, 8, 9, 10]  # the targets' and the images' tokens, in order
    assert maps.candidates.tolist() == [w not in (0, 2) for w in words]
    assert maps.labels[:, 2:].tolist() == [[0, 1, 1, 1, 0, 0], [1, 0, 1, 0, 1, 1]]
    scores = localiser.scores(grid, torch.tensor(words))
    r = localiser.sharpness
    expected = (torch.logsumexp(r * scores, dim=1) - math.log(CELLS)) / r
    torch.testing.assert_close(maps.presence, expected)
    torch.testing.assert_close(maps.log_maps, plain.log_maps)
    assert torch.equal(maps.words, plain.words)
    bce = torch.nn.functional.binary_cross_entropy_with_logits(
        maps.presence[:, 2:], maps.labels[:, 2:]
    )
    torch.testing.assert_close(presence_loss(maps), bce)


def test_the_image_words_are_each_images_references_words_without_specials():
    from captioning.objectives.cross_entropy import ImageWords

    words = ImageWords([[[1, 5, 7, 2], [1, 7, 9, 3, 2]], [[1, 4, 2]]])
    looked_up = words(torch.tensor([1, 0, 1]), torch.device("cpu"))
    assert looked_up.tolist() == [[4, 0, 0], [5, 7, 9], [4, 0, 0]]
    with pytest.raises(ValueError, match="dataset indices"):
        words(None, torch.device("cpu"))


def test_the_cross_entropy_objective_labels_the_localiser_by_its_images_words():
    """With image words the objective's presence loss is the localiser's on the image's
    words (a hard model's estimators likewise), and only the presence loss changes."""
    from captioning.objectives.base import Batch
    from captioning.objectives.cross_entropy import CrossEntropyObjective, ImageWords
    from tests.test_looks import _images, _model

    model = _model(drop_stages=5, word_maps=True, word_map_rank=8)
    tokens = torch.tensor([[1, 5, 6, 7, 2, 0], [1, 8, 9, 2, 0, 0]])
    grid = model.encoder.backbone(_images())
    references = [[[1, 5, 6, 7, 2], [1, 11, 12, 2]], [[1, 8, 9, 2]], [[1, 13, 2]]]
    batch = Batch(tokens, grid=grid, indices=torch.tensor([0, 2]))
    cpu = torch.device("cpu")
    image = CrossEntropyObjective(1.0, cpu, "fp32", image_words=ImageWords(references))
    own = CrossEntropyObjective(1.0, cpu, "fp32")
    with torch.no_grad():
        labelled, plain = image.loss(model, batch), own.loss(model, batch)
        present = torch.tensor([[5, 6, 7, 11, 12], [13, 0, 0, 0, 0]])
        cells, _ = model.decoder.split(model.encode(None, grid))
        expected = presence_loss(model.word_maps(cells, tokens[:, 1:], present))
    torch.testing.assert_close(labelled.presence, expected)
    assert float(labelled.presence) != pytest.approx(float(plain.presence))
    torch.testing.assert_close(labelled.total - labelled.presence, plain.total - plain.presence)


def test_the_words_of_a_category_share_the_lowest_ids_class():
    words = ["<pad>", "<start>", "<end>", "<unk>", "a", "man", "dog", "woman", "puppy", "grass"]
    categories = {"man": "person", "woman": "person", "dog": "dog", "puppy": "dog", "a": None}
    categories = {w: c for w, c in categories.items() if c}
    assert category_classes(words, categories).tolist() == [0, 1, 2, 3, 4, 5, 6, 5, 6, 9]
    # a special token keeps its own class whatever a map says of it
    assert category_classes(words, {"<unk>": "person", "man": "person"})[3] == 3


def test_tied_words_share_one_score_label_and_map():
    """With classes, a word is scored, labelled and mapped as its class: two words of one
    category in a caption are one positive, and each gets the category's map."""
    torch.manual_seed(0)
    plain = WordLocaliser(DIM, WORDS, rank=8)
    tied = WordLocaliser(DIM, WORDS, rank=8, tied=True)
    tied.load_state_dict({**plain.state_dict(), "classes": torch.arange(WORDS)})
    grid = torch.randn(2, CELLS, DIM)
    targets = torch.tensor([[5, 7, 2, 0], [7, 9, 9, 2]])
    # untied: the same numbers as the plain localiser
    torch.testing.assert_close(tied(grid, targets).presence, plain(grid, targets).presence)
    classes = torch.arange(WORDS)
    classes[7] = 5  # 5 and 7 name one category
    tied.tie(classes)
    maps = tied(grid, targets)
    # candidates: the classes 0, 2, 5, 9; row 0 says 5 and 7: one positive
    assert maps.labels.tolist() == [[1, 1, 1, 0], [0, 1, 1, 1]]
    r = tied.sharpness
    own = torch.softmax(r * plain.scores(grid, torch.tensor([5])), dim=1)[:, :, 0]  # (B, L)
    torch.testing.assert_close(maps.log_maps[0, 1].exp(), own[0])  # word 7 gets 5's map
    torch.testing.assert_close(maps.log_maps[1, 0].exp(), own[1])
    torch.testing.assert_close(
        tied.scores(grid, torch.tensor([7])), plain.scores(grid, torch.tensor([5]))
    )
    assert torch.equal(tied.class_weights()[7], plain.words.weight[5])
    with pytest.raises(ValueError, match="its own class"):
        tied.tie(torch.tensor([0, 1, 2, 3, 4, 7, 6, 5, 8, 9, 10, 11]))  # 5 -> 7 -> 5
    with pytest.raises(ValueError, match="without classes"):
        plain.tie(classes)


def test_the_expected_word_score_reads_the_class_of_each_expected_word():
    """With one word expected, a tied word's attention is the own map times its class's
    localiser map, not the map its own (unused) row would give."""
    from tests.test_looks import _images, _model

    model = _model(
        drop_stages=5,
        word_maps=True,
        word_map_rank=8,
        word_attention=True,
        word_map_classes="categories",
    )
    classes = torch.arange(VOCAB_SIZE)
    classes[7] = 5
    model.word_maps.tie(classes)
    score = model.decoder.attention.score
    grid = model.encode(grid=model.encoder.backbone(_images()))
    cells, _ = model.decoder.split(grid)
    keys = model.decoder.prepare(grid)
    query = torch.randn(2, 24)
    with torch.no_grad():
        score.expect.weight.zero_()
        score.expect.bias.fill_(-30.0)
        score.expect.bias[7] = 30.0
        alpha = torch.softmax(score(keys, query), dim=-1)
        own = torch.softmax(score.score(score.score.project_keys(cells), query), dim=-1)
        product = own * model.word_maps.maps(cells, torch.tensor([5]))[..., 0]
        torch.testing.assert_close(alpha, product / product.sum(-1, keepdim=True))
        r = model.word_maps.sharpness
        untied = torch.softmax(
            r * model.word_maps.project(cells) @ model.word_maps.words.weight[7], 1
        )
        assert not torch.allclose(alpha, own * untied / (own * untied).sum(-1, keepdim=True))


def test_a_tied_models_localiser_maps_give_each_word_its_class_map():
    """What evaluate scores: the localiser's map of a decoded word is its class's."""
    from tests.test_looks import _model

    model = _model(drop_stages=5, word_maps=True, word_map_rank=8, word_map_classes="categories")
    classes = torch.arange(VOCAB_SIZE)
    classes[7] = 5
    model.word_maps.tie(classes)
    torch.manual_seed(1)
    features = model.encode(torch.randn(1, 3, 64, 64))
    with torch.no_grad():
        found = model.localiser_maps(features, torch.tensor([[5, 7, 9, 2]]))[0]  # (T, L)
    torch.testing.assert_close(found[0], found[1])
    assert not torch.allclose(found[0], found[2])


def test_the_expected_word_score_can_look_by_the_category_words_alone():
    """``model.word_attention_words=categories``: the words outside the mask add nothing
    (q not renormalised), so with only such words expected the map is the own score's."""
    from captioning.models.word_maps import category_words_mask
    from tests.test_looks import _images, _model

    settings = dict(drop_stages=5, word_maps=True, word_map_rank=8, word_attention=True)
    model = _model(**settings, word_map_classes="categories", word_attention_words="categories")
    score = model.decoder.attention.score
    looked = torch.zeros(VOCAB_SIZE, dtype=torch.bool)
    looked[[5, 7]] = True
    score.look_at(looked)
    grid = model.encode(grid=model.encoder.backbone(_images()))
    cells, _ = model.decoder.split(grid)
    keys = model.decoder.prepare(grid)
    query = torch.randn(2, 24)
    with torch.no_grad():
        own = score.score(score.score.project_keys(cells), query).float()
        expected = torch.softmax(score.expect(query).float(), dim=-1) * looked.float()
        prior = torch.einsum(
            "bv,blv->bl", expected, model.word_maps.scores(cells, torch.arange(VOCAB_SIZE))
        )
        shift = score(keys, query) - own - model.word_maps.sharpness * prior
        torch.testing.assert_close(shift - shift[:, :1], torch.zeros_like(shift), atol=1e-4, rtol=0)
        score.expect.weight.zero_()
        score.expect.bias.fill_(-30.0)
        score.expect.bias[9] = 30.0  # a word outside the mask: the own map alone
        torch.testing.assert_close(score(keys, query), own, atol=1e-4, rtol=0)
    with pytest.raises(ValueError, match="a mask over"):
        score.look_at(looked[:5])
    words = ["<pad>", "<start>", "<end>", "<unk>", "a", "man", "dog"]
    mask = category_words_mask(words, {"man": "person", "dog": "dog", "<unk>": "person"})
    assert mask.tolist() == [False, False, False, False, False, True, True]
