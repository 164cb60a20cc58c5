"""The decoder's one-pass LSTM: torch's private fused call only while it computes what the
public operations compute, and the public path whenever it is missing or has changed."""

import pytest
import torch
from torch import nn

from captioning import native
from captioning.config import ModelConfig
from captioning.models import decoder as decoder_module
from captioning.models.attention import AttentionSizes, build_attention
from captioning.models.decoder import Decoder, lstm_by_step, lstm_sequence


@pytest.fixture(autouse=True)
def _fresh_probe():
    """Each test decides anew which path the process uses (the choice is cached)."""
    decoder_module._fused_lstm.cache_clear()
    yield
    decoder_module._fused_lstm.cache_clear()


def random_lstm(seed: int, batch: int = 3, steps: int = 7, inputs: int = 5, hidden: int = 6):
    """Inputs (B, T, E), h0 and c0 (B, H) and an LSTMCell's random weights, all requiring
    gradients."""
    generator = torch.Generator().manual_seed(seed)
    cell = nn.LSTMCell(inputs, hidden)
    with torch.no_grad():
        for param in cell.parameters():
            param.copy_(torch.randn(param.shape, generator=generator) * 0.6)
    x = torch.randn(batch, steps, inputs, generator=generator, requires_grad=True)
    h0 = torch.randn(batch, hidden, generator=generator, requires_grad=True)
    c0 = torch.randn(batch, hidden, generator=generator, requires_grad=True)
    return x, h0, c0, [cell.weight_ih, cell.weight_hh, cell.bias_ih, cell.bias_hh]


def outputs_and_gradients(function, x, h0, c0, weights):
    hiddens = function(x, h0, c0, weights)
    probe = torch.linspace(-1, 1, hiddens.numel()).view_as(hiddens)
    grads = torch.autograd.grad((hiddens * probe).sum(), [x, h0, c0, *weights])
    return hiddens, grads


@pytest.mark.parametrize("seed,shape", [(0, (3, 7, 5, 6)), (1, (1, 1, 4, 3)), (2, (4, 12, 8, 16))])
def test_the_private_fused_lstm_computes_what_the_public_operations_compute(seed, shape):
    """torch._VF.lstm, called as the decoder calls it, against the gate equations written with
    public operations: the same h_1..h_T and the same gradients. This fails when a torch
    release changes what the private call means."""
    x, h0, c0, weights = random_lstm(seed, *shape)
    private, private_grads = outputs_and_gradients(decoder_module._private_lstm, x, h0, c0, weights)
    public, public_grads = outputs_and_gradients(lstm_by_step, x, h0, c0, weights)
    assert private.shape == public.shape == (shape[0], shape[1], shape[3])
    torch.testing.assert_close(private, public, rtol=0, atol=1e-5)
    for a, b in zip(private_grads, public_grads):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)
    # and the cell the decoder steps with agrees at every step
    cell = nn.LSTMCell(shape[2], shape[3])
    with torch.no_grad():
        for param, weight in zip(cell.parameters(), weights):
            param.copy_(weight)
    h, c = h0, c0
    for t in range(shape[1]):
        h, c = cell(x[:, t], (h, c))
        torch.testing.assert_close(public[:, t], h, rtol=0, atol=1e-5)
    assert decoder_module._fused_lstm() is decoder_module._private_lstm  # this torch passes


class NoLSTM:
    """``torch._VF`` without ``lstm``: what a torch release that drops it looks like."""

    def __getattr__(self, name):
        raise AttributeError(name)


class OtherSignature:
    """``torch._VF`` whose ``lstm`` takes other arguments."""

    @staticmethod
    def lstm(*args):
        raise TypeError("lstm() received an invalid combination of arguments")


class OtherMeaning:
    """``torch._VF`` whose ``lstm`` runs but means something else (no cell state)."""

    @staticmethod
    def lstm(inputs, hx, weights, *args):
        hidden = torch.tanh(nn.functional.linear(inputs, weights[0], weights[2]))
        return hidden[..., : hx[0].shape[-1]], hx[0], hx[1]


