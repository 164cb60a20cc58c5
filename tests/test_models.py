"""Encoder, attention and decoder: shapes, flags and gradients on tiny models."""

import copy
import re

import pytest
import torch
from torch import nn

from captioning.config import ModelConfig, load_config
from captioning.errors import ConfigError
from captioning.models import attention as attention_module
from captioning.models import build_model, fused_score
from captioning.models import scores as scores_module
from captioning.models.attention import (
    AttentionSizes,
    HardAttention,
    HardContext,
    NoAttention,
    SoftAttention,
    build_attention,
)
from captioning.models.decoder import Decoder
from captioning.models.encoder import build_encoder, sinusoidal_positions
from captioning.models.scores import SCORES, make_score
from captioning.objectives.cross_entropy import caption_loss

TINY = [
    "model.encoder=small_cnn",
    "model.image_size=32",
    "model.cnn_channels=[8,16]",
    "model.fine_tune=all",
    "model.embed_dim=16",
    "model.hidden_dim=24",
    "model.attention_dim=12",
    "model.dropout=0",
]


def tiny_model(*overrides, vocab=11):
    torch.manual_seed(0)
    cfg = load_config(None, [*TINY, *overrides])
    return build_model(cfg.model, vocab, cfg.runtime)


def step_loop_twin(model, *overrides):
    """``tiny_model(*overrides)``'s twin with ``model``'s weights, built to run teacher
    forcing one word at a time (``runtime.parallel_decoder=false``)."""
    twin = tiny_model(*overrides, "runtime.parallel_decoder=false")
    assert twin.decoder.parallel is False and model.decoder.parallel is True
    twin.load_state_dict(model.state_dict())
    return twin


def batch(size=3, length=6, vocab=11):
    g = torch.Generator().manual_seed(1)
    images = torch.randint(0, 256, (size, 3, 32, 32), dtype=torch.uint8, generator=g)
    tokens = torch.randint(4, vocab, (size, length), generator=g)
    tokens[:, 0] = 1
    tokens[0, -2:] = 0  # padding
    tokens[0, -3] = 2
    return images, tokens


@pytest.mark.parametrize("name", sorted(SCORES))
def test_every_score_function(name):
    torch.manual_seed(0)
    score = make_score(name, feature_dim=8, query_dim=6, attention_dim=5, cells=9)
    attention = SoftAttention(score)
    features = torch.randn(4, 9, 8, requires_grad=True)
    query = torch.randn(4, 6, requires_grad=True)
    keys = attention.project_keys(features)
    out = attention(features, keys, query)
    assert out.alpha.shape == (4, 9) and out.context.shape == (4, 8)
    assert torch.allclose(out.alpha.sum(dim=1), torch.ones(4), atol=1e-6)
    assert out.log_prob is None
    # a loss that depends on where attention goes: every parameter gets a gradient
    loss = (out.alpha * torch.arange(9.0)).sum() + out.context.pow(2).sum()
    loss.backward()
    for pname, param in score.named_parameters():
        assert param.grad is not None and param.grad.abs().sum() > 0, pname
    assert query.grad.abs().sum() > 0 and features.grad.abs().sum() > 0


@pytest.mark.parametrize("kind", ["soft", "hard", "none"])
@pytest.mark.parametrize("name", sorted(SCORES))
def test_grouped_queries_equal_a_repeated_grid(kind, name):
    """G queries per image against one copy of the grid give what G copies of it give."""
    torch.manual_seed(0)
    attention = attention_module.build_attention(
        ModelConfig(attention=kind, score=name, attention_dim=5),
        AttentionSizes(8, 6, 9, (1, 9), 8),
    )
    images, g = 3, 4
    features = torch.randn(images, 9, 8)
    query = torch.randn(images * g, 6)  # image-major: the 4 queries of image 0 first
    cells = torch.randint(0, 9, (images * g,))
    keys = attention.project_keys(features)
    repeated = features.repeat_interleave(g, dim=0)  # (B*G, L, D)
    hard = HardContext(mode="argmax", cells=cells) if kind == "hard" else HardContext()
    grouped = attention(features, keys, query, hard)
    copied = attention(repeated, attention.project_keys(repeated), query, hard)
    assert grouped.alpha.shape == (images * g, 9) and grouped.context.shape == (images * g, 8)
    torch.testing.assert_close(grouped.alpha, copied.alpha, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(grouped.context, copied.context, rtol=1e-5, atol=1e-6)
    if kind == "hard":
        assert torch.equal(
            grouped.context, features[torch.arange(images).repeat_interleave(g), cells]
        )
        torch.testing.assert_close(grouped.log_prob, copied.log_prob)
    with pytest.raises(ValueError, match="do not divide"):
        attention(features, keys, torch.randn(images * g + 1, 6))


def test_additive_score_in_blocks_and_in_compiled_form_match_the_plain_one(monkeypatch):
    monkeypatch.setattr(fused_score, "ENABLED", False)  # the torch forms; test_fused_score.py: C
    torch.manual_seed(0)
    score = make_score("additive", 8, 6, 5)
    keys = score.project_keys(torch.randn(7, 9, 8))
    query = torch.randn(7 * 3, 6)
    blocks = []
    plain_scores, in_place = score._scores, score.sigmoid_
    assert scores_module.SIGMOID_TANH  # fp32 blocks' tanh is 2 sigmoid(2x) - 1
    score._scores = lambda k, q, sink: blocks.append(k.shape[0]) or plain_scores(k, q, sink)
    score.sigmoid_ = lambda hidden: blocks.append(hidden.shape[0]) or in_place(hidden)
    with torch.no_grad():
        plain = score(keys, query)  # one block: 7 * 3 * 9 * 5 values fit the budget
        assert blocks == [7]
        monkeypatch.setattr(scores_module, "SCORE_BLOCK_ELEMENTS", 2 * 3 * 9 * 5)
        blocked = score(keys, query)  # blocks of 2 images, the last one of 1
        assert blocks == [7, 2, 2, 2, 1]
        monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
        fused = score(keys, query)  # the reduction form that torch.compile fuses
    expected = (
        torch.tanh(keys.repeat_interleave(3, dim=0) + score.query_proj(query)[:, None])
        @ score.out.weight[0]
        + score.out.bias
    )
    assert plain.shape == (21, 9)
    torch.testing.assert_close(plain, expected)
    torch.testing.assert_close(blocked, expected)
    torch.testing.assert_close(fused, expected)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: False)
    dtypes = []
    score.sigmoid_ = lambda hidden: dtypes.append(hidden.dtype) or in_place(hidden)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        half = score(keys.bfloat16(), query)  # bf16 keys: the blocks' sigmoid in fp32
        monkeypatch.setattr(scores_module, "SIGMOID_TANH", False)
        tanh = score(keys.bfloat16(), query)  # tanh in the keys' bf16
    assert dtypes == [torch.float32] * 4
    assert half.dtype == torch.float32 and tanh.dtype == torch.bfloat16
    error = (half - expected).abs().max()
    assert error < 0.02 and error < (tanh.float() - expected).abs().max()


