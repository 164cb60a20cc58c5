"""The additive score's training form, in blocks and through the C kernel, against
autograd's."""

import pytest
import torch

from captioning import native
from captioning.models import fused_score
from captioning.models import tanh_score as module
from captioning.models.tanh_score import tanh_score


@pytest.fixture(params=["kernel", "blocks"])
def form(request, monkeypatch):
    """Runs a test through the C kernel and through torch's blocks; yields the kernel's
    calls (forward and backward), which the test checks."""
    calls = []
    if request.param == "blocks":
        monkeypatch.setattr(fused_score, "ENABLED", False)
    elif native.compiler() is None:
        pytest.skip("no C compiler: the kernel cannot be built here")
    for name in ("forward", "backward"):
        original = getattr(fused_score, name)
        monkeypatch.setattr(
            fused_score, name, lambda *a, n=name, f=original: calls.append(n) or f(*a)
        )
    yield request.param, calls
    assert calls == ([] if request.param == "blocks" else ["forward", "backward"])


def autograd_form(keys, queries, weight, bias):
    return torch.tanh(keys + queries) @ weight + bias


@pytest.mark.parametrize("groups", [3, 1])  # every word at once; one word (decoding's form)
@pytest.mark.parametrize("block", [1 << 19, 2 * 3 * 5 * 4])  # one block; blocks of 2 images
def test_scores_and_every_gradient_match_autograds(block, groups, form, monkeypatch):
    monkeypatch.setattr(module, "BLOCK_ELEMENTS", block)
    g = torch.Generator().manual_seed(0)
    inputs = [
        torch.randn(7, 1, 5, 4, generator=g, dtype=torch.float64),  # keys (B, 1, L, A)
        torch.randn(7, groups, 1, 4, generator=g, dtype=torch.float64),  # queries (B, G, 1, A)
        torch.randn(4, generator=g, dtype=torch.float64),
        torch.randn(1, generator=g, dtype=torch.float64),
    ]
    ours = [x.float().requires_grad_() for x in inputs]
    theirs = [x.clone().requires_grad_() for x in inputs]
    scores = tanh_score(*ours)
    expected = autograd_form(*theirs)
    assert scores.shape == (7, groups, 5) and scores.dtype == torch.float32
    torch.testing.assert_close(scores.double(), expected, rtol=1e-5, atol=1e-5)
    upstream = torch.randn(7, groups, 5, generator=g, dtype=torch.float64)
    scores.backward(upstream.float())
    expected.backward(upstream)
    for name, a, b in zip(("keys", "queries", "weight", "bias"), ours, theirs):
        assert a.grad.shape == b.grad.shape, name
        torch.testing.assert_close(a.grad.double(), b.grad, rtol=1e-4, atol=1e-5, msg=name)


def test_bf16_inputs_are_scored_in_fp32_and_get_bf16_gradients(form):
    g = torch.Generator().manual_seed(1)
    keys, queries = torch.randn(4, 1, 6, 8, generator=g), torch.randn(4, 2, 1, 8, generator=g)
    weight, bias = torch.randn(8, generator=g), torch.randn(1, generator=g)
    half = [keys.bfloat16().requires_grad_(), queries.bfloat16().requires_grad_()]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        scores = tanh_score(*half, weight, bias)
    exact = autograd_form(half[0].detach().float(), half[1].detach().float(), weight, bias)
    assert scores.dtype == torch.float32
    torch.testing.assert_close(scores, exact, rtol=1e-5, atol=1e-5)  # no bf16 rounding inside
    scores.sum().backward()
    assert half[0].grad.dtype == half[1].grad.dtype == torch.bfloat16
    full = [x.detach().float().requires_grad_() for x in half]
    autograd_form(*full, weight, bias).sum().backward()
    for ours, exact_input in zip(half, full):  # fp32 gradients, rounded once to bf16
        torch.testing.assert_close(ours.grad.float(), exact_input.grad, rtol=1e-2, atol=1e-2)


def test_the_additive_score_trains_through_it_on_the_cpu(monkeypatch):
    from captioning.models.scores import make_score

    calls = []
    original = module._TanhScore.apply
    monkeypatch.setattr(module._TanhScore, "apply", lambda *a: calls.append(1) or original(*a))
    score = make_score("additive", 8, 6, 5)
    keys = score.project_keys(torch.randn(3, 4, 8))
    score(keys, torch.randn(3 * 2, 6)).sum().backward()  # gradients on: the training form
    assert calls == [1] and score.out.weight.grad is not None
    assert score.key_proj.weight.grad.abs().sum() > 0
