"""Hard attention's estimators against exact enumeration of the cell sequences, the
objective's state (baseline, temperature, mixing, the random stream) and the typed option.

The tiny problem has L=3 cells and T=3 words, so the L^T = 27 cell sequences s can be
enumerated: E_q[log p(y | s)] (the paper's objective), the K-sample bound
E[log (1/K) sum_k p(y | s_k)] (VIMCO's) and log p(y) = log sum_s q(s) p(y | s) (the exact
marginal) and their gradients are computed exactly and compared with each estimator.
"""

import itertools
import math
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from torch import nn

from captioning.config import Config
from captioning.distributed import SINGLE, World
from captioning.models.attention import EXPECTATION, HardAttention, HardContext
from captioning.models.decoder import Decoder
from captioning.models.scores import make_score
from captioning.objectives import Batch
from captioning.objectives.hard_attention import HardAttentionObjective, MovingAverageBaseline

CELLS, FEATURES, STEPS = 3, 4, 3
TOKENS = torch.tensor([[1, 4, 5, 2]])  # <start> w4 w5 <end>: three predicted words


class OnGrid(nn.Module):
    """A captioner's forward on a fixed grid (the objective calls its module like this)."""

    def __init__(self, decoder: Decoder) -> None:
        super().__init__()
        self.decoder = decoder

    def forward(self, images, tokens, grid=None, hard=EXPECTATION, repeat=1):
        grid = grid.repeat_interleave(repeat, dim=0)
        tokens = tokens.repeat_interleave(repeat, dim=0)
        targets = tokens[:, 1:] if hard.mode == "marginal" else None
        return self.decoder(grid, tokens[:, :-1], hard, targets)


def tiny_problem(context_to_lstm=True, dtype=torch.float32):
    torch.manual_seed(0)
    attention = HardAttention(make_score("additive", FEATURES, 5, 4))
    decoder = Decoder(
        7,
        FEATURES,
        attention,
        embed_dim=4,
        hidden_dim=5,
        dropout=0.0,
        context_to_lstm=context_to_lstm,
    ).to(dtype)
    features = (torch.randn(1, CELLS, FEATURES) * 2).to(dtype)
    return decoder, features


# lambda_r = 1 and no entropy bonus or penalty: the estimators of the objectives themselves
UNBIASED = {
    "reinforce_weight": 1.0,
    "entropy_weight": 0.0,
    "doubly_stochastic_weight": 0.0,
    "semi_sampling_p": 1.0,
}


def objective(estimator, context_to_lstm=True, world=SINGLE, **train):
    cfg = Config()
    cfg = replace(
        cfg,
        model=replace(cfg.model, attention="hard", context_to_lstm=context_to_lstm),
        train=replace(cfg.train, **{**UNBIASED, "hard_estimator": estimator, **train}),
    )
    return HardAttentionObjective(cfg, CELLS, torch.device("cpu"), "fp32", world)


def params_of(decoder):
    return list(decoder.parameters())


def flat_grad(loss, params):
    grads = torch.autograd.grad(loss, params, allow_unused=True)
    return torch.cat(
        [(g if g is not None else torch.zeros_like(p)).reshape(-1) for g, p in zip(grads, params)]
    )


def enumerate_sequences(decoder, features):
    """log q(s) and log p(y | s) for all 27 cell sequences, differentiable."""
    cells = torch.tensor(list(itertools.product(range(CELLS), repeat=STEPS)))  # (27, T)
    n = cells.shape[0]
    out = decoder(
        features.expand(n, -1, -1),
        TOKENS[:, :-1].expand(n, -1),
        HardContext(mode="sample", cells=cells),
    )
    log_p_y = torch.log_softmax(out.logits, dim=2).gather(2, TOKENS[:, 1:, None].expand(n, -1, 1))
    log_q = out.log_probs.sum(dim=1)  # (27,)
    assert torch.allclose(log_q.exp().sum(), torch.tensor(1.0, dtype=log_q.dtype), atol=1e-5)
    return log_q, log_p_y.squeeze(2).sum(dim=1)  # (27,), (27,)


def paper_objective(decoder, features):
    """E_q[log p(y | s)]."""
    log_q, log_p = enumerate_sequences(decoder, features)
    return (log_q.exp() * log_p).sum()