def test_make_score_accepts_a_module_and_rejects_unknown_names():
    module = make_score("dot", 4, 4, 4)
    assert make_score(module, 4, 4, 4) is module
    with pytest.raises(Exception, match="model.score must be one of"):
        make_score("bilinear", 4, 4, 4)


def test_no_attention_is_a_uniform_average():
    features = torch.randn(2, 5, 3)
    attention = NoAttention()
    out = attention(features, attention.project_keys(features), torch.randn(2, 4))
    assert torch.allclose(out.alpha, torch.full((2, 5), 0.2))
    assert torch.allclose(out.context, features.mean(dim=1))


def test_hard_attention_samples_a_cell_and_reports_its_log_prob():
    torch.manual_seed(0)
    attention = HardAttention(make_score("additive", 3, 4, 5))
    features = torch.randn(6, 7, 3)
    keys = attention.project_keys(features)
    query = torch.randn(6, 4)
    out = attention(features, keys, query, HardContext(mode="sample"))
    rows = torch.arange(6)
    assert torch.equal(out.context, features[rows, out.trace.cell])
    assert torch.allclose(out.log_prob, out.alpha[rows, out.trace.cell].log())
    argmax = attention(features, keys, query, HardContext(mode="argmax"))
    assert torch.equal(argmax.trace.cell, argmax.alpha.argmax(dim=1))
    expected = attention(features, keys, query, HardContext())
    assert expected.log_prob is None
    assert torch.allclose(expected.context, torch.einsum("bl,bld->bd", expected.alpha, features))


def small_cnn(**settings):
    """A small CNN encoder for 32 px images, trained from scratch."""
    return build_encoder(
        ModelConfig(encoder="small_cnn", image_size=32, fine_tune="all", **settings)
    )


def test_encoder_grid_positions_and_freezing():
    enc = small_cnn(cnn_channels=[8, 16])
    assert enc.grid_shape == (16, 16) and enc(torch.zeros(2, 3, 32, 32)).shape == (2, 256, 16)
    pooled = small_cnn(cnn_channels=[8, 16], grid_size=4)
    assert pooled.grid_shape == (4, 4)
    codes = sinusoidal_positions(3, 4, 8)
    assert codes.shape == (12, 8) and len({tuple(r.tolist()) for r in codes}) == 12
    sin = small_cnn(cnn_channels=[8, 16], positional="sinusoidal")
    flat = torch.zeros(1, 3, 32, 32)
    cells = sin(flat)[0]
    assert len({tuple(c.round(decimals=4).tolist()) for c in cells}) == 256  # cells differ
    learned = small_cnn(cnn_channels=[8, 16], positional="learned")
    assert learned.positions.requires_grad

    frozen = build_encoder(
        ModelConfig(
            encoder="small_cnn", image_size=32, cnn_channels=[8, 16, 16], fine_tune="last_1"
        )
    )
    frozen.train()
    assert not frozen.stages[0].training and frozen.stages[-1].training
    assert not any(p.requires_grad for p in frozen.stages[0].parameters())
    assert all(p.requires_grad for p in frozen.stages[-1].parameters())
    before = frozen.stages[0][1].running_mean.clone()
    frozen(torch.randint(0, 256, (4, 3, 32, 32)).float())
    assert torch.equal(before, frozen.stages[0][1].running_mean)  # BN statistics do not drift


def test_vgg19_conv5_4_grid_without_download():
    enc = build_encoder(ModelConfig(encoder="vgg19", image_size=224))
    assert enc.grid_shape == (14, 14) and enc.out_channels == 512
    assert isinstance(list(enc.stages[-1])[-1], nn.ReLU)  # ends at conv5_4 + ReLU, no pool
    assert not any(p.requires_grad for p in enc.parameters())


def test_drop_stages_takes_an_earlier_stages_grid():
    whole = build_encoder(ModelConfig(encoder="mobilenet_v2", image_size=64))
    cut = build_encoder(ModelConfig(encoder="mobilenet_v2", image_size=64, drop_stages=1))
    assert (whole.out_channels, cut.out_channels) == (1280, 320)
    assert cut.grid_shape == whole.grid_shape == (2, 2)  # the 1 x 1 head keeps the resolution
    assert len(cut.stages) == len(whole.stages) - 1
    with torch.no_grad():
        grid = cut(torch.randint(0, 256, (2, 3, 64, 64)).float())
    assert grid.shape == (2, 4, 320)
    with pytest.raises(ConfigError, match="leaves nothing of mobilenet_v2's 19 stages"):
        build_encoder(ModelConfig(encoder="mobilenet_v2", drop_stages=19))
    with pytest.raises(ConfigError, match="is for a pretrained backbone"):
        build_encoder(ModelConfig(encoder="small_cnn", cnn_channels=[8, 16], drop_stages=1))


def test_bad_encoder_names_and_weights():
    with pytest.raises(Exception, match="not a torchvision model"):
        build_encoder(ModelConfig(encoder="resnet9000"))
    with pytest.raises(Exception, match="neither a file nor a weights name"):
        build_encoder(ModelConfig(encoder="resnet50", weights="IMAGENET_SUPER"))


def test_teacher_forced_forward_equals_repeated_step():
    model = tiny_model().eval()
    images, tokens = batch()
    with torch.no_grad():
        out = model(images, tokens)
        features = model.encoder(images)
        keys = model.decoder.prepare(features)
        state = model.decoder.init_state(features)
        for t in range(tokens.shape[1] - 1):
            step = model.decoder.step(tokens[:, t], state, features, keys)
            assert torch.allclose(step.logits, out.logits[:, t], atol=1e-5)
            assert torch.allclose(step.attention.alpha, out.alphas[:, t], atol=1e-6)
            state = step.state


