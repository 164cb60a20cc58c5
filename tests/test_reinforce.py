"""Hard attention: the REINFORCE estimator is unbiased, the baseline lowers its variance,
the soft/hard mixing switch, the baseline update, and padding."""

import itertools
from dataclasses import replace

import pytest
import torch

from captioning.losses import MovingAverageBaseline, caption_loss
from captioning.models.attention import HardAttention, make_score
from captioning.models.decoder import Decoder
from captioning.train import semi_sampling_kwargs

CELLS, FEATURES, STEPS = 3, 4, 3


def tiny_problem():
    torch.manual_seed(0)
    attention = HardAttention(make_score("additive", FEATURES, 5, 4))
    decoder = Decoder(7, FEATURES, attention, embed_dim=4, hidden_dim=5, dropout=0.0)
    features = torch.randn(1, CELLS, FEATURES) * 2
    tokens = torch.tensor([[1, 4, 5, 2]])  # <start> w4 w5 <end>: three predicted words
    return decoder, features, tokens


def flat_grad(loss, params):
    grads = torch.autograd.grad(loss, params, allow_unused=True)
    return torch.cat([(g if g is not None else torch.zeros_like(p)).reshape(-1)
                      for g, p in zip(grads, params)])  # fmt: skip


def exact_gradient(decoder, features, tokens):
    """-d/dθ E_s[log p(y | s)], enumerating all CELLS ** STEPS cell sequences."""
    cells = torch.tensor(list(itertools.product(range(CELLS), repeat=STEPS)))  # (27, T)
    n = cells.shape[0]
    feats = features.expand(n, -1, -1)
    keys = decoder.prepare(feats)
    state = decoder.init_state(feats)
    log_p_y = torch.zeros(n)
    log_p_s = torch.zeros(n)
    for t in range(STEPS):
        out = decoder.step(tokens[:, t].expand(n), state, feats, keys, hard_context="sample",
                           cell=cells[:, t])  # fmt: skip
        log_p_y = log_p_y + torch.log_softmax(out.logits, dim=1)[:, tokens[0, t + 1]]
        log_p_s = log_p_s + out.attention.log_prob
        state = out.state
    assert torch.allclose(log_p_s.exp().sum(), torch.tensor(1.0), atol=1e-5)
    objective = (log_p_s.exp() * log_p_y).sum()  # E_s[log p(y | s, a)]
    params = [p for p in decoder.parameters()]
    exact = flat_grad(-objective, params)
    return exact, objective.detach().item()


def estimates(decoder, features, tokens, baseline_value, batches=60, samples=200):
    """Batch means of the surrogate's gradient (each over `samples` sampled sequences)."""
    params = [p for p in decoder.parameters()]
    torch.manual_seed(1)
    out = []
    for _ in range(batches):
        baseline = MovingAverageBaseline(decay=1.0)  # a constant baseline
        baseline.value, baseline.initialized = baseline_value, True
        feats = features.expand(samples, -1, -1)
        inputs = tokens[:, :-1].expand(samples, -1)
        output = decoder(feats, inputs, hard_context="sample")
        terms = caption_loss(output, tokens[:, 1:].expand(samples, -1), pad_id=0,
                             penalty_weight=0.0, baseline=baseline, reinforce_weight=1.0,
                             entropy_weight=0.0)  # fmt: skip
        out.append(flat_grad(terms.total, params))
    return torch.stack(out)  # (batches, P)


@pytest.fixture(scope="module")
def gradients():
    decoder, features, tokens = tiny_problem()
    exact, objective = exact_gradient(decoder, features, tokens)
    plain = estimates(decoder, features, tokens, baseline_value=0.0)
    with_baseline = estimates(decoder, features, tokens, baseline_value=objective)
    return exact, plain, with_baseline


def _check_unbiased(exact, batch_means):
    # The mean of M independent batch means has standard error std / sqrt(M) per coordinate;
    # a true mean lies within 5 standard errors except with probability < 1e-6 per coordinate.
    mean = batch_means.mean(dim=0)
    stderr = batch_means.std(dim=0) / batch_means.shape[0] ** 0.5
    z = (mean - exact).abs() / (stderr + 1e-12)
    informative = exact.abs() > 1e-6
    assert (z[informative] < 5).all(), float(z[informative].max())
    assert ((mean - exact).abs()[~informative] < 1e-5).all()
    # and not by being noise: the estimate points where the exact gradient does
    cosine = torch.nn.functional.cosine_similarity(mean, exact, dim=0)
    assert cosine > 0.99, float(cosine)


