"""Straight-through Gumbel-softmax hard attention: the chosen cell's feature forward, the
relaxation's gradient backward (Jang et al. 2017)."""

import pytest
import torch

from captioning.models.attention import HardAttention, HardContext
from captioning.models.scores import make_score


def setting(temperature: float):
    torch.manual_seed(0)
    attention = HardAttention(make_score("additive", 4, 5, 6))
    features = torch.randn(3, 7, 4)  # (B, L, D)
    query = torch.randn(3, 5)
    noise = torch.empty(3, 7).exponential_(generator=torch.Generator().manual_seed(1))
    hard = HardContext(mode="gumbel", noise=noise, temperature=temperature)
    return attention, features, query, noise, hard


@pytest.mark.parametrize("temperature", [1.0, 0.5])
def test_forward_is_the_gumbel_max_cell_exactly(temperature):
    """The context is the feature of s = argmax(log alpha + g), g = -log(noise): the
    one-hot forward, whatever the temperature."""
    attention, features, query, noise, hard = setting(temperature)
    out = attention(features, attention.project_keys(features), query, hard)
    gumbel = -torch.log(noise)
    cell = (torch.log(out.alpha) + gumbel).argmax(dim=1)
    assert torch.equal(out.trace.cell, cell)
    torch.testing.assert_close(out.context, features[torch.arange(3), cell], rtol=0, atol=1e-6)
    rows = torch.arange(3)
    torch.testing.assert_close(out.log_prob, torch.log(out.alpha[rows, cell]))


@pytest.mark.parametrize("temperature", [1.0, 0.5])
def test_backward_is_the_relaxed_softmax_gradient(temperature):
    """The attention's weights get the gradient of the relaxed context
    softmax((log alpha + g) / tau) @ features; the features get the one-hot forward's (only
    the chosen cell's feature moves)."""
    attention, features, query, noise, hard = setting(temperature)
    direction = torch.randn(3, 4, generator=torch.Generator().manual_seed(2))
    params = list(attention.parameters())

    grid = features.clone().requires_grad_()
    keys = attention.project_keys(features)  # the score's path, apart from the grid's
    out = attention(grid, keys, query, hard)
    (out.context * direction).sum().backward()
    straight = [p.grad.clone() for p in params]

    one_hot = torch.nn.functional.one_hot(out.trace.cell, 7).float()  # (B, L)
    torch.testing.assert_close(grid.grad, one_hot[:, :, None] * direction[:, None, :])

    for p in params:
        p.grad = None
    alpha = attention.weights(attention.project_keys(features), query)
    relaxed = torch.softmax((torch.log(alpha) - torch.log(noise)) / temperature, dim=1)
    (torch.einsum("bl,bld->bd", relaxed, features) * direction).sum().backward()
    for got, expected in zip(straight, (p.grad for p in params)):
        torch.testing.assert_close(got, expected)
    assert sum(float(g.abs().sum()) for g in straight) > 1e-3  # a gradient, not zeros


def test_a_lower_temperature_gives_a_sharper_relaxation():
    """At a lower temperature the relaxed weights put more mass on the chosen cell, so the
    backward pass follows the one-hot forward more closely."""
    masses = []
    for temperature in (1.0, 0.5, 0.1):
        attention, features, query, noise, _ = setting(temperature)
        with torch.no_grad():
            alpha = attention.weights(attention.project_keys(features), query)
        relaxed = torch.softmax((torch.log(alpha) - torch.log(noise)) / temperature, dim=1)
        cell = (alpha / noise).argmax(dim=1)
        masses.append(float(relaxed[torch.arange(3), cell].mean()))
    assert masses[0] < masses[1] < masses[2] and masses[2] > 0.9, masses