@pytest.mark.parametrize(
    ("flag", "check"),
    [
        ("model.gate=vector", lambda m: m.decoder.gate.out_features == 128 // 8),
        ("model.gate=none", lambda m: m.decoder.gate is None),
        ("model.deep_output=false", lambda m: m.decoder.out.in_features == 24),
        ("model.init_state=linear", lambda m: True),
        ("model.score=additive_relu", lambda m: True),
    ],
)
def test_each_decoder_flag_changes_the_computation(flag, check):
    base = tiny_model().eval()
    variant = tiny_model(flag).eval()
    assert check(variant) or flag == "model.gate=vector"
    images, tokens = batch()
    # copy every parameter the two share, so only the flag can explain a difference
    theirs = variant.state_dict()
    shared = {
        k: v for k, v in base.state_dict().items() if k in theirs and theirs[k].shape == v.shape
    }
    variant.load_state_dict(shared, strict=False)
    with torch.no_grad():
        assert not torch.allclose(base(images, tokens).logits, variant(images, tokens).logits)


def test_flag_semantics():
    model = tiny_model("model.gate=vector").eval()
    assert model.decoder.gate.out_features == 16  # one gate per feature channel
    model = tiny_model("model.init_state=linear").eval()
    features = torch.randn(2, 5, 16) * 10
    assert model.decoder.init_state(features).h.abs().max() > 1  # no tanh squashing
    model = tiny_model().eval()
    assert model.decoder.init_state(features).h.abs().max() <= 1


def test_padding_never_counts():
    model = tiny_model()
    images, tokens = batch()
    out = model(images, tokens)
    loss = caption_loss(out, tokens[:, 1:], 0, penalty_weight=1.0)
    # change what the model predicts at padded positions: the loss must not move
    logits = out.logits.clone()
    logits[0, -2:] += torch.randn_like(logits[0, -2:]) * 10
    alphas = out.alphas.clone()
    alphas[0, -2:] = torch.softmax(torch.randn_like(alphas[0, -2:]) * 5, dim=-1)
    from dataclasses import replace

    moved_out = replace(out, logits=logits, trace=replace(out.trace, alpha=alphas))
    moved = caption_loss(moved_out, tokens[:, 1:], 0, 1.0)
    assert torch.allclose(loss.total, moved.total)
    assert loss.tokens == int((tokens[:, 1:] != 0).sum())


def test_label_smoothing_trains_on_the_smoothed_loss_and_logs_the_plain_one():
    model = tiny_model()
    images, tokens = batch()
    out = model(images, tokens)
    targets = tokens[:, 1:]
    plain = caption_loss(out, targets, 0, penalty_weight=0.0)
    smoothed = caption_loss(out, targets, 0, penalty_weight=0.0, label_smoothing=0.2)
    # by hand: 0.8 * -log p(y) + 0.2 * mean over the vocabulary of -log p(v), real words only
    log_p = torch.log_softmax(out.logits.float(), dim=-1)  # (B, T, V)
    mask = (targets != 0).float()
    per_token = -0.8 * log_p.gather(2, targets.unsqueeze(2)).squeeze(2) - 0.2 * log_p.mean(2)
    expected = (per_token * mask).sum(1).mean()
    assert torch.allclose(smoothed.total, expected, atol=1e-5)
    assert not torch.allclose(smoothed.total, plain.total)
    assert torch.allclose(smoothed.nll, plain.nll)  # what is logged stays the likelihood
    assert torch.allclose(smoothed.nll_per_token, plain.nll_per_token)


def test_doubly_stochastic_penalty_value():
    from captioning.objectives.cross_entropy import doubly_stochastic_penalty

    alphas = torch.tensor([[[1.0, 0.0], [0.0, 1.0], [0.5, 0.5]]])  # (1, T=3, L=2)
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    assert doubly_stochastic_penalty(alphas, mask).item() == pytest.approx(0.0)
    mask = torch.ones(1, 3)
    assert doubly_stochastic_penalty(alphas, mask).item() == pytest.approx(0.5)


def test_the_penalty_target_does_not_change_the_scores_gradient():
    """Sum_i (tau - sum_t alpha_ti)^2 with tau = T / L (a caption's words spread over the
    cells) gives the scores the gradient the paper's tau = 1 gives: the softmax drops a
    term the same for every cell (docs/grounding.md), so a target cannot move the even
    optimum; the penalty's value does change."""
    from captioning.objectives.cross_entropy import doubly_stochastic_penalty

    scores = torch.randn(2, 7, 12, generator=torch.Generator().manual_seed(0), requires_grad=True)
    mask = torch.ones(2, 7)
    mask[1, 5:] = 0
    alphas = torch.softmax(scores, dim=2)
    paper = doubly_stochastic_penalty(alphas, mask).sum()
    (paper_grad,) = torch.autograd.grad(paper, scores)
    coverage = (torch.softmax(scores, dim=2) * mask.unsqueeze(2)).sum(dim=1)  # (B, L)
    spread = (mask.sum(dim=1, keepdim=True) / 12 - coverage).pow(2).sum()
    (spread_grad,) = torch.autograd.grad(spread, scores)
    torch.testing.assert_close(spread_grad, paper_grad, atol=1e-6, rtol=1e-5)
    assert float(paper_grad.abs().max()) > 0.1 and float((paper - spread).detach()) > 1


def test_one_batch_overfit():
    torch.manual_seed(0)
    model = tiny_model("model.hidden_dim=64", "model.embed_dim=32")
    images, tokens = batch(size=8, length=8)
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(100):
        out = model(images, tokens)
        loss = caption_loss(out, tokens[:, 1:], 0, penalty_weight=0.0).total
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < 0.1 * losses[0], (losses[0], losses[-1])


def test_decoder_rejects_unknown_gate():
    with pytest.raises(ValueError, match="gate"):
        Decoder(10, 4, NoAttention(), embed_dim=4, hidden_dim=4, gate="diagonal")


@pytest.mark.parametrize("kind", ["soft", "hard", "none"])
@pytest.mark.parametrize("gate", ["scalar", "vector", "none"])
def test_all_words_at_once_equal_the_step_loop(kind, gate):
    """Without the context in the LSTM, teacher forcing runs all words at once (one fused
    LSTM call, all queries scored together): the same logits, alphas, log-probabilities and
    gradients as the step function that decoding uses, for every score function."""
    for name in SCORES:
        torch.manual_seed(0)
        attention = attention_module.build_attention(
            ModelConfig(attention=kind, score=name, attention_dim=5),
            AttentionSizes(6, 8, 7, (1, 7), 6),
        )
        decoder = Decoder(
            11,
            6,
            attention,
            embed_dim=4,
            hidden_dim=8,
            gate=gate,
            context_to_lstm=False,
            dropout=0.0,
            parallel=True,
        )
        features = torch.randn(3, 7, 6)
        tokens = torch.randint(1, 11, (3, 5))
        cells = torch.randint(0, 7, (3, 5))
        hard = HardContext(mode="sample", cells=cells) if kind == "hard" else HardContext()
        params = list(decoder.parameters())

        def gradients(logits, log_probs, params=params):
            loss = (logits**2).sum() + (log_probs.sum() if log_probs is not None else 0)
            grads = torch.autograd.grad(loss, params, allow_unused=True)
            return [torch.zeros_like(p) if g is None else g for g, p in zip(grads, params)]

        together = decoder(features, tokens, hard)
        keys, state = decoder.prepare(features), decoder.init_state(features)
        logits, alphas, log_probs = [], [], []
        for t in range(tokens.shape[1]):
            out = decoder.step(tokens[:, t], state, features, keys, hard.at(t))
            state = out.state
            logits.append(out.logits)
            alphas.append(out.attention.alpha)
            log_probs.append(out.attention.log_prob)
        stepped = torch.stack(logits, dim=1)
        stepped_log_probs = torch.stack(log_probs, dim=1) if kind == "hard" else None
        torch.testing.assert_close(together.logits, stepped, rtol=0, atol=1e-5)
        torch.testing.assert_close(together.alphas, torch.stack(alphas, 1), rtol=0, atol=1e-5)
        if kind == "hard":
            torch.testing.assert_close(together.log_probs, stepped_log_probs, rtol=0, atol=1e-5)
        for a, b in zip(
            gradients(together.logits, together.log_probs), gradients(stepped, stepped_log_probs)
        ):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-5)