def vimco_bound(decoder, features, k):
    """E over k independent sequences of log (1/k) sum_j p(y | s_j), by enumeration. The
    27^k terms are summed in float64: in float32 the backward pass of the indexing adds
    thousands of terms per sequence in a thread-dependent order, and the gradient moved by
    up to 2e-4 (relative) from run to run."""
    log_q, log_p = (values.double() for values in enumerate_sequences(decoder, features))
    n = log_q.shape[0]
    index = torch.tensor(list(itertools.product(range(n), repeat=k)))  # (27^k, k)
    weights = log_q[index].sum(dim=1).exp()  # (27^k,)
    inner = torch.logsumexp(log_p[index], dim=1) - math.log(k)
    return (weights * inner).sum()


def estimates(make_objective, decoder, features, captions, batches=60, setup=None):
    """Batch means of an estimator's gradient of the loss (each over ``captions``)."""
    params = params_of(decoder)
    module = OnGrid(decoder)
    torch.manual_seed(1)
    out = []
    for step in range(batches):
        obj = make_objective()
        if setup is not None:
            setup(obj)
        batch = Batch(TOKENS.expand(captions, -1), grid=features.expand(captions, -1, -1))
        terms = obj.loss(module, replace(batch, step=step))
        out.append(flat_grad(terms.total, params))
    return torch.stack(out)  # (batches, P)


def constant_baseline(value):
    def setup(obj):
        obj.baseline = MovingAverageBaseline(decay=1.0)
        obj.baseline.value, obj.baseline.initialized = value, True

    return setup


@pytest.fixture(scope="module")
def problem():
    decoder, features = tiny_problem()
    params = params_of(decoder)
    objective_value = paper_objective(decoder, features)
    exact = flat_grad(-objective_value, params)
    return decoder, features, exact, float(objective_value.detach())


@pytest.fixture(scope="module")
def reinforce_gradients(problem):
    decoder, features, exact, value = problem
    plain = estimates(
        lambda: objective("reinforce"), decoder, features, 200, setup=constant_baseline(0.0)
    )
    with_baseline = estimates(
        lambda: objective("reinforce"), decoder, features, 200, setup=constant_baseline(value)
    )
    return plain, with_baseline


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


def test_reinforce_gradient_is_unbiased(problem, reinforce_gradients):
    _check_unbiased(problem[2], reinforce_gradients[0])


def test_baseline_keeps_it_unbiased_and_lowers_the_variance(problem, reinforce_gradients):
    plain, with_baseline = reinforce_gradients
    _check_unbiased(problem[2], with_baseline)
    ratio = float(plain.var(dim=0).sum() / with_baseline.var(dim=0).sum())
    print(f"estimator variance without / with baseline: {ratio:.1f}x")
    # docs/hard-attention.md quotes 154x: the draws are seeded, so 10% covers arithmetic that
    # differs between machines; other draws give other ratios (a variance from 200 batches
    # is itself uncertain by about 10%)
    assert ratio == pytest.approx(154.0, rel=0.1)


def test_leave_one_out_is_unbiased_and_beats_no_baseline(problem, reinforce_gradients):
    decoder, features, exact, _ = problem
    # 50 captions x 4 samples: the same 200 sampled sequences per batch as REINFORCE's
    loo = estimates(lambda: objective("reinforce_loo", hard_samples=4), decoder, features, 50)
    _check_unbiased(exact, loo)
    ratio = float(reinforce_gradients[0].var(dim=0).sum() / loo.var(dim=0).sum())
    print(f"estimator variance, no baseline / leave-one-out: {ratio:.1f}x")
    assert ratio == pytest.approx(142.0, rel=0.1)  # as quoted in docs/hard-attention.md


def test_vimco_is_unbiased_for_its_bound():
    decoder, features = tiny_problem()
    k = 3
    bound = vimco_bound(decoder, features, k)
    exact = flat_grad(-bound, params_of(decoder))
    # the K-sample bound lies between the paper's objective and log p(y)
    log_q, log_p = enumerate_sequences(decoder, features)
    marginal = torch.logsumexp(log_q + log_p, dim=0)
    paper = paper_objective(decoder, features)
    assert float(paper.detach()) < float(bound.detach()) < float(marginal.detach())
    vimco = estimates(lambda: objective("vimco", hard_samples=k), decoder, features, 100)
    _check_unbiased(exact, vimco)


