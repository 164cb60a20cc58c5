"""Multi-head attention trains like one head: a multi-head model starts as the single-head
model of its seed, H heads that agree give one head's output, each head averages its own
channel group, the doubly stochastic penalty does not grow with H, and a short training's
loss falls as fast with four heads as with one."""

import copy
from dataclasses import replace

import pytest
import torch

from captioning.config import ModelConfig, load_config
from captioning.errors import ConfigError
from captioning.models import build_model
from captioning.models.attention import (
    AttentionSizes,
    MultiHeadAttention,
    SoftAttention,
    build_attention,
)
from captioning.models.scores import make_score
from captioning.objectives.cross_entropy import caption_loss, doubly_stochastic_penalty

TINY = [
    "model.encoder=small_cnn",
    "model.image_size=48",
    "model.cnn_channels=[8,16,32]",
    "model.attention_dim=16",
    "model.embed_dim=16",
    "model.hidden_dim=32",
    "model.dropout=0.0",
    "model.positional=sinusoidal",
    "model.fine_tune=all",
]


def grid(batch: int = 6, cells: int = 36, dim: int = 32, seed: int = 0) -> torch.Tensor:
    """Grid features with a shared part and a per-cell part, as an encoder's are."""
    generator = torch.Generator().manual_seed(seed)
    shared = torch.randn(1, 1, dim, generator=generator)
    return shared + 0.5 * torch.randn(batch, cells, dim, generator=generator)


@pytest.mark.parametrize("score", ["additive", "scaled_dot", "general"])
@pytest.mark.parametrize("heads", [2, 4, 8])
def test_heads_that_agree_give_one_heads_output(score, heads):
    """H copies of one head's score: the context, alpha and every head's weights are the
    single head's (no output projection stands between the heads and the decoder)."""
    torch.manual_seed(0)
    features, query = grid(), torch.randn(6 * 3, 24)  # three queries per image
    single = SoftAttention(make_score(score, 32, 24, 16, cells=36))
    multi = MultiHeadAttention([copy.deepcopy(single.score) for _ in range(heads)], 32)
    one = single(features, single.project_keys(features), query)
    many = multi(features, multi.project_keys(features), query)
    torch.testing.assert_close(many.context, one.context)
    torch.testing.assert_close(many.alpha, one.alpha)
    torch.testing.assert_close(many.trace.heads, one.alpha[:, None].expand(-1, heads, -1))


@pytest.mark.parametrize("heads", [2, 4, 8])
def test_a_multi_head_model_starts_as_the_single_head_model_of_its_seed(heads):
    """Built from the same seed, the H-head model computes what the single-head model
    computes (every other weight is drawn alike, and the heads start as copies of one), so
    its context starts at one head's scale: a default-initialised output projection would
    shrink it to about 1/sqrt(3) (0.58) of one head's."""
    images = torch.rand(3, 3, 48, 48, generator=torch.Generator().manual_seed(1))
    tokens = torch.randint(4, 11, (3, 7), generator=torch.Generator().manual_seed(2))
    tokens[:, 0] = 1
    outputs, contexts = [], []
    for count in (1, heads):
        torch.manual_seed(0)
        cfg = load_config(None, [*TINY, f"model.heads={count}", "model.context_to_lstm=false"])
        model = build_model(cfg.model, 11).eval()
        with torch.no_grad():
            outputs.append(model(images, tokens))
            features = model.encode(images)
            attention = model.decoder.attention
            query = torch.randn(3, 32, generator=torch.Generator().manual_seed(3))
            contexts.append(attention(features, attention.project_keys(features), query).context)
    one, many = outputs
    torch.testing.assert_close(many.logits, one.logits)
    torch.testing.assert_close(many.alphas, one.alphas)
    torch.testing.assert_close(contexts[1], contexts[0])
    assert float(contexts[0].abs().mean()) > 0.1  # a context, not zeros


def test_each_head_averages_its_own_channel_group():
    """Head h's weights average channels h*D/H..(h+1)*D/H: changing one head's score moves
    only its group of the context; every head scores with the single head's width."""
    torch.manual_seed(0)
    features, query = grid(dim=32), torch.randn(6, 24)
    attention = build_attention(
        ModelConfig(attention="soft", score="additive", attention_dim=16, heads=4),
        AttentionSizes(32, 24, 36, (1, 36), 32),
    )
    assert [head.key_proj.out_features for head in attention.heads] == [16] * 4
    with torch.no_grad():
        before = attention(features, attention.project_keys(features), query)
        attention.heads[2].query_proj.weight.mul_(10.0)  # only head 2 looks elsewhere
        after = attention(features, attention.project_keys(features), query)
    changed = (after.context - before.context).abs().amax(dim=0).view(4, 8)  # (H, D/H)
    assert bool((changed[2] > 1e-3).all())
    assert float(changed[[0, 1, 3]].max()) == 0.0
    for head in range(4):
        expected = torch.einsum(
            "bl,bld->bd", after.trace.heads[:, head], features[..., head * 8 : (head + 1) * 8]
        )
        torch.testing.assert_close(after.context[:, head * 8 : (head + 1) * 8], expected)