@pytest.mark.parametrize("kind", ["soft", "hard", "none", "marginal"])
@pytest.mark.parametrize("context_to_lstm", [False, True])
def test_several_captions_per_image_equal_a_repeated_grid(kind, context_to_lstm):
    """Teacher forcing G captions per image against one copy of the grid (how self-critical
    training scores its samples) gives the logits, log-probabilities and gradients of the
    same captions against the grid repeated G times."""
    if kind == "marginal" and context_to_lstm:
        pytest.skip("the exact marginal needs the context outside the LSTM")
    for name in SCORES:
        torch.manual_seed(0)
        attention = attention_module.build_attention(
            ModelConfig(
                attention="hard" if kind == "marginal" else kind, score=name, attention_dim=5
            ),
            AttentionSizes(6, 8, 7, (1, 7), 6),
        )
        decoder = Decoder(
            11,
            6,
            attention,
            embed_dim=4,
            hidden_dim=8,
            gate="scalar",
            context_to_lstm=context_to_lstm,
            dropout=0.0,
        )
        features = torch.randn(2, 7, 6)
        tokens = torch.randint(1, 11, (2 * 3, 5))  # three captions per image
        targets = torch.randint(1, 11, (2 * 3, 5))
        hard = {
            "hard": HardContext(mode="sample", cells=torch.randint(0, 7, (6, 5))),
            "marginal": HardContext(mode="marginal"),
        }.get(kind, HardContext())
        params = list(decoder.parameters())
        results = []
        for grid in (features, features.repeat_interleave(3, dim=0)):
            out = decoder(grid, tokens, hard, targets if kind == "marginal" else None)
            value = out.target_log_probs if kind == "marginal" else out.logits
            loss = (value**2).sum() + (out.log_probs.sum() if out.log_probs is not None else 0)
            grads = torch.autograd.grad(loss, params, allow_unused=True)
            results.append((value, out.alphas, grads))
        (grouped, grouped_alphas, grouped_grads), (repeated, repeated_alphas, repeated_grads) = (
            results
        )
        assert grouped.shape[0] == 6
        torch.testing.assert_close(grouped, repeated, rtol=0, atol=1e-5)
        torch.testing.assert_close(grouped_alphas, repeated_alphas, rtol=0, atol=1e-5)
        for a, b in zip(grouped_grads, repeated_grads):
            if a is None or b is None:
                assert a is None and b is None
            else:  # gradients sum over rows in another order: float32 rounding
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_all_words_at_once_train_to_the_same_weights_as_the_step_loop():
    """Five SGD steps of the whole model (encoder included, dropout off) with all words at
    once end at the weights the step loop reaches, to float32 rounding. (Not Adam: it turns
    rounding noise in a zero gradient, such as the score's bias under the softmax, into
    full-size steps.)"""
    images, tokens = batch()
    trained = []
    for parallel in ("false", "true"):
        model = tiny_model(
            "model.context_to_lstm=false",
            "model.dropout=0.0",
            f"runtime.parallel_decoder={parallel}",
        )
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        for _ in range(5):
            optimizer.zero_grad()
            caption_loss(
                model(images, tokens), tokens[:, 1:], 0, penalty_weight=1.0
            ).total.backward()
            optimizer.step()
        trained.append(dict(model.named_parameters()))
    loop, together = trained
    assert loop.keys() == together.keys()
    moved = 0
    for name, param in loop.items():
        torch.testing.assert_close(together[name], param, rtol=0, atol=1e-5, msg=name)
        moved += int(not torch.equal(param, tiny_model().state_dict()[name]))
    assert moved > 10  # the comparison covers weights that trained