@pytest.mark.parametrize("stand_in", [NoLSTM(), OtherSignature(), OtherMeaning()])
def test_without_the_private_lstm_the_public_path_runs_and_agrees(monkeypatch, stand_in):
    """With ``torch._VF.lstm`` gone, taking other arguments or meaning something else, the
    decoder uses the public path: teacher forcing all words at once still equals the step
    loop, gradients included."""
    x, h0, c0, weights = random_lstm(3)
    expected, expected_grads = outputs_and_gradients(lstm_sequence, x, h0, c0, weights)
    decoder_module._fused_lstm.cache_clear()
    monkeypatch.setattr(torch, "_VF", stand_in)
    assert decoder_module._fused_lstm() is None
    calls = []
    real = decoder_module.lstm_by_step

    def counting(*args):
        calls.append(1)
        return real(*args)

    monkeypatch.setattr(decoder_module, "lstm_by_step", counting)
    hiddens, grads = outputs_and_gradients(lstm_sequence, x, h0, c0, weights)
    assert calls  # the public path ran
    torch.testing.assert_close(hiddens, expected, rtol=0, atol=1e-5)
    for a, b in zip(grads, expected_grads):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)

    torch.manual_seed(0)
    attention = build_attention(
        ModelConfig(attention="soft", score="additive", attention_dim=5),
        AttentionSizes(6, 8, 7, (1, 7), 6),
    )
    together = Decoder(
        11, 6, attention, embed_dim=4, hidden_dim=8, context_to_lstm=False, dropout=0.0
    )
    by_step = Decoder(
        11,
        6,
        attention,
        embed_dim=4,
        hidden_dim=8,
        context_to_lstm=False,
        dropout=0.0,
        parallel=False,
    )
    by_step.load_state_dict(together.state_dict())
    features, tokens = torch.randn(3, 7, 6), torch.randint(1, 11, (3, 5))
    calls.clear()
    torch.testing.assert_close(
        together(features, tokens).logits, by_step(features, tokens).logits, rtol=0, atol=1e-5
    )
    assert len(calls) == 1  # the parallel decoder's one pass, not the step loop's cell


def test_the_probe_leaves_the_random_streams_alone():
    """Choosing the path draws from a generator of its own: a seeded run draws the same
    numbers whether or not the probe ran first."""
    torch.manual_seed(5)
    decoder_module._fused_lstm()
    after_probe = torch.rand(3)
    torch.manual_seed(5)
    torch.testing.assert_close(torch.rand(3), after_probe)


# --------------------------------------------------------------------------- deferred gradients


def paper_wiring_gradients(monkeypatch, deferred: bool, autocast: bool = False):
    """The gradients of every weight of a tiny paper-wiring model (the context in the LSTM:
    teacher forcing steps word by word) after one caption loss, with the cell's weight
    gradients deferred or with torch's own cell."""
    from captioning.models import deferred as deferred_module
    from captioning.objectives.cross_entropy import caption_loss

    from .test_models import batch, tiny_model

    if not deferred:
        monkeypatch.setattr(decoder_module, "deferred_cell", lambda cell: cell)
    model = tiny_model("model.context_to_lstm=true", "model.dropout=0.0")
    assert isinstance(model.decoder.lstm, nn.LSTMCell)
    images, tokens = batch(size=4, length=7)
    calls = []
    original = deferred_module._Share.backward
    monkeypatch.setattr(
        deferred_module._Share, "backward", staticmethod(lambda *a: calls.append(1) or original(*a))
    )
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        loss = caption_loss(model(images, tokens), tokens[:, 1:], 0, penalty_weight=1.0).total
    loss.backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    return grads, len(calls)


@pytest.mark.parametrize("form", ["plain", "transposed"])
def test_the_deferred_cell_gives_the_word_loops_gradients(form, monkeypatch):
    from captioning.models import deferred as deferred_module
    from captioning.models import packing

    monkeypatch.setattr(packing, "FORM", form)
    transposed = []
    product = deferred_module.transposed_linear
    monkeypatch.setattr(
        deferred_module, "transposed_linear", lambda *a: transposed.append(1) or product(*a)
    )
    deferred, shares = paper_wiring_gradients(monkeypatch, deferred=True)
    # every word's two products, forward and the inputs' gradients backward
    assert len(transposed) == (0 if form == "plain" else 4 * 6)
    with monkeypatch.context() as patch:
        plain, plain_shares = paper_wiring_gradients(patch, deferred=False)
    assert shares == 2 and plain_shares == 0  # the input and hidden weights, once each
    assert deferred.keys() == plain.keys()
    assert {"decoder.lstm.weight_ih", "decoder.lstm.bias_hh"} <= deferred.keys()
    for name, grad in plain.items():
        torch.testing.assert_close(deferred[name], grad, rtol=1e-4, atol=1e-6, msg=name)
    assert float(plain["decoder.lstm.weight_ih"].abs().sum()) > 0