def test_the_penalty_does_not_grow_with_the_heads():
    """The doubly stochastic penalty reads the mean of the heads' weights: H heads that agree
    cost what one head costs, and freshly built models with 1, 2, 4 and 8 heads pay within
    10% of each other on one batch (a penalty summed over heads would be H times larger)."""
    torch.manual_seed(0)
    alphas = torch.softmax(torch.randn(4, 7, 36), dim=2)  # (B, T, L)
    mask = torch.ones(4, 7)
    one = doubly_stochastic_penalty(alphas, mask)
    agreeing = alphas[:, :, None].expand(-1, -1, 4, -1).mean(dim=2)  # (B, T, L)
    torch.testing.assert_close(doubly_stochastic_penalty(agreeing, mask), one)
    images = torch.rand(4, 3, 48, 48, generator=torch.Generator().manual_seed(1))
    tokens = torch.randint(4, 11, (4, 9), generator=torch.Generator().manual_seed(2))
    tokens[:, 0] = 1
    penalties = []
    for heads in (1, 2, 4, 8):
        torch.manual_seed(0)
        model = build_model(load_config(None, [*TINY, f"model.heads={heads}"]).model, 11)
        with torch.no_grad():
            terms = caption_loss(model(images, tokens), tokens[:, 1:], 0, penalty_weight=1.0)
        penalties.append(float(terms.penalty))
    assert max(penalties) / min(penalties) < 1.1, penalties


def short_training(heads: int, steps: int = 100) -> list[float]:
    """Per-token NLL of ``steps`` Adam steps of a tiny captioner on one fixed batch."""
    torch.manual_seed(0)
    cfg = load_config(None, [*TINY, f"model.heads={heads}", "model.context_to_lstm=false"])
    model = build_model(cfg.model, 11)
    generator = torch.Generator().manual_seed(1)
    images = torch.rand(16, 3, 48, 48, generator=generator)
    tokens = torch.randint(4, 11, (16, 8), generator=generator)
    tokens[:, 0] = 1
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(steps):
        terms = caption_loss(model(images, tokens), tokens[:, 1:], 0, penalty_weight=0.0)
        optimizer.zero_grad()
        terms.total.backward()
        optimizer.step()
        losses.append(float(terms.nll_per_token))
    return losses


def test_four_heads_learn_as_fast_as_one():
    """The same short training with one head and with four: both fall well below the
    uniform guess, and four heads end within 25% of one head's loss."""
    one, four = short_training(1), short_training(4)
    assert one[-1] < 0.6 * one[0] and four[-1] < 0.6 * four[0], (one[-1], four[-1])
    assert four[-1] < 1.25 * one[-1], (one[-1], four[-1])


def test_heads_must_divide_the_context():
    with pytest.raises(ConfigError, match="model.heads=3 must divide the context's size 32"):
        build_attention(
            ModelConfig(attention="soft", score="additive", attention_dim=16, heads=3),
            AttentionSizes(32, 24, 36, (1, 36), 32),
        )


def test_with_projected_values_each_head_reads_its_block_of_them():
    """``model.values=projected``: head h averages the h-th block of W_v a_i, the field's
    per-head value projection; all words at once equal the step loop."""
    torch.manual_seed(0)
    cfg = load_config(
        None,
        [
            *TINY,
            "model.heads=2",
            "model.values=projected",
            "model.value_dim=24",
            "model.context_to_lstm=false",
        ],
    )
    model = build_model(cfg.model, 11)
    images = torch.rand(2, 3, 48, 48, generator=torch.Generator().manual_seed(1))
    decoder = model.decoder
    with torch.no_grad():
        for param in decoder.attention.heads[1].parameters():
            param.add_(0.5 * torch.randn_like(param))  # the heads part, as in training
        features = model.encode(images)
        values = decoder.value_proj(features)  # (B, L, 24)
        state = decoder.init_state(features)
        out = decoder.attention(values, decoder.prepare(features)[..., 24:], state.h)
    for head in range(2):
        block = values[..., head * 12 : (head + 1) * 12]
        expected = torch.einsum("bl,bld->bd", out.trace.heads[:, head], block)
        torch.testing.assert_close(out.context[:, head * 12 : (head + 1) * 12], expected)
    tokens = torch.randint(4, 11, (2, 6), generator=torch.Generator().manual_seed(2))
    tokens[:, 0] = 1
    together = model(images, tokens)
    loop = build_model(cfg.model, 11, replace(cfg.runtime, parallel_decoder=False))
    loop.load_state_dict(model.state_dict())
    torch.testing.assert_close(loop(images, tokens).logits, together.logits, atol=1e-5, rtol=0)
