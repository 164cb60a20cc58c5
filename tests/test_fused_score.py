"""The additive score's C kernel (captioning/models/additive_score.c) against autograd's
tanh form in fp64, and how captioning.native builds, caches and declines it."""

import logging
import threading

import pytest
import torch

from captioning import native
from captioning.models import fused_score
from captioning.models.scores import make_score

pytestmark = pytest.mark.skipif(
    native.compiler() is None, reason="no C compiler: the kernel cannot be built here"
)


def exact(keys, queries, weight, bias):
    """autograd's score in fp64: keys (B, 1, L, A), queries (B, G, 1, A) → (B, G, L)."""
    return torch.tanh(keys + queries) @ weight + bias


def inputs(batch, groups, cells, dim, seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return [
        scale * torch.randn(batch, 1, cells, dim, generator=g, dtype=torch.float64),
        scale * torch.randn(batch, groups, 1, dim, generator=g, dtype=torch.float64),
        torch.randn(dim, generator=g, dtype=torch.float64),
        torch.randn(1, generator=g, dtype=torch.float64),
    ]


def test_the_kernel_is_built_on_this_machine():
    assert fused_score.available(torch.zeros(2, 1, 3, 4))


@pytest.mark.parametrize(
    "batch, groups, cells, dim, scale",
    [(3, 1, 7, 5, 1.0), (4, 3, 6, 33, 1.0), (2, 5, 49, 256, 0.5), (3, 2, 4, 8, 30.0)],
)
def test_scores_and_every_gradient_match_autograds_fp64(batch, groups, cells, dim, scale):
    """Odd sizes (no multiple of a vector), several queries per image (the words or the
    beams), and inputs large enough to saturate tanh."""
    keys, queries, weight, bias = inputs(batch, groups, cells, dim, scale=scale)
    theirs = [x.clone().requires_grad_() for x in (keys, queries, weight, bias)]
    expected = exact(*theirs)
    upstream = torch.randn(expected.shape, generator=torch.Generator().manual_seed(9))
    expected.backward(upstream.double())

    scores = fused_score.forward(keys.float(), queries.float(), weight.float(), bias.float())
    assert scores.shape == (batch, groups, cells) and scores.dtype == torch.float32
    torch.testing.assert_close(scores.double(), expected.detach(), rtol=1e-5, atol=1e-5)
    grads = fused_score.backward(keys.float(), queries.float(), weight.float(), upstream)
    for name, ours, their in zip(("keys", "queries", "weight"), grads, theirs[:3]):
        assert ours.shape == their.shape and ours.dtype == torch.float32, name
        torch.testing.assert_close(ours.double(), their.grad, rtol=1e-4, atol=1e-5, msg=name)
    assert float(grads[0].abs().sum()) > 0


def test_the_keys_gradient_is_added_into_a_given_sum():
    keys, queries, weight, _ = (x.float() for x in inputs(3, 2, 5, 9))
    upstream = torch.randn(3, 2, 5)
    alone, *_ = fused_score.backward(keys, queries, weight, upstream)
    earlier = torch.randn(keys.shape)
    total = earlier.clone()
    returned, *_ = fused_score.backward(keys, queries, weight, upstream, total)
    assert returned is total
    torch.testing.assert_close(total, earlier + alone)
    with pytest.raises(ValueError, match="contiguous fp32 tensor of 135 values"):
        fused_score.backward(keys, queries, weight, upstream, torch.zeros(3, 5, 8))


def test_bf16_keys_are_read_as_their_exact_fp32_values():
    keys, queries, weight, bias = (x.float() for x in inputs(2, 3, 6, 17))
    half = keys.bfloat16()
    assert torch.equal(
        fused_score.forward(half, queries, weight, bias),
        fused_score.forward(half.float(), queries, weight, bias),
    )
    upstream = torch.randn(2, 3, 6)
    for ours, fp32 in zip(
        fused_score.backward(half, queries, weight, upstream),
        fused_score.backward(half.float(), queries, weight, upstream),
    ):
        assert torch.equal(ours, fp32)


def test_a_nan_in_the_keys_stays_nan_and_the_other_rows_are_untouched():
    keys, queries, weight, bias = (x.float() for x in inputs(2, 1, 4, 20))
    clean = fused_score.forward(keys, queries, weight, bias)
    keys[1, 0, 2, 7] = float("nan")
    scores = fused_score.forward(keys, queries, weight, bias)
    assert torch.isnan(scores[1, 0, 2])
    mask = torch.ones_like(scores, dtype=torch.bool)
    mask[1, 0, 2] = False
    assert torch.equal(scores[mask], clean[mask])


def test_one_thread_and_two_give_the_same_scores():
    keys, queries, weight, bias = (x.float() for x in inputs(5, 2, 9, 40))
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = fused_score.forward(keys, queries, weight, bias)
        torch.set_num_threads(2)
        two = fused_score.forward(keys, queries, weight, bias)
        elsewhere = []  # from a thread of its own, as the web demo's workers call it
        worker = threading.Thread(
            target=lambda: elsewhere.append(fused_score.forward(keys, queries, weight, bias))
        )
        worker.start()
        worker.join()
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two) and torch.equal(one, elsewhere[0])  # one thread's sum each


