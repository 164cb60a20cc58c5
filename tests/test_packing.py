"""Packed weights while a batch decodes on the CPU: the same captions, log-probabilities and
maps as torch's own layers, packs made only where they apply, and the layers untouched
elsewhere."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from captioning.inference.decoding import beam_search, greedy_decode
from captioning.models import packing
from captioning.models.packing import Linear, LSTMCell, Packs, packed_weights

from .test_models import batch, tiny_model

needs_packing = pytest.mark.skipif(
    not packing.packing_available(), reason="torch's packed MKL kernel is not on this CPU"
)


def decode_both(decode, model, features, monkeypatch, form, **settings):
    """``decode`` with the few-row products in ``form`` and with torch's own layers, each
    product of the first counted by form."""
    calls = {"packed": 0, "transposed": 0}
    mkl_linear, transposed_linear = torch.ops.mkl._mkl_linear, packing.transposed_linear

    def count(form, function):
        return lambda *args: calls.__setitem__(form, calls[form] + 1) or function(*args)

    with monkeypatch.context() as patch:
        patch.setattr(packing, "FORM", form)
        patch.setattr(packing, "transposed_linear", count("transposed", transposed_linear))
        patch.setattr(torch.ops.mkl, "_mkl_linear", count("packed", mkl_linear))
        ours = decode(model.decoder, features, **settings)
        assert calls[form] > 0 and sum(calls.values()) == calls[form]
        patch.setattr(packing, "FORM", "plain")
        plain = decode(model.decoder, features, **settings)
        assert sum(calls.values()) == calls[form]  # plain: torch's own layers only
    return ours, plain


@pytest.mark.parametrize("form", [pytest.param("packed", marks=needs_packing), "transposed"])
@pytest.mark.parametrize("decode,settings", [(greedy_decode, {}), (beam_search, {"beam_size": 3})])
@pytest.mark.parametrize("variant", [[], ["model.gate=vector", "model.score=general"]])
def test_packed_decoding_gives_torchs_captions(decode, settings, variant, form, monkeypatch):
    torch.manual_seed(0)
    model = tiny_model("model.hidden_dim=40", *variant).eval()
    with torch.no_grad():
        for p in model.decoder.out.parameters():
            p.mul_(8)  # sharper word distributions: longer, more varied captions
        features = model.encoder(batch(size=12)[0])
    packed, plain = decode_both(
        decode, model, features, monkeypatch, form, max_length=10, **settings
    )
    assert torch.equal(packed.tokens, plain.tokens)
    torch.testing.assert_close(packed.scores, plain.scores, rtol=0, atol=1e-5)
    torch.testing.assert_close(packed.alphas, plain.alphas, rtol=0, atol=1e-6)
    assert int(packed.lengths.sum()) > 12  # captions of several words, not all ended at once


@needs_packing
def test_a_weight_is_packed_at_its_second_call_with_the_same_rows():
    layer = Linear(24, 40)
    packs = Packs()
    with torch.no_grad():
        rows16, rows9 = torch.randn(16, 24), torch.randn(9, 24)
        for inputs, packed_after in [(rows16, False), (rows16, True), (rows9, False)]:
            out = packs.linear(inputs, layer.weight, layer.bias)
            torch.testing.assert_close(out, F.linear(inputs, layer.weight, layer.bias))
            assert (packs._packs[id(layer.weight)][2] is not None) == packed_after
        packs.linear(rows9, layer.weight, layer.bias)  # packed for 9 rows now
        layer.weight.add_(1.0)  # a changed weight is packed anew
        out = packs.linear(rows9, layer.weight, layer.bias)
        torch.testing.assert_close(out, F.linear(rows9, layer.weight, layer.bias))
        assert packs._packs[id(layer.weight)][2] is None


@needs_packing
def test_packing_leaves_training_autocast_and_small_batches_to_torch():
    layer = Linear(24, 40)
    inputs = torch.randn(16, 24)
    packs = Packs()
    with torch.no_grad():
        packs.linear(torch.randn(4, 24), layer.weight, layer.bias)
    assert id(layer.weight) not in packs._packs  # fewer rows than MIN_ROWS
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        packs.linear(inputs, layer.weight, layer.bias)
    assert id(layer.weight) not in packs._packs  # autocast runs the product in bf16
    with packed_weights():
        out = layer(inputs)  # gradients on
        out.sum().backward()
    assert layer.weight.grad is not None and not packs._packs
    with packed_weights(), torch.no_grad():
        assert packing.active() is not None
    assert packing.active() is None


@needs_packing
def test_the_packed_cell_is_torchs_cell():
    torch.manual_seed(1)
    cell = LSTMCell(20, 12)
    reference = nn.LSTMCell(20, 12)
    reference.load_state_dict(cell.state_dict())
    inputs, h, c = torch.randn(10, 20), torch.randn(10, 12), torch.randn(10, 12)
    with torch.no_grad(), packed_weights():
        for _ in range(3):  # the second and third calls run on packed weights
            ours = cell(inputs, (h, c))
            theirs = reference(inputs, (h, c))
            for a, b in zip(ours, theirs):
                torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
            h, c = theirs


def test_the_layers_are_torchs_outside_packing():
    """No block, no packs: the state-dict keys and the numbers are nn.Linear's."""
    layer = Linear(6, 4)
    assert list(layer.state_dict()) == ["weight", "bias"]
    inputs = torch.randn(9, 6)
    torch.testing.assert_close(layer(inputs), F.linear(inputs, layer.weight, layer.bias))
    with packed_weights(enabled=False):
        assert packing.active() is None