def test_exact_marginal_matches_enumeration():
    decoder, features = tiny_problem(context_to_lstm=False, dtype=torch.float64)
    log_q, log_p = enumerate_sequences(decoder, features)
    marginal = torch.logsumexp(log_q + log_p, dim=0)  # log p(y | a) by enumeration
    params = params_of(decoder)
    exact = flat_grad(-marginal, params)
    terms = objective("exact", context_to_lstm=False).loss(
        OnGrid(decoder), Batch(TOKENS, grid=features)
    )
    assert float(terms.total) == pytest.approx(-float(marginal.detach()), abs=1e-6)
    assert terms.reinforce is None and terms.reward is None  # nothing was sampled
    assert (flat_grad(terms.total, params) - exact).abs().max() < 1e-6
    # the entropy of the maps it sums over, per caption, as the sampling estimators report it
    alphas = decoder(features, TOKENS[:, :-1], EXPECTATION).alphas  # (1, T, L)
    entropy = -(alphas * alphas.log()).sum()
    assert float(terms.entropy) == pytest.approx(float(entropy), abs=1e-9)
    assert 0 < float(terms.entropy) < STEPS * math.log(CELLS)


def test_gumbel_bias_is_measured(problem):
    decoder, features, exact, _ = problem
    gumbel = estimates(lambda: objective("gumbel"), decoder, features, 200)
    mean = gumbel.mean(dim=0)
    stderr = gumbel.std(dim=0) / gumbel.shape[0] ** 0.5
    informative = exact.abs() > 1e-6
    z = ((mean - exact).abs() / (stderr + 1e-12))[informative]
    relative = float((mean - exact).norm() / exact.norm())
    cosine = float(torch.nn.functional.cosine_similarity(mean, exact, dim=0))
    largest = float(z.max())
    print(
        f"straight-through Gumbel (temperature 1) against d E_q[log p(y | s)]: relative "
        f"error of the mean {relative:.3f}, cosine {cosine:.3f}, largest z {largest:.1f}"
    )
    # biased, but a usable direction: as docs/hard-attention.md quotes, 8.4% off in norm,
    # cosine 0.996, and far outside the estimate's own noise in some coordinate
    assert relative == pytest.approx(0.084, abs=0.01) and cosine > 0.99 and largest > 50


# --------------------------------------------------------------------------- the objective


def test_reinforce_loss_is_the_papers():
    """-log p(y | s) - lambda_r (r - b) log q(s) - lambda_e H + lambda * penalty, on the
    objective's own samples, with the authors' weights."""
    decoder, features = tiny_problem()
    obj = objective(
        "reinforce", reinforce_weight=0.1, entropy_weight=0.002, doubly_stochastic_weight=0.5
    )
    obj.baseline.value, obj.baseline.initialized = -3.0, True
    grid, tokens = features.expand(8, -1, -1), TOKENS.expand(8, -1)
    terms = obj.loss(OnGrid(decoder), Batch(tokens, grid=grid))
    plan = obj.plan(0, 8, STEPS)
    out = decoder(grid, tokens[:, :-1], plan.hard)
    nll = -torch.log_softmax(out.logits, 2).gather(2, tokens[:, 1:, None]).squeeze(2).sum(1)
    penalty = ((1 - out.alphas.sum(dim=1)) ** 2).sum(dim=1)
    entropy = -(out.alphas * out.alphas.log()).sum(dim=(1, 2))
    surrogate = -(-nll.detach() + 3.0) * out.log_probs.sum(dim=1)
    expected = (nll + 0.5 * penalty + 0.1 * surrogate - 0.002 * entropy).mean()
    assert float(terms.total) == pytest.approx(float(expected), rel=1e-6)
    assert float(terms.reward) == pytest.approx(float(-nll.mean()), rel=1e-6)


def test_baseline_changes_only_on_commit_with_the_mean_reward():
    decoder, features = tiny_problem()
    obj = objective("reinforce")
    module = OnGrid(decoder)
    grid, tokens = features.expand(6, -1, -1), TOKENS.expand(6, -1)
    first = obj.loss(module, Batch(tokens, grid=grid))
    assert not obj.baseline.initialized  # nothing changes before the step is known finite
    obj.commit()
    assert obj.baseline.value == pytest.approx(float(first.reward), rel=1e-6)
    obj.loss(module, Batch(tokens, grid=grid, step=1))
    obj.discard()  # a skipped step leaves no trace
    obj.commit()
    assert obj.baseline.value == pytest.approx(float(first.reward), rel=1e-6)
    second = obj.loss(module, Batch(tokens, grid=grid, step=2))
    obj.commit()
    expected = 0.9 * float(first.reward) + 0.1 * float(second.reward)
    assert obj.baseline.value == pytest.approx(expected, rel=1e-6)
    restored = objective("reinforce")
    restored.load_state_dict(obj.state_dict())
    assert restored.baseline.value == obj.baseline.value and restored.baseline.decay == 0.9


