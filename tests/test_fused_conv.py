"""A frozen convolution with its ReLU/ReLU6 in one oneDNN pass gives the tensor the two
give apart, and steps aside wherever it cannot run."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from captioning.config import ModelConfig
from captioning.models import fused_conv
from captioning.models.encoder import build_encoder
from captioning.models.fused_conv import ConvActivation, fuse_activations, fused_kernel_works

needs_kernel = pytest.mark.skipif(not fused_kernel_works(), reason="no oneDNN conv post-ops")


def _convs():
    """Convolutions of every kind MobileNetV2 and the dilated stride-16 grid use."""
    return [
        nn.Conv2d(8, 16, 1),  # expansion
        nn.Conv2d(8, 8, 3, stride=2, padding=1, groups=8, bias=False),  # depthwise, stride 2
        nn.Conv2d(8, 8, 3, padding=2, dilation=2, groups=8),  # dilated depthwise
        nn.Conv2d(8, 12, 3, padding=1),  # dense 3x3
    ]


@needs_kernel
@pytest.mark.parametrize("activation", [nn.ReLU6, nn.ReLU])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_the_fused_pass_gives_the_convolution_and_clamp(activation, precision):
    """In bf16 both run oneDNN's convolution and the clamp commutes with the rounding, so the
    tensor is the same to the bit; in fp32 torch may pick another kernel for the convolution
    alone on some hosts (an AVX2 host differed by 1e-6), so the two agree to fp32 rounding."""
    torch.manual_seed(0)
    x = 4 * torch.randn(3, 8, 13, 13)
    for conv in _convs():
        fused = ConvActivation(conv, activation()).requires_grad_(False)
        with torch.no_grad(), torch.autocast("cpu", enabled=precision == "bf16"):
            apart = activation()(conv(x))
            out = fused(x)
        assert out.dtype == apart.dtype == (torch.bfloat16 if precision == "bf16" else x.dtype)
        assert out.shape == apart.shape
        assert (apart > 0).any() and (apart == 0).any()  # the clamp did something
        if activation is nn.ReLU6:
            assert (apart == 6).any()
        exact = precision == "bf16"
        torch.testing.assert_close(out, apart, rtol=0 if exact else 1e-5, atol=0 if exact else 1e-5)


def test_with_a_gradient_it_runs_the_two_apart():
    """A convolution that trains, or an input that needs a gradient, gets one."""
    torch.manual_seed(0)
    conv = nn.Conv2d(4, 4, 3, padding=1)
    fused = ConvActivation(conv, nn.ReLU6())
    x = torch.randn(2, 4, 6, 6, requires_grad=True)
    fused(x).sum().backward()
    expected = torch.autograd.grad(F.relu6(conv(x)).sum(), x)[0]
    torch.testing.assert_close(x.grad, expected)
    assert conv.weight.grad is not None


def test_other_activations_and_padding_are_left_alone(monkeypatch):
    block = nn.Sequential(
        nn.Conv2d(3, 3, 3, padding=1),
        nn.Identity(),  # where a folded BatchNorm was
        nn.ReLU6(inplace=True),
        nn.Conv2d(3, 3, 3, padding=1, padding_mode="reflect"),
        nn.ReLU(),
        nn.Conv2d(3, 3, 1),
        nn.Sigmoid(),
    )
    expected = 1 if fused_kernel_works() else 0
    assert fuse_activations(block) == expected
    assert isinstance(block[0], ConvActivation) == bool(expected)
    assert isinstance(block[4], nn.ReLU) and isinstance(block[6], nn.Sigmoid)
    with pytest.raises(ValueError, match="cannot fuse Sigmoid"):
        ConvActivation(nn.Conv2d(3, 3, 1), nn.Sigmoid())
    monkeypatch.setattr(fused_conv, "fused_kernel_works", lambda: False)
    assert fuse_activations(nn.Sequential(nn.Conv2d(3, 3, 1), nn.ReLU())) == 0


@needs_kernel
@pytest.mark.parametrize("output_stride", [32, 16])
def test_the_folded_mobilenet_gives_the_same_grid_bit_for_bit(output_stride):
    """Every ReLU6 of MobileNetV2 joins its convolution, at either output stride; under
    bf16 autocast (how features are extracted) the grid is the same to the bit."""
    torch.manual_seed(0)
    cfg = ModelConfig(
        encoder="mobilenet_v2", weights=None, image_size=64, output_stride=output_stride
    )
    encoder = build_encoder(cfg)
    images = torch.randint(0, 256, (2, 3, 64, 64), dtype=torch.uint8)
    for module in encoder.modules():  # statistics that keep the activations near unit size
        if isinstance(module, nn.BatchNorm2d):
            module.momentum = None
            module.train()  # the frozen encoder keeps them in eval mode otherwise
    with torch.no_grad():
        encoder.backbone(images)
    encoder.eval()
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        encoder.fold_batch_norms()
        fused = encoder.backbone(images)
        for module in encoder.modules():
            if isinstance(module, nn.Sequential):
                for name, child in module.named_children():
                    if isinstance(child, ConvActivation):
                        setattr(module, name, nn.Sequential(child.conv, child.activation))
        apart = encoder.backbone(images)
    assert sum(isinstance(m, nn.ReLU6) for m in encoder.modules()) == 35
    assert fused.dtype == torch.bfloat16 and fused.abs().max() > 0.1
    torch.testing.assert_close(fused, apart, rtol=0, atol=0)


@needs_kernel
def test_folding_without_fuse_keeps_each_clamp_apart():
    """``fold_batch_norms(fuse=False)`` folds the BatchNorms and joins no clamp (the
    encoder benchmark's "apart" side); the default joins them."""
    cfg = ModelConfig(encoder="mobilenet_v2", weights=None, image_size=64)
    apart, joined = build_encoder(cfg).eval(), build_encoder(cfg).eval()
    assert apart.fold_batch_norms(fuse=False) == joined.fold_batch_norms() > 0
    assert not any(isinstance(m, ConvActivation) for m in apart.modules())
    assert sum(isinstance(m, ConvActivation) for m in joined.modules()) == 35