def test_exact_marginal_in_chunks_equals_one_chunk_and_decodes(monkeypatch):
    """The marginal over cells does not depend on the chunk size (the chunks are recomputed
    in the backward pass), and the step function gives the same distribution."""
    from captioning.models import decoder as decoder_module

    torch.manual_seed(0)
    attention = attention_module.build_attention(
        ModelConfig(attention="hard", score="additive", attention_dim=5),
        AttentionSizes(6, 8, 7, (1, 7), 6),
    )
    decoder = Decoder(
        11,
        6,
        attention,
        embed_dim=4,
        hidden_dim=8,
        gate="vector",
        context_to_lstm=False,
        dropout=0.0,
    )
    features = torch.randn(3, 7, 6)
    tokens = torch.randint(1, 11, (3, 5))
    targets = torch.randint(1, 11, (3, 5))
    params = list(decoder.parameters())
    results = []
    for budget in (1 << 24, 3 * 5 * 11 * 2):  # one chunk; chunks of 2 cells
        monkeypatch.setattr(decoder_module, "MARGINAL_CHUNK_ELEMENTS", budget)
        out = decoder(features, tokens, HardContext(mode="marginal"), targets)
        grads = torch.autograd.grad(out.target_log_probs.sum(), params)
        results.append((out.target_log_probs, grads))
    torch.testing.assert_close(results[0][0], results[1][0])
    for a, b in zip(results[0][1], results[1][1]):
        torch.testing.assert_close(a, b)
    # the step function's marginal distribution at step 0 gives the same target log-prob
    keys, state = decoder.prepare(features), decoder.init_state(features)
    step = decoder.step(tokens[:, 0], state, features, keys, HardContext(mode="marginal"))
    assert torch.allclose(step.logits.logsumexp(dim=1), torch.zeros(3), atol=1e-5)
    picked = step.logits.gather(1, targets[:, :1]).squeeze(1)
    torch.testing.assert_close(picked, results[0][0][:, 0].detach())


def test_exact_marginal_dropout_is_one_mask_per_word_whatever_the_chunks(monkeypatch):
    """In training, the deep output's dropout mask is drawn once per word and shared by the
    cells, so the chunking (and the recomputation in the backward pass) leaves the numbers
    unchanged under the same seed."""
    from captioning.models import decoder as decoder_module

    torch.manual_seed(0)
    attention = attention_module.build_attention(
        ModelConfig(attention="hard", score="additive", attention_dim=5),
        AttentionSizes(6, 8, 7, (1, 7), 6),
    )
    decoder = Decoder(
        11, 6, attention, embed_dim=4, hidden_dim=8, gate="none", context_to_lstm=False, dropout=0.5
    ).train()
    features, tokens = torch.randn(3, 7, 6), torch.randint(1, 11, (3, 5))
    targets = torch.randint(1, 11, (3, 5))
    results = []
    for budget in (1 << 24, 3 * 5 * 11 * 2):
        monkeypatch.setattr(decoder_module, "MARGINAL_CHUNK_ELEMENTS", budget)
        torch.manual_seed(5)
        out = decoder(features, tokens, HardContext(mode="marginal"), targets)
        grads = torch.autograd.grad(out.target_log_probs.sum(), list(decoder.parameters()))
        results.append((out.target_log_probs, grads))
    torch.testing.assert_close(results[0][0], results[1][0])
    for a, b in zip(results[0][1], results[1][1]):
        torch.testing.assert_close(a, b)
    torch.manual_seed(6)  # and dropout does act: another mask, other numbers
    other = decoder(features, tokens, HardContext(mode="marginal"), targets).target_log_probs
    assert not torch.allclose(other, results[0][0])


def test_grid_self_attention_relates_cells_and_trains():
    """``model.grid_layers``: each layer starts as the identity; once trained a little, a
    cell's feature depends on far cells (beyond the CNN's receptive field), which it never
    does without the layers. Every parameter gets gradients, at the decoder's learning rate,
    and cached grids pass through the layers like images do."""
    from captioning.config import TrainConfig
    from captioning.training.optim import build_optimizer

    images, tokens = batch()
    changed = images.clone()
    changed[:, :, :4, :4] = 255 - changed[:, :, :4, :4]  # the top-left corner only

    def far_change(model):  # how much the bottom-right cell moves
        with torch.no_grad():
            return float((model.encode(images) - model.encode(changed))[:, -1].abs().max())

    plain = tiny_model().eval()
    model = tiny_model("model.grid_layers=2", "model.grid_heads=4")
    assert model.grid is not None and len(model.grid.layers.layers) == 2
    model.eval()
    with torch.no_grad():
        torch.testing.assert_close(model.encode(images), model.encoder(images))  # identity
    assert far_change(plain) < 1e-6 and far_change(model) < 1e-6
    optimizer = build_optimizer(model, TrainConfig(lr=1e-2, encoder_lr=1e-5))
    lr_of = {id(p): group["lr"] for group in optimizer.param_groups for p in group["params"]}
    assert all(lr_of[id(p)] == 1e-2 for p in model.grid.parameters())
    assert all(lr_of[id(p)] == 1e-5 for p in model.encoder.parameters() if p.requires_grad)
    assert len(lr_of) == sum(1 for p in model.parameters() if p.requires_grad)
    model.train()
    for _ in range(3):
        optimizer.zero_grad()
        caption_loss(model(images, tokens), tokens[:, 1:], 0, penalty_weight=0.0).total.backward()
        optimizer.step()
    for name, param in model.grid.named_parameters():
        assert param.grad is not None and param.grad.abs().sum() > 0, name
    model.eval()
    assert far_change(model) > 1e-4
    with torch.no_grad():
        cached = model.encoder.backbone(images)
        torch.testing.assert_close(model.encode(grid=cached), model.encode(images))


def test_grid_self_attention_settings_are_checked():
    with pytest.raises(ConfigError, match="model.grid_layers must be at least 0, got -1"):
        load_config(None, [*TINY, "model.grid_layers=-1"])
    with pytest.raises(ConfigError, match="model.grid_heads=3 must divide"):
        tiny_model("model.grid_layers=1", "model.grid_heads=3")