def test_gumbel_temperature_anneals_and_is_saved():
    obj = objective(
        "gumbel", gumbel_temperature=2.0, gumbel_min_temperature=0.5, gumbel_anneal_rate=0.5
    )
    temperatures = []
    for _ in range(5):
        obj.commit()
        temperatures.append(obj.temperature)
    assert temperatures[0] == pytest.approx(2.0 * math.exp(-0.5))
    assert temperatures[-1] == 0.5  # floored
    restored = objective("gumbel")
    restored.load_state_dict(obj.state_dict())
    assert restored.temperature == 0.5


def test_mixing_coin():
    def modes(p, granularity, steps=400):
        obj = objective("reinforce", semi_sampling_p=p, semi_sampling=granularity)
        return [obj.plan(step, 64, STEPS).hard for step in range(steps)]

    assert all(h.mode == "expectation" for h in modes(0.0, "batch", 50))
    assert all(h.mode == "sample" for h in modes(1.0, "batch", 50))
    assert 0.4 < sum(h.mode == "sample" for h in modes(0.5, "batch")) / 400 < 0.6
    assert all(h.use_expectation.all() for h in modes(0.0, "sample", 5))
    assert not any(h.use_expectation.any() for h in modes(1.0, "sample", 5))
    mixed = torch.stack([h.use_expectation for h in modes(0.5, "sample", 20)])
    assert all(0 < int(row.sum()) < 64 for row in mixed)  # rows of one minibatch differ
    assert 0.4 < mixed.float().mean() < 0.6
    # the exact marginal has no samples to mix, but may train a share of its minibatches
    # with the expected context (train.exact_soft_p), by the same per-step coin
    assert objective("exact", context_to_lstm=False).plan(0, 8, STEPS).hard.mode == "marginal"
    exact = objective("exact", context_to_lstm=False, exact_soft_p=0.5)
    exact_modes = [exact.plan(step, 64, STEPS).hard.mode for step in range(400)]
    assert set(exact_modes) == {"marginal", "expectation"}
    assert 0.4 < exact_modes.count("expectation") / 400 < 0.6
    # the coin depends on the seed and the step only: a second objective draws the same
    again = objective("exact", context_to_lstm=False, exact_soft_p=0.5)
    assert [again.plan(step, 8, STEPS).hard.mode for step in range(400)] == exact_modes


@pytest.mark.parametrize("estimator", ["reinforce", "reinforce_loo", "gumbel"])
def test_samples_do_not_depend_on_the_process_count_or_caption_length(estimator):
    """Rank r of N draws exactly the rows r*B..(r+1)*B of one process's N*B batch, and a
    batch's first t words get the same noise whatever its longest caption."""
    settings = {"semi_sampling": "sample", "semi_sampling_p": 0.5}
    one = objective(estimator, **settings).plan(7, 8, STEPS)
    halves = [
        objective(estimator, world=World(rank=r, size=2), **settings).plan(7, 4, STEPS)
        for r in range(2)
    ]
    assert torch.equal(torch.cat([h.hard.noise for h in halves]), one.hard.noise)
    assert torch.equal(
        torch.cat([h.hard.use_expectation for h in halves]), one.hard.use_expectation
    )
    longer = objective(estimator, **settings).plan(7, 8, STEPS + 4)
    assert torch.equal(longer.hard.noise[:, :STEPS], one.hard.noise)
    # sampling from the noise is sampling from alpha: the Gumbel-max trick
    alpha = torch.tensor([[0.2, 0.5, 0.3]]).expand(20000, -1)
    noise = torch.empty(20000, 3).exponential_(generator=torch.Generator().manual_seed(0))
    counts = torch.bincount((alpha / noise).argmax(dim=1), minlength=3) / 20000
    assert torch.allclose(counts, alpha[0], atol=0.015)


