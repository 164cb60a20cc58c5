"""A frozen convolution and the clamp after it (ReLU or ReLU6) in one pass on the CPU.

On the CPU an elementwise pass over a MobileNetV2 activation costs as much as the
convolution that made it: the network's expanded activations are large and the clamp reads
and writes every one. oneDNN applies the clamp as the convolution writes its output (the
post-op torch's own compiler uses, ``torch.ops.mkldnn._convolution_pointwise``), so the
activation is written once. In bf16 (how features are extracted) the result is the same
tensor to the bit: both ways run oneDNN's convolution, and rounding to bf16 commutes with a
clamp at 0 and 6. In fp32 torch may run the convolution alone with another kernel on some
hosts, so the two agree to fp32 rounding there.

:func:`fuse_activations` swaps each (Conv2d, ReLU/ReLU6) pair of a Sequential, identities
between them skipped, for a :class:`ConvActivation`, only for inference (the encoder's
:meth:`~captioning.models.encoder.Encoder.fold_batch_norms` calls it after folding the
BatchNorms). The fused kernel is used only where it can be: CPU tensors without gradients;
everywhere else, and where this torch lacks the kernel or gives a different answer on a
probe, the module runs the convolution and the clamp one after the other.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

# the clamps that fuse, as (oneDNN post-op, its scalars)
_CLAMPS: dict[type[nn.Module], tuple[str, list[float]]] = {
    nn.ReLU: ("relu", []),
    nn.ReLU6: ("hardtanh", [0.0, 6.0]),
}


@functools.cache
def fused_kernel_works() -> bool:
    """Whether this torch's oneDNN convolution with a clamp post-op exists and gives what
    the convolution and the clamp give apart, on a small probe (fp32 and bf16)."""
    op = getattr(torch.ops.mkldnn, "_convolution_pointwise", None)
    if op is None or not torch.backends.mkldnn.is_available():
        return False
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(2, 8, 9, 9, generator=generator)
    weight = torch.randn(8, 1, 3, 3, generator=generator)
    bias = torch.randn(8, generator=generator)
    try:
        for dtype in (torch.float32, torch.bfloat16):
            args = (x.to(dtype), weight.to(dtype), bias.to(dtype))
            fused = op(*args, [1, 1], [2, 2], [1, 1], 8, "hardtanh", [0.0, 6.0], "")
            apart = F.relu6(F.conv2d(*args, stride=2, padding=1, groups=8))
            if fused.dtype != dtype or not torch.allclose(fused.float(), apart.float(), 0, 1e-2):
                return False
    except (RuntimeError, NotImplementedError):
        return False
    return True


class ConvActivation(nn.Module):
    """``clamp(conv(x))`` for a frozen ``conv`` and ``activation`` (ReLU or ReLU6), one pass
    on the CPU when no gradient is asked for. Keeps the two modules (their parameters keep
    their names under ``conv``)."""

    def __init__(self, conv: nn.Conv2d, activation: nn.Module) -> None:
        super().__init__()
        if type(activation) not in _CLAMPS:
            raise ValueError(f"cannot fuse {type(activation).__name__} into a convolution")
        self.conv = conv
        self.activation = activation
        self.post_op, self.scalars = _CLAMPS[type(activation)]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if (
            x.device.type != "cpu"
            or torch.is_grad_enabled()
            and (x.requires_grad or self.conv.weight.requires_grad)
        ):
            return self.activation(self.conv(x))
        weight, bias = self.conv.weight, self.conv.bias
        if torch.is_autocast_enabled("cpu"):  # what autocast would do to a convolution
            dtype = torch.get_autocast_dtype("cpu")
            x, weight = x.to(dtype), weight.to(dtype)
            bias = None if bias is None else bias.to(dtype)
        if x.dtype not in (torch.float32, torch.bfloat16) or weight.dtype != x.dtype:
            return self.activation(self.conv(x))
        with torch.autocast("cpu", enabled=False):
            return torch.ops.mkldnn._convolution_pointwise(
                x,
                weight,
                bias,
                list(self.conv.padding),
                list(self.conv.stride),
                list(self.conv.dilation),
                self.conv.groups,
                self.post_op,
                self.scalars,
                "",
            )


def fuse_activations(sequence: nn.Sequential) -> int:
    """Replace each Conv2d of ``sequence`` followed (identities skipped) by a ReLU or ReLU6
    with a :class:`ConvActivation`, the clamp by an identity; the number fused. Nothing is
    fused where the kernel does not work, or for a convolution that pads other than with
    zeros or by a string."""
    if not fused_kernel_works():
        return 0
    children = [(n, m) for n, m in sequence.named_children() if not isinstance(m, nn.Identity)]
    fused = 0
    for (name, conv), (act_name, activation) in zip(children, children[1:]):
        if (
            type(conv) is nn.Conv2d
            and type(activation) in _CLAMPS
            and conv.padding_mode == "zeros"
            and not isinstance(conv.padding, str)
        ):
            setattr(sequence, name, ConvActivation(conv, activation))
            setattr(sequence, act_name, nn.Identity())
            fused += 1
    return fused