def test_location_score_looks_at_where_not_at_what():
    """``model.score=location``: alpha = softmax(W_a h) depends on the decoder state only;
    two grids with other contents get the same weights (and other contexts)."""
    torch.manual_seed(0)
    attention = attention_module.build_attention(
        ModelConfig(attention="soft", score="location", attention_dim=5),
        AttentionSizes(8, 6, 9, (1, 9), 8),
    )
    query = torch.randn(4, 6)
    a, b = torch.randn(4, 9, 8), torch.randn(4, 9, 8)
    out_a = attention(a, attention.project_keys(a), query)
    out_b = attention(b, attention.project_keys(b), query)
    torch.testing.assert_close(out_a.alpha, out_b.alpha)
    assert not torch.allclose(out_a.context, out_b.context)
    expected = torch.softmax(attention.score.proj(query), dim=1)
    torch.testing.assert_close(out_a.alpha, expected)
    with pytest.raises(ValueError, match="built for 9 cells; this grid has 7"):
        small = torch.randn(4, 7, 8)
        attention(small, attention.project_keys(small), query)
    with pytest.raises(ConfigError, match="needs the number of grid cells"):
        make_score("location", 8, 6, 5)
    model = tiny_model("model.score=location")  # the grid's size comes from the encoder
    images, tokens = batch()
    assert model(images, tokens).alphas.shape[-1] == model.encoder.num_cells


@pytest.mark.parametrize("attention", ["soft", "hard"])
def test_key_value_attention_averages_projected_values(attention):
    """``model.values=projected``: the keys score the cells, the context averages values
    W_v a_i of their own size; the step loop, all words at once and the exact marginal agree,
    and the value projection trains."""
    images, tokens = batch()
    settings = [
        f"model.attention={attention}",
        "model.values=projected",
        "model.value_dim=7",
        "model.context_to_lstm=false",
    ]
    model = tiny_model(*settings)
    decoder = model.decoder
    features = model.encode(images)
    prepared = decoder.prepare(features)
    assert prepared.shape[-1] == 7 + decoder.attention.project_keys(features).shape[-1]
    state = decoder.init_state(features)
    hard = HardContext(mode="expectation")
    out = decoder.step(tokens[:, 0], state, features, prepared, hard)
    values = decoder.value_proj(features)  # (B, L, 7)
    expected = torch.bmm(out.attention.alpha.unsqueeze(1), values).squeeze(1)
    torch.testing.assert_close(out.attention.context, expected)
    loop = step_loop_twin(model, *settings)(images, tokens)
    together = model(images, tokens)
    torch.testing.assert_close(together.logits, loop.logits, rtol=0, atol=1e-5)
    caption_loss(together, tokens[:, 1:], 0, penalty_weight=0.0).total.backward()
    assert decoder.value_proj.weight.grad.abs().sum() > 0
    if attention == "hard":  # the marginal sums over the cells' values
        marginal = model(images, tokens, hard=HardContext(mode="marginal"))
        keys, state = decoder.prepare(features), decoder.init_state(features)
        step = decoder.step(tokens[:, 0], state, features, keys, HardContext(mode="marginal"))
        picked = step.logits.gather(1, tokens[:, 1:2]).squeeze(1)
        torch.testing.assert_close(picked, marginal.target_log_probs[:, 0])
    with pytest.raises(ConfigError, match="model.attention=none has none"):
        load_config(None, ["model.attention=none", "model.values=projected"])


@pytest.mark.parametrize("score", ["scaled_dot", "additive"])
def test_multi_head_attention(score):
    """``model.heads=H``: H heads with their own projections, starting as copies of one;
    ``alpha`` is their mean (a distribution), each head's weights are reported, every head
    trains, and all words at once equal the step loop."""
    images, tokens = batch()
    settings = ["model.heads=4", f"model.score={score}", "model.context_to_lstm=false"]
    model = tiny_model(*settings)
    attention = model.decoder.attention
    assert len(attention.heads) == 4
    features = model.encode(images)
    query = torch.randn(3, 24)
    out = attention(features, model.decoder.prepare(features), query)
    heads = out.trace.heads  # (3, H, L)
    torch.testing.assert_close(heads[:, 0], heads[:, 1])  # they start as one head
    with torch.no_grad():  # as training parts them
        for index, head in enumerate(attention.heads):
            for param in head.parameters():
                param.add_(0.3 * index * torch.randn_like(param))
    keys = model.decoder.prepare(features)
    out = attention(features, keys, query)
    heads = out.trace.heads
    assert heads.shape == (3, 4, features.shape[1])
    torch.testing.assert_close(out.alpha, heads.mean(dim=1))
    torch.testing.assert_close(heads.sum(dim=2), torch.ones(3, 4))
    assert not torch.allclose(heads[:, 0], heads[:, 1])  # heads look differently
    twin = step_loop_twin(model, *settings)
    loop = twin(images, tokens)
    torch.testing.assert_close(model(images, tokens).logits, loop.logits, rtol=0, atol=1e-5)
    caption_loss(loop, tokens[:, 1:], 0, penalty_weight=0.0).total.backward()
    for name, param in twin.decoder.attention.named_parameters():
        if name.endswith("out.bias"):  # shifts every cell's score alike: the softmax
            continue  # ignores it, and its gradient is zero up to rounding
        assert param.grad is not None and param.grad.abs().sum() > 0, name
    for setting, message in (
        (["model.attention=hard"], "model.heads=4 needs model.attention=soft"),
        (["model.attention=hrad"], "did you mean 'hard'"),
        (["model.score=addtive"], "did you mean 'additive'"),
    ):
        with pytest.raises(ConfigError, match=message):
            build_model(load_config(None, ["model.heads=4", *setting]).model, 11)