@pytest.mark.parametrize("kernel", [True, False])  # the score in C, in torch's blocks
def test_shared_keys_sum_every_words_keys_gradient_in_place(kernel, monkeypatch):
    """Each word's tanh score adds its keys gradient into one sum, handed on once: the
    gradients are autograd's sum of the words' own, in fp32 and under bf16 autocast."""
    from captioning.models import fused_score, tanh_score

    monkeypatch.setattr(fused_score, "ENABLED", kernel)
    assert fused_score.available(torch.zeros(1, 1, 1, 1)) == (
        kernel and native.compiler() is not None
    )

    handed = []
    original = tanh_score._ShareKeys.backward

    def backward(ctx, grad):
        summed = ctx.sink.total is not None
        out = original(ctx, grad)
        handed.append((summed, out[0].dtype))
        return out

    monkeypatch.setattr(tanh_score._ShareKeys, "backward", staticmethod(backward))
    results = {}
    for autocast in (False, True):
        shared, _ = paper_wiring_gradients(monkeypatch, deferred=True, autocast=autocast)
        with monkeypatch.context() as patch:
            patch.setattr(decoder_module, "shared_keys", lambda keys: keys)
            own, _ = paper_wiring_gradients(patch, deferred=True, autocast=autocast)
        results[autocast] = shared, own
    # once per backward pass, with the words' sum, in the keys' dtype
    assert handed == [(True, torch.float32), (True, torch.bfloat16)]
    shared, own = results[False]
    assert shared.keys() == own.keys()
    for name, grad in own.items():
        torch.testing.assert_close(shared[name], grad, rtol=1e-5, atol=1e-7, msg=name)
    key_weight = "decoder.attention.score.key_proj.weight"
    exact = shared[key_weight]
    assert float(exact.abs().sum()) > 0
    # bf16: the sum is taken in fp32 and rounded once (autograd adds bf16 gradients), no
    # less exact
    error = {
        name: float((grads[key_weight] - exact).abs().max())
        for name, grads in zip(("shared", "own"), results[True], strict=True)
    }
    assert error["shared"] <= error["own"] * 1.05


@pytest.mark.parametrize("kernel", [True, False])
def test_shared_keys_cast_bf16_keys_to_fp32_once_with_the_same_gradients(kernel, monkeypatch):
    """Under autocast the word loop's bf16 keys are cast to fp32 once for every word's score
    (each word cast them twice): the same numbers, bit for bit."""
    from captioning.models import fused_score, tanh_score

    monkeypatch.setattr(fused_score, "ENABLED", kernel)

    keys = torch.randn(2, 3, 4, dtype=torch.bfloat16, requires_grad=True)
    view = tanh_score.shared_keys(keys).unsqueeze(1)  # as the score sees them
    sink = tanh_score.shared_keys(keys).gradient_sink
    first = sink.fp32(view)
    assert sink.fp32(view) is first and first.dtype == torch.float32
    assert torch.equal(first, view.detach().float())

    once, _ = paper_wiring_gradients(monkeypatch, deferred=True, autocast=True)
    with monkeypatch.context() as patch:
        patch.setattr(tanh_score.KeysGradient, "fp32", lambda self, keys: keys)
        per_word, _ = paper_wiring_gradients(patch, deferred=True, autocast=True)
    assert once.keys() == per_word.keys()
    for name, grad in per_word.items():
        assert torch.equal(once[name], grad), name


def test_inference_keeps_torchs_cell():
    from captioning.models.deferred import deferred_cell

    cell = nn.LSTMCell(4, 3)
    assert deferred_cell(cell) is not cell
    with torch.no_grad():
        assert deferred_cell(cell) is cell
    cell.weight_hh.requires_grad_(False)
    assert deferred_cell(cell) is cell


def test_under_autocast_the_deferred_cell_is_at_least_as_close_to_fp32(monkeypatch):
    """In bf16 the deferred gradients are one product over every word, rounded once; torch's
    cell adds each word's bf16 gradient in bf16. Both against the fp32 gradients."""
    exact, _ = paper_wiring_gradients(monkeypatch, deferred=True)
    deferred, shares = paper_wiring_gradients(monkeypatch, deferred=True, autocast=True)
    with monkeypatch.context() as patch:
        plain, plain_shares = paper_wiring_gradients(patch, deferred=False, autocast=True)
    assert shares == 2 and plain_shares == 0
    assert deferred.keys() == plain.keys() == exact.keys()
    for name in ("decoder.lstm.weight_ih", "decoder.lstm.weight_hh", "decoder.lstm.bias_ih"):
        assert deferred[name].dtype == torch.float32
        scale = exact[name].abs().max()
        ours = (deferred[name] - exact[name]).abs().max() / scale
        torchs = (plain[name] - exact[name]).abs().max() / scale
        assert ours < 0.05 and ours <= 1.5 * torchs, (name, ours, torchs)