def test_the_probe_answers_inside_autocast():
    """A process whose first decoding runs under bf16 autocast (a bf16 run's validation)
    probes the packed kernel there: the probe computes in fp32 all the same."""
    packing.packing_available.cache_clear()
    try:
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            available = packing.packing_available()
        packing.packing_available.cache_clear()
        assert available == packing.packing_available()
        torch.manual_seed(0)
        model = tiny_model().eval()
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            features = model.encoder(batch(size=9)[0])
            packing.packing_available.cache_clear()
            decoded = greedy_decode(model.decoder, features, max_length=5)
        assert decoded.tokens.shape[0] == 9
    finally:
        packing.packing_available.cache_clear()


@pytest.mark.parametrize(
    "vendor,mkl,packs,form",
    [
        ("AuthenticAMD", True, True, "transposed"),
        ("GenuineIntel", True, True, "packed"),
        ("", True, True, "packed"),
        ("GenuineIntel", True, False, "plain"),
        ("AuthenticAMD", False, False, "plain"),
    ],
)
def test_the_host_form_follows_the_cpus_maker(vendor, mkl, packs, form, monkeypatch):
    from captioning import runtime

    monkeypatch.setattr(runtime, "cpu_vendor", lambda: vendor)
    monkeypatch.setattr(torch.backends.mkl, "is_available", lambda: mkl)
    monkeypatch.setattr(packing, "packing_available", lambda: packs)
    assert packing.host_form() == form
    monkeypatch.setattr(packing, "FORM", "plain")
    assert packing.host_form() == "plain"
    monkeypatch.setattr(packing, "FORM", "fast")
    with pytest.raises(ValueError, match="packing.FORM must be one of packed, transposed, plain"):
        packing.host_form()


def test_the_cpu_vendor_is_read_from_cpuinfo():
    import platform
    from pathlib import Path

    from captioning import runtime

    assert runtime.cpuinfo_field("no such field") == ""
    if platform.machine() not in ("x86_64", "AMD64") or not Path("/proc/cpuinfo").exists():
        pytest.skip("an x86 CPU's vendor_id is read from Linux's /proc/cpuinfo")
    vendor = runtime.cpu_vendor()
    assert vendor and vendor.isalnum()  # e.g. GenuineIntel, AuthenticAMD


def test_the_transposed_form_is_f_linear_in_rows_up_to_its_limit():
    torch.manual_seed(2)
    layer = Linear(24, 40)
    packs = Packs("transposed")
    limit = packing.TRANSPOSED_MAX_ROWS
    with torch.no_grad():
        for rows in (8, limit, limit + 1):
            inputs = torch.randn(rows, 24)
            expected = F.linear(inputs, layer.weight, layer.bias)
            out = packs.linear(inputs, layer.weight, layer.bias)
            torch.testing.assert_close(out, expected, rtol=0, atol=1e-6)
            assert out.is_contiguous()
            loose = packs.linear(inputs, layer.weight, layer.bias, any_layout=True)
            torch.testing.assert_close(loose, expected, rtol=0, atol=1e-6)
            # up to the limit the product is W x^T, its columns contiguous; past it F.linear's
            assert loose.is_contiguous() == (rows > limit)
        three = torch.randn(2, 9, 24)  # rows of a 3-d input, put back in its shape
        out = packs.linear(three, layer.weight, None)
        torch.testing.assert_close(out, F.linear(three, layer.weight), rtol=0, atol=1e-6)
        assert out.shape == (2, 9, 40)