def test_local_attention_is_a_gaussian_window_around_a_predicted_centre():
    """``model.attention=local``: alpha = softmax(score - ||cell - p||^2 / (2 sigma^2)), a
    distribution; the centre p is differentiable and moves toward a target cell under a few
    gradient steps on -log alpha(target)."""
    torch.manual_seed(0)
    attention = attention_module.build_attention(
        ModelConfig(attention="local", score="additive", attention_dim=5, local_sigma=0.8),
        AttentionSizes(8, 6, 12, (3, 4), 8),
    )
    features, query = torch.randn(2, 12, 8), torch.randn(2, 6)
    keys = attention.project_keys(features).detach()
    out = attention(features, keys, query)
    centre = out.trace.centre  # (2, 2)
    assert centre.shape == (2, 2)
    assert bool(((centre >= 0) & (centre <= torch.tensor([3.0, 4.0]))).all())
    rows, cols = torch.meshgrid(torch.arange(3.0), torch.arange(4.0), indexing="ij")
    cells = torch.stack([rows.flatten() + 0.5, cols.flatten() + 0.5], dim=1)  # (12, 2)
    distance = (cells[None] - centre[:, None]).pow(2).sum(2)
    expected = torch.softmax(attention.score(keys, query) - distance / (2 * 0.8**2), dim=1)
    torch.testing.assert_close(out.alpha, expected)
    target = 11  # the bottom-right cell, centre (2.5, 3.5)
    before = float((centre.detach() - cells[target]).norm(dim=1).mean())
    optimizer = torch.optim.Adam(attention.centre.parameters(), lr=0.05)
    for _ in range(30):
        optimizer.zero_grad()
        loss = -torch.log(attention(features, keys, query).alpha[:, target]).mean()
        loss.backward()
        optimizer.step()
    after = attention(features, keys, query).trace.centre.detach()
    assert float((after - cells[target]).norm(dim=1).mean()) < before / 2
    with pytest.raises(ConfigError, match="model.local_sigma must be more than 0"):
        load_config(None, ["model.attention=local", "model.local_sigma=0"])


def test_channels_last_encoder_gives_the_same_grid_and_gradients():
    """The encoder's convolutions run channels-last (``runtime.channels_last``, the default);
    the grid and the gradients equal those of the plain layout (to float32 rounding), and the
    grid comes out contiguous (B, L, D)."""
    images, _ = batch()
    grids, grads = [], []
    for channels_last in (False, True):
        model = tiny_model(f"runtime.channels_last={channels_last}")
        first_conv = next(m for m in model.encoder.modules() if isinstance(m, nn.Conv2d))
        layout = torch.channels_last if channels_last else torch.contiguous_format
        assert first_conv.weight.is_contiguous(memory_format=layout)
        grid = model.encoder(images)
        grid.square().sum().backward()
        grids.append(grid)
        grads.append([p.grad for p in model.encoder.parameters() if p.grad is not None])
    assert grids[1].is_contiguous() and grids[1].shape == grids[0].shape
    torch.testing.assert_close(grids[1], grids[0], rtol=1e-5, atol=1e-5)
    assert len(grads[0]) == len(grads[1]) > 0
    for a, b in zip(*grads):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("name", ["mobilenet_v2", "resnet18"])
def test_folded_batch_norms_give_the_same_grid(name):
    """Folding each BatchNorm into the convolution before it (for inference) leaves the
    grid as it was, with BatchNorm statistics far from the identity; MobileNetV2 loses every
    BatchNorm, and an encoder in training mode refuses."""
    torch.manual_seed(0)
    encoder = build_encoder(ModelConfig(encoder=name, weights=None, image_size=64))
    with torch.no_grad():
        for module in encoder.modules():
            if isinstance(module, nn.BatchNorm2d):
                module.running_mean.uniform_(-0.5, 0.5)
                module.running_var.uniform_(0.5, 2.0)
                module.weight.uniform_(0.5, 1.5)
                module.bias.uniform_(-0.2, 0.2)
    with pytest.raises(RuntimeError, match="eval mode"):
        encoder.train().fold_batch_norms()
    encoder.eval()
    images = torch.randint(0, 256, (2, 3, 64, 64), dtype=torch.uint8)
    with torch.no_grad():
        before = encoder(images)
    norms = sum(isinstance(m, nn.BatchNorm2d) for m in encoder.modules())
    folded = encoder.fold_batch_norms()
    left = sum(isinstance(m, nn.BatchNorm2d) for m in encoder.modules())
    assert folded == norms - left > 0
    if name == "mobilenet_v2":
        assert left == 0
    with torch.no_grad():
        after = encoder(images)
    assert after.abs().max() > 0.1
    torch.testing.assert_close(after, before, rtol=1e-4, atol=1e-4)


def test_the_fused_optimiser_makes_adams_updates():
    """On the CPU the run's Adam is torch's fused one; five steps of it (two learning rates,
    weight decay) give the weights that torch's plain Adam gives."""
    from captioning.config import TrainConfig
    from captioning.training.optim import build_optimizer

    images, tokens = batch()
    cfg = TrainConfig(lr=1e-2, encoder_lr=1e-3, weight_decay=1e-4)
    torch.manual_seed(0)
    fused_model = tiny_model()
    plain_model, start = copy.deepcopy(fused_model), copy.deepcopy(fused_model)
    fused, plain = build_optimizer(fused_model, cfg), build_optimizer(plain_model, cfg)
    assert all(group["fused"] for group in fused.param_groups)
    for group in plain.param_groups:
        group["fused"] = None  # torch's default: one operation at a time
    for model, optimizer in ((fused_model, fused), (plain_model, plain)):
        model.train()
        for step in range(5):
            torch.manual_seed(step)  # the same dropout masks in both
            optimizer.zero_grad()
            loss = caption_loss(model(images, tokens), tokens[:, 1:], 0, penalty_weight=0.0)
            loss.total.backward()
            optimizer.step()
    for (name, a), b, c in zip(
        fused_model.named_parameters(), plain_model.parameters(), start.parameters()
    ):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=name)
        assert not a.requires_grad or not torch.equal(a, c), name


def _query_decoder(query: str, parallel: bool = True) -> Decoder:
    torch.manual_seed(0)
    attention = build_attention(
        ModelConfig(attention="soft", score="additive", attention_dim=5),
        AttentionSizes(6, 8, 7, (1, 7), 6),
    )
    return Decoder(
        11,
        6,
        attention,
        embed_dim=4,
        hidden_dim=8,
        context_to_lstm=False,
        dropout=0.0,
        parallel=parallel,
        query=query,
    )