def test_reinforce_gradient_is_unbiased(gradients):
    exact, plain, _ = gradients
    _check_unbiased(exact, plain)


def test_baseline_keeps_it_unbiased_and_lowers_the_variance(gradients):
    exact, plain, with_baseline = gradients
    _check_unbiased(exact, with_baseline)
    ratio = float(plain.var(dim=0).sum() / with_baseline.var(dim=0).sum())
    print(f"estimator variance without / with baseline: {ratio:.1f}x")
    assert ratio > 2.0


def test_mixing_switch():
    device = torch.device("cpu")
    torch.manual_seed(0)
    assert all(semi_sampling_kwargs(0.0, "batch", 8, device)["hard_context"] == "expectation"
               for _ in range(50))  # fmt: skip
    assert all(semi_sampling_kwargs(1.0, "batch", 8, device)["hard_context"] == "sample"
               for _ in range(50))  # fmt: skip
    modes = [semi_sampling_kwargs(0.5, "batch", 8, device)["hard_context"] for _ in range(400)]
    assert 0.4 < modes.count("sample") / 400 < 0.6
    never = semi_sampling_kwargs(0.0, "sample", 64, device)["use_expectation"]
    always = semi_sampling_kwargs(1.0, "sample", 64, device)["use_expectation"]
    assert never.all() and not always.any()
    mixed = torch.stack([semi_sampling_kwargs(0.5, "sample", 64, device)["use_expectation"]
                         for _ in range(20)])  # fmt: skip
    # per caption: rows of one minibatch differ
    assert all(0 < int(row.sum()) < 64 for row in mixed)
    assert 0.4 < mixed.float().mean() < 0.6


def test_expectation_rows_neither_sample_nor_get_a_reinforce_term():
    decoder, features, tokens = tiny_problem()
    feats = features.expand(6, -1, -1)
    use_expectation = torch.tensor([True, False, True, False, True, False])
    out = decoder(feats, tokens[:, :-1].expand(6, -1), hard_context="sample",
                  use_expectation=use_expectation)  # fmt: skip
    assert torch.equal(out.sampled, ~use_expectation[:, None].expand(-1, STEPS))
    assert (out.log_probs[use_expectation] == 0).all()
    soft = decoder(feats, tokens[:, :-1].expand(6, -1), hard_context="expectation")
    assert torch.allclose(out.logits[use_expectation], soft.logits[use_expectation], atol=1e-6)
    assert soft.log_probs is None


def test_baseline_update():
    baseline = MovingAverageBaseline(decay=0.9)
    baseline.update(torch.tensor([-4.0, -6.0]))
    assert baseline.value == pytest.approx(-5.0)  # the first batch sets it
    baseline.update(torch.tensor([-1.0, -3.0]))
    assert baseline.value == pytest.approx(0.9 * -5.0 + 0.1 * -2.0)
    restored = MovingAverageBaseline()
    restored.load_state_dict(baseline.state_dict())
    assert restored.value == baseline.value and restored.decay == 0.9


def test_padding_contributes_no_reward_or_penalty():
    decoder, features, tokens = tiny_problem()
    tokens = torch.tensor([[1, 4, 5, 2, 0, 0], [1, 4, 2, 0, 0, 0]])
    feats = features.expand(2, -1, -1)
    torch.manual_seed(0)
    out = decoder(feats, tokens[:, :-1], hard_context="sample")
    baseline = MovingAverageBaseline()
    terms = caption_loss(out, tokens[:, 1:], 0, penalty_weight=1.0, baseline=baseline)
    padded = tokens[:, 1:] == 0
    noisy = replace(
        out,
        logits=out.logits + padded[:, :, None] * torch.randn_like(out.logits) * 10,
        alphas=torch.where(
            padded[:, :, None], torch.softmax(torch.randn_like(out.alphas), -1), out.alphas
        ),  # fmt: skip
        log_probs=torch.where(padded, torch.randn_like(out.log_probs), out.log_probs),
    )
    other = MovingAverageBaseline()
    moved = caption_loss(noisy, tokens[:, 1:], 0, penalty_weight=1.0, baseline=other)
    assert torch.allclose(terms.total, moved.total)
    assert terms.reward == moved.reward and baseline.value == other.value
    assert terms.penalty == moved.penalty and terms.entropy == moved.entropy