def test_a_misspelt_attention_option_is_an_error():
    decoder, features = tiny_problem()
    with pytest.raises(TypeError):
        decoder(features, TOKENS[:, :-1], hard_contxt="sample")
    with pytest.raises(ValueError, match="hard context must be one of"):
        HardContext(mode="smaple")
    with pytest.raises(ValueError, match="context_to_lstm=False"):
        decoder(features, TOKENS[:, :-1], HardContext(mode="marginal"), TOKENS[:, 1:])


def test_expectation_rows_neither_sample_nor_get_a_score_term():
    decoder, features = tiny_problem()
    feats = features.expand(6, -1, -1)
    use_expectation = torch.tensor([True, False, True, False, True, False])
    out = decoder(
        feats,
        TOKENS[:, :-1].expand(6, -1),
        HardContext(mode="sample", use_expectation=use_expectation),
    )
    assert torch.equal(out.sampled, ~use_expectation[:, None].expand(-1, STEPS))
    assert (out.log_probs[use_expectation] == 0).all()
    soft = decoder(feats, TOKENS[:, :-1].expand(6, -1), HardContext(mode="expectation"))
    assert torch.allclose(out.logits[use_expectation], soft.logits[use_expectation], atol=1e-6)
    assert soft.log_probs is None


@pytest.mark.parametrize("estimator", ["reinforce", "reinforce_loo", "vimco", "gumbel"])
def test_padding_contributes_no_reward_or_penalty(estimator):
    decoder, features = tiny_problem()
    tokens = torch.tensor([[1, 4, 5, 2, 0, 0], [1, 4, 2, 0, 0, 0]])
    grid = features.expand(2, -1, -1)
    module = OnGrid(decoder)

    def terms_with(noisy):
        obj = objective(estimator, doubly_stochastic_weight=1.0, entropy_weight=0.01)
        if noisy:  # change what the padded steps compute: it must not matter
            real = module.decoder.forward

            def forward(feats, inputs, hard, targets=None):
                out = real(feats, inputs, hard, targets)
                repeat = len(inputs) // len(tokens)
                padded = tokens.repeat_interleave(repeat, dim=0)[:, 1:] == 0  # (R, T)
                return replace(
                    out,
                    logits=out.logits + padded[:, :, None] * torch.randn_like(out.logits) * 10,
                    trace=replace(
                        out.trace,
                        alpha=torch.where(
                            padded[:, :, None],
                            torch.softmax(torch.randn_like(out.alphas), -1),
                            out.alphas,
                        ),
                    ),
                    log_probs=torch.where(padded, torch.randn_like(out.log_probs), out.log_probs),
                )

            module.decoder.forward = forward
        try:
            terms = obj.loss(module, Batch(tokens, grid=grid))
        finally:
            module.decoder.__dict__.pop("forward", None)
        obj.commit()
        return terms, obj.state_dict()

    clean, clean_state = terms_with(False)
    noisy, noisy_state = terms_with(True)
    assert torch.allclose(clean.total, noisy.total)
    assert clean.reward == noisy.reward and clean.penalty == noisy.penalty
    assert clean.entropy == noisy.entropy and clean_state == noisy_state


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        (
            ["model.attention=hard", "train.hard_estimator=exact"],
            "train.hard_estimator=exact needs model.context_to_lstm=false",
        ),
        (
            ["model.attention=hard", "train.hard_estimator=vimco", "train.hard_samples=1"],
            "train.hard_samples must be at least 2",
        ),
        (
            ["train.hard_estimator=gumbel"],
            "trains hard attention; this model has model.attention=soft",
        ),
        (
            ["model.attention=hard", "decode.hard_context=marginal"],
            "decode.hard_context=marginal needs model.context_to_lstm=false",
        ),
        (
            ["model.attention=hard", "train.gumbel_temperature=0.1"],
            "train.gumbel_temperature must be at least train.gumbel_min_temperature",
        ),
        (
            ["model.attention=hard", "train.exact_soft_p=0.5"],
            "mixes the exact estimator's minibatches; with train.hard_estimator=reinforce",
        ),
    ],
)
def test_settings_that_cannot_work_are_refused_in_one_line(settings, message):
    from captioning.config import load_config
    from captioning.errors import ConfigError

    with pytest.raises(ConfigError, match=message) as caught:
        load_config(Path(__file__).parent.parent / "configs" / "test_tiny.yaml", settings)
    assert "\n" not in str(caught.value)