def test_the_current_query_asks_with_the_state_that_has_read_the_previous_word():
    """query=current attends with h_t (the LSTM has read y_{t-1}); the parallel pass, the
    step loop and step-by-step decoding agree; a word's map moves with the word before it,
    which the paper's h_{t-1} has not read."""
    features, tokens = torch.randn(3, 7, 6), torch.randint(4, 11, (3, 5))
    together, by_step = _query_decoder("current"), _query_decoder("current", parallel=False)
    out = together(features, tokens)
    torch.testing.assert_close(out.logits, by_step(features, tokens).logits, atol=1e-5, rtol=0)
    state, keys = together.init_state(features), together.prepare(features)
    for t in range(tokens.shape[1]):
        step = together.step(tokens[:, t], state, features, keys)
        state = step.state
        torch.testing.assert_close(out.queries[:, t], state.h, atol=1e-5, rtol=0)  # h_{t+1}
        torch.testing.assert_close(out.logits[:, t], step.logits, atol=1e-5, rtol=0)
        torch.testing.assert_close(out.alphas[:, t], step.attention.alpha, atol=1e-5, rtol=0)
    changed = tokens.clone()
    changed[:, 2] = torch.where(tokens[:, 2] == 4, 5, 4)
    for query, moves in (("current", True), ("previous", False)):
        decoder = _query_decoder(query)
        before, after = decoder(features, tokens).alphas, decoder(features, changed).alphas
        torch.testing.assert_close(before[:, :2], after[:, :2])  # the words before it
        assert bool((before[:, 2] - after[:, 2]).abs().max() > 1e-4) == moves, query
        assert bool((before[:, 3] - after[:, 3]).abs().max() > 1e-4)  # both: from then on


def test_the_current_query_needs_the_context_out_of_the_lstm():
    with pytest.raises(ConfigError, match="set model.context_to_lstm=false"):
        load_config("configs/test_tiny.yaml", ["model.query=current", "model.context_to_lstm=true"])
    with pytest.raises(ValueError, match="context_to_lstm=False"):
        Decoder(11, 6, nn.Identity(), query="current", context_to_lstm=True)


@pytest.mark.parametrize(
    "variant",
    [
        [],
        ["model.attention=local"],
        ["model.heads=2", "model.attention_dim=12"],
        ["model.values=projected", "model.value_dim=6"],
        ["model.query=current", "model.context_to_lstm=false"],
    ],
)
def test_the_word_loop_reads_a_grid_cast_once_under_autocast(variant, monkeypatch):
    """Teacher forcing in bf16 gives the same loss and gradients whether the word loop's
    grid is cast once or by autocast at every word."""
    model = tiny_model("runtime.parallel_decoder=false", *variant)
    images, tokens = batch(size=4)
    with torch.no_grad():
        features = model.encoder(images).float()

    def loss_and_grads():
        model.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = model.decoder(features, tokens[:, :-1])
        loss = caption_loss(out, tokens[:, 1:], 0).total
        loss.backward()
        return loss, [p.grad.clone() for p in model.decoder.parameters() if p.grad is not None]

    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert model.decoder.word_grid(features).dtype == torch.bfloat16
    torch.manual_seed(0)
    loss, grads = loss_and_grads()
    monkeypatch.setattr(Decoder, "word_grid", lambda self, grid: grid)
    torch.manual_seed(0)
    loss_every_word, grads_every_word = loss_and_grads()
    assert torch.equal(loss, loss_every_word) and len(grads) == len(grads_every_word)
    assert all(torch.equal(a, b) for a, b in zip(grads, grads_every_word))


def test_the_word_loops_key_projection_reads_the_grid_cast_once():
    """Under autocast the keys are projected from the grid the word loop casts once (autocast
    would cast the fp32 grid again); the initial state reads the grid as it came."""
    model = tiny_model("runtime.parallel_decoder=false")
    images, tokens = batch(size=4)
    with torch.no_grad():
        features = model.encoder(images).float()
    seen = {}
    prepare, init_state = Decoder.prepare, Decoder.init_state

    def record(name, method):
        return lambda self, grid, *a: seen.setdefault(name, grid.dtype) and method(self, grid, *a)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(Decoder, "prepare", record("prepare", prepare))
        patch.setattr(Decoder, "init_state", record("init_state", init_state))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            model.decoder(features, tokens[:, :-1])
    assert seen == {"prepare": torch.bfloat16, "init_state": torch.float32}


def test_a_grid_with_gradients_or_under_hard_attention_is_not_cast_once():
    soft, hard = tiny_model(), tiny_model("model.attention=hard")
    grid = torch.randn(2, 4, 8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert soft.decoder.word_grid(grid).dtype == torch.bfloat16
        assert soft.decoder.word_grid(grid.requires_grad_()) is grid
        assert hard.decoder.word_grid(grid.detach()).dtype == torch.float32
    assert soft.decoder.word_grid(grid.detach()).dtype == torch.float32  # no autocast


@pytest.mark.parametrize(
    "setting", [["model.attention=soft"], ["model.attention=local"], ["model.heads=2"]]
)
def test_a_temperature_is_the_score_layer_scaled(setting):
    """alpha = softmax(score / T): a model at ``model.attention_temperature=0.5`` computes
    what the model at 1 computes with its scores' last layer (w, b) doubled, word for word;
    and it is sharper than the same weights at 1."""
    sharp = tiny_model(*setting, "model.attention_temperature=0.5").eval()
    plain = tiny_model(*setting).eval()
    last = re.compile(r"decoder\.attention\.(score|heads\.\d+)\.out\.")
    doubled = {
        name: value * 2 if last.match(name) else value for name, value in sharp.state_dict().items()
    }
    assert sum(bool(last.match(name)) for name in doubled) >= 2
    images, tokens = batch()
    with torch.no_grad():
        plain.load_state_dict(sharp.state_dict())
        at_one = plain(images, tokens)
        plain.load_state_dict(doubled)
        scaled, tempered = plain(images, tokens), sharp(images, tokens)
    torch.testing.assert_close(tempered.alphas, scaled.alphas)
    torch.testing.assert_close(tempered.logits, scaled.logits)
    entropy = lambda alphas: -(alphas * alphas.clamp_min(1e-12).log()).sum(-1).mean()  # noqa: E731
    assert entropy(tempered.alphas) < entropy(at_one.alphas)


def test_a_temperature_needs_attention_and_must_be_positive():
    with pytest.raises(ConfigError, match="model.attention_temperature must be more than 0"):
        load_config(None, ["model.attention_temperature=0"])
    with pytest.raises(ConfigError, match="model.attention=none has none"):
        load_config(None, ["model.attention=none", "model.attention_temperature=0.5"])
    hard = tiny_model("model.attention=hard", "model.attention_temperature=0.5")
    assert hard.decoder.attention.temperature == 0.5