def test_decoding_scores_through_the_kernel_as_the_torch_form_does(monkeypatch):
    """Without gradients the additive score runs the kernel, on fp32 and bf16 keys."""
    torch.manual_seed(0)
    score = make_score("additive", 8, 6, 5)
    keys = score.project_keys(torch.randn(7, 9, 8))
    query = torch.randn(7 * 3, 6)
    calls = []
    original = fused_score.forward
    monkeypatch.setattr(fused_score, "forward", lambda *a: calls.append(1) or original(*a))
    with torch.no_grad():
        ours = score(keys, query)
        half = score(keys.bfloat16(), query)
        monkeypatch.setattr(fused_score, "ENABLED", False)
        torch_form = score(keys, query)
    assert calls == [1, 1]
    expected = (
        torch.tanh(keys.repeat_interleave(3, dim=0) + score.query_proj(query)[:, None])
        @ score.out.weight[0]
        + score.out.bias
    )
    torch.testing.assert_close(ours, expected)
    torch.testing.assert_close(torch_form, expected)
    assert half.dtype == torch.float32
    assert (half - expected).abs().max() < 0.02


def test_what_the_kernel_does_not_take_runs_the_torch_form(monkeypatch):
    keys = torch.zeros(2, 1, 3, 4)
    assert not fused_score.available(keys.double())
    assert not fused_score.available(keys.transpose(2, 3))  # not contiguous
    assert not fused_score.available(torch.zeros(2, 1, 3, fused_score.MAX_DIM + 1))
    monkeypatch.setattr(fused_score, "ENABLED", False)
    assert not fused_score.available(keys)


def test_the_library_is_built_once_and_then_read_from_the_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("CAPTIONING_NATIVE_CACHE", str(tmp_path))
    first = native.load.__wrapped__(fused_score.SOURCE)
    built = list(tmp_path.iterdir())
    assert first is not None and len(built) == 1 and built[0].suffix == ".so"
    stamp = built[0].stat().st_mtime_ns
    assert native.load.__wrapped__(fused_score.SOURCE) is not None
    assert list(tmp_path.iterdir()) == built and built[0].stat().st_mtime_ns == stamp


def test_where_it_cannot_be_built_the_reason_is_logged_and_none_returned(
    tmp_path, monkeypatch, caplog
):
    monkeypatch.setenv("CAPTIONING_NATIVE_CACHE", str(tmp_path))
    monkeypatch.setenv("CAPTIONING_NATIVE", "0")
    assert native.load.__wrapped__(fused_score.SOURCE) is None
    monkeypatch.delenv("CAPTIONING_NATIVE")
    broken = tmp_path / "broken.c"
    broken.write_text("this is not C\n")
    with caplog.at_level(logging.INFO, logger="captioning.native"):
        assert native.load.__wrapped__(broken) is None
        monkeypatch.setattr(native, "compiler", lambda: None)
        assert native.load.__wrapped__(fused_score.SOURCE) is None
    messages = [record.getMessage() for record in caplog.records]
    assert "broken.c could not be built" in messages[0] and "error" in messages[0]
    assert "no C compiler found" in messages[1]
    assert [p.name for p in tmp_path.iterdir()] == ["broken.c"]  # no half-built library left
