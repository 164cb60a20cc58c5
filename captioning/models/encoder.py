"""Image encoders: a CNN cut at its last convolutional stage, returning a grid of features.

The encoder owns its preprocessing: :meth:`Encoder.transform` turns a PIL image into a uint8
tensor of the right size, and :meth:`Encoder.forward` normalises with the statistics of the
weights it was built with (torchvision's ``weights.transforms()`` convention).
"""

from __future__ import annotations

import contextlib
import logging
import math
import pickle
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
import torchvision
from PIL import Image
from torch import nn
from torch.nn.utils.fusion import fuse_conv_bn_eval

from captioning.config import ModelConfig, RuntimeConfig
from captioning.errors import ConfigError
from captioning.models.fused_conv import fuse_activations

logger = logging.getLogger("captioning")

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


class ResidualBlock(nn.Module):
    """``relu(bn(conv3x3(x)) + shortcut(x))``, then optional 2x2 max pooling: a plain block
    with an identity path (He et al., 2016), through a 1x1 conv-BN where the channel count
    changes (their option B)."""

    def __init__(self, c_in: int, c_out: int, pool: bool) -> None:
        super().__init__()
        self.conv = nn.Conv2d(c_in, c_out, 3, padding=1, bias=False)
        self.norm = nn.BatchNorm2d(c_out)
        self.shortcut: nn.Module = nn.Identity()
        if c_in != c_out:
            self.shortcut = nn.Sequential(
                nn.Conv2d(c_in, c_out, 1, bias=False), nn.BatchNorm2d(c_out)
            )
        self.pool = nn.MaxPool2d(2) if pool else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.pool(torch.relu(self.norm(self.conv(x)) + self.shortcut(x)))

    def fold_batch_norm(self) -> int:
        """Fold the eval-mode BatchNorm after the 3x3 conv into it (see
        :meth:`Encoder.fold_batch_norms`; the shortcut's is a Sequential and folded there)."""
        if type(self.norm) is not nn.BatchNorm2d or self.norm.running_mean is None:
            return 0
        self.conv = fuse_conv_bn_eval(self.conv, self.norm).requires_grad_(False)
        self.norm = nn.Identity()
        return 1


class PreActBlock(nn.Module):
    """``x`` zero-padded to ``c_out`` channels plus ``conv3x3(relu(bn(x)))``, then optional
    2x2 max pooling: a pre-activation block (He et al., 2016, "Identity mappings") whose
    shortcut is the identity itself (their option A), so every input channel reaches the
    grid unchanged unless a convolution learns to change it."""

    def __init__(self, c_in: int, c_out: int, pool: bool) -> None:
        super().__init__()
        if c_out < c_in:
            raise ConfigError(
                f"model.cnn_block=preact needs model.cnn_channels that never shrink "
                f"({c_in} -> {c_out}); widen the later entries or use model.cnn_block=residual"
            )
        self.norm = nn.BatchNorm2d(c_in)
        self.conv = nn.Conv2d(c_in, c_out, 3, padding=1, bias=False)
        self.extra = c_out - c_in
        self.pool = nn.MaxPool2d(2) if pool else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        residual = self.conv(torch.relu(self.norm(x)))
        return self.pool(nn.functional.pad(x, (0, 0, 0, 0, 0, self.extra)) + residual)


CNN_BLOCKS = ("plain", "residual", "preact")


class SmallCNN(nn.Module):
    """A small CNN trained from scratch, for the shapes data and CPU work.

    A 5x5 stride-2 stem, then one 3x3 block per further entry of ``channels``, each but the
    last followed by 2x2 max pooling. With ``channels=[32, 64, 128, 128]`` a 96 px image
    gives a 12x12x128 grid.

    Plain conv-BN-ReLU blocks lose the objects' colours on some random starts: in the first
    200 steps the deep blocks overwrite them while the stem still holds them (a linear probe
    reads them at 1.0 from the stem and at chance from the grid), and the colour words never
    learn where to look. An identity path keeps them (docs/attention.md): ``residual`` blocks
    add a learnt 1x1 projection where the channel count changes; ``preact`` blocks (the
    default) add the input itself, zero-padded, so nothing but a convolution's own output
    can change what the stem found, and a BatchNorm closes the stack.

    Args:
        channels: output channels of the stem and of each block.
        block: ``preact``, ``residual`` or ``plain`` (checkpoints from before the identity
            path existed).
    """

    def __init__(self, channels: list[int], block: str = "preact") -> None:
        super().__init__()
        if not channels:
            raise ConfigError("model.cnn_channels needs at least one entry")
        if block not in CNN_BLOCKS:
            raise ConfigError(f"model.cnn_block={block!r}: choose one of {', '.join(CNN_BLOCKS)}")
        stages: list[nn.Module] = [
            nn.Sequential(
                nn.Conv2d(3, channels[0], 5, stride=2, padding=2, bias=False),
                nn.BatchNorm2d(channels[0]),
                nn.ReLU(inplace=True),
            )
        ]
        for i, (c_in, c_out) in enumerate(zip(channels[:-1], channels[1:])):
            pool = i < len(channels) - 2
            if block == "residual":
                stages.append(ResidualBlock(c_in, c_out, pool))
            elif block == "preact":
                stages.append(PreActBlock(c_in, c_out, pool))
            else:
                layers: list[nn.Module] = [
                    nn.Conv2d(c_in, c_out, 3, padding=1, bias=False),
                    nn.BatchNorm2d(c_out),
                    nn.ReLU(inplace=True),
                ]
                if pool:
                    layers.append(nn.MaxPool2d(2))
                stages.append(nn.Sequential(*layers))
        if block == "preact" and len(channels) > 1:
            # the sum of the identity paths is unnormalised: one BatchNorm brings the grid
            # back to the scale the attention's projections start at
            stages[-1] = nn.Sequential(stages[-1], nn.BatchNorm2d(channels[-1]))
        self.stages = nn.Sequential(*stages)
        self.out_channels = channels[-1]

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.stages(images)  # (B, C, H', W')


# The flat inverted-residual blocks of MobileNetV2 code older than torchvision's: their BN
# and linear conv sit at conv.4, conv.6, conv.7, which torchvision's blocks (conv.0-conv.3) lack.
_OLD_MOBILENET_V2_KEY = re.compile(r"^(?:module\.)?features\.\d+\.conv\.[4-7]\.")


def _load_torchvision(name: str, weights: str | None) -> tuple[nn.Module, tuple, tuple]:
    """A torchvision classifier by name, with weights by enum name or local file, and its
    normalisation statistics."""
    try:
        weights_enum = torchvision.models.get_model_weights(name)
    except ValueError as exc:
        known = ", ".join(["small_cnn", "vgg19", "resnet50", "resnet101", "resnet152", "..."])
        raise ConfigError(f"model.encoder {name!r} is not a torchvision model ({known})") from exc
    enum_weights = None
    state_dict = None
    if weights and weights.lower() != "none":
        if Path(weights).suffix in (".pt", ".pth", ".bin") or Path(weights).exists():
            if not Path(weights).is_file():
                raise ConfigError(f"model.weights file {weights} does not exist")
            state_dict = read_weights(weights, f"model.weights={weights}")
            if isinstance(state_dict, dict) and "state_dict" in state_dict:
                state_dict = state_dict["state_dict"]
        else:
            try:
                enum_weights = weights_enum[weights]
            except KeyError as exc:
                names = ", ".join(w.name for w in weights_enum)
                raise ConfigError(
                    f"model.weights {weights!r} is neither a file nor a weights name of "
                    f"{name} ({names})"
                ) from exc
    model = torchvision.models.get_model(name, weights=enum_weights)
    if state_dict is not None:
        if isinstance(state_dict, dict) and any(
            isinstance(k, str) and _OLD_MOBILENET_V2_KEY.match(k) for k in state_dict
        ):
            raise ConfigError(
                f"model.weights {weights} holds MobileNetV2 weights in an older key layout "
                f"(features.N.conv.0 ... conv.7, not torchvision's conv.0.0, conv.0.1, ...): "
                f"convert the file with `python -m tools.convert_weights {weights} OUT.pt "
                f"--arch mobilenet_v2` and set model.weights to OUT.pt"
            )
        try:
            missing, unexpected = model.load_state_dict(state_dict, strict=False)
        except (RuntimeError, TypeError, AttributeError) as exc:  # shapes that differ
            reason = " ".join(str(exc).split())[:300]
            raise ConfigError(f"model.weights {weights} does not fit {name}: {reason}") from exc
        missing = [k for k in missing if not k.startswith(("fc.", "classifier."))]
        if missing or unexpected:
            raise ConfigError(
                f"model.weights {weights} does not fit {name}: "
                f"{len(missing)} missing keys (e.g. {missing[:1]}), "
                f"{len(unexpected)} unexpected (e.g. {unexpected[:1]})"
            )
    # Normalisation comes from the weights' own transforms; untrained weights use ImageNet's.
    transform = (enum_weights or weights_enum.DEFAULT).transforms()
    mean = tuple(getattr(transform, "mean", IMAGENET_MEAN))
    std = tuple(getattr(transform, "std", IMAGENET_STD))
    return model, mean, std


def _cut_backbone(name: str, model: nn.Module) -> list[nn.Module]:
    """The classifier's convolutional stages, in order, without pooling head or classifier."""
    if hasattr(model, "layer4"):  # resnet, resnext, wide_resnet
        stem = nn.Sequential(model.conv1, model.bn1, model.relu, model.maxpool)
        return [stem, model.layer1, model.layer2, model.layer3, model.layer4]
    if name.startswith("vgg"):
        # Stages end at each max-pool; the last pool is dropped so vgg19 ends at conv5_4
        # (14x14x512 at 224 px, the paper's annotation vectors).
        stages, current = [], []
        for layer in model.features:
            current.append(layer)
            if isinstance(layer, nn.MaxPool2d):
                stages.append(nn.Sequential(*current))
                current = []
        stages[-1] = nn.Sequential(*list(stages[-1])[:-1])
        return stages
    if hasattr(model, "features"):  # densenet, efficientnet, mobilenet, convnext, ...
        return list(model.features.children())
    raise ConfigError(f"model.encoder {name!r}: do not know where its convolutional stages end")


def halve_stride(stages: list[nn.Module]) -> None:
    """Make the last downsampling of ``stages`` keep its resolution and dilate every
    convolution after it by 2 (padding to match), so the output grid doubles in each
    direction while every convolution keeps its weights and sees the same neighbourhood in
    the image (Chen et al. 2017, DeepLabv3's output stride 16). In place."""
    modules = [
        m for stage in stages for m in stage.modules() if isinstance(m, nn.Conv2d | nn.MaxPool2d)
    ]
    strided = [i for i, m in enumerate(modules) if _stride(m) == 2]
    if not strided:
        raise ConfigError("model.output_stride: the backbone has no stride-2 layer to undo")
    last = strided[-1]
    if isinstance(modules[last], nn.MaxPool2d):  # a 2 x 2 pool at stride 1 would lose a row
        raise ConfigError(
            "model.output_stride: this backbone's last downsampling is a pooling layer, "
            "which dilation cannot undo; leave model.output_stride null"
        )
    # a residual block downsamples on two paths (the 3 x 3 convolution and the 1 x 1
    # shortcut): every stride-2 layer of the block that holds the last one
    stage = next(st for st in stages if any(m is modules[last] for m in st.modules()))
    block = stage
    if isinstance(stage, nn.Sequential):  # a stage of blocks (a ResNet's layer4)
        block = next(c for c in stage.children() if any(m is modules[last] for m in c.modules()))
    inside = [m for m in block.modules()]
    first = min(i for i in strided if any(modules[i] is m for m in inside))
    for i, module in enumerate(modules):
        if i >= first and _stride(module) == 2:
            module.stride = (1, 1)
        elif i > last and isinstance(module, nn.Conv2d) and module.kernel_size[0] > 1:
            module.dilation = tuple(2 * d for d in module.dilation)
            module.padding = tuple(
                d * (k - 1) // 2 for d, k in zip(module.dilation, module.kernel_size)
            )


def _stride(module: nn.Module) -> int:
    stride = module.stride
    return int(stride[0] if isinstance(stride, tuple) else stride)


def sinusoidal_positions(height: int, width: int, dim: int) -> torch.Tensor:
    """2-D sine/cosine position codes: half the channels encode the row, half the column."""
    if dim % 4:
        raise ConfigError(f"sinusoidal positions need a feature size divisible by 4, got {dim}")
    quarter = dim // 4
    freqs = torch.exp(-math.log(10000.0) * torch.arange(quarter) / quarter)  # (dim/4,)
    rows = torch.arange(height).float()[:, None] * freqs  # (H, dim/4)
    cols = torch.arange(width).float()[:, None] * freqs  # (W, dim/4)
    row_code = torch.cat([rows.sin(), rows.cos()], dim=1)[:, None, :].expand(-1, width, -1)
    col_code = torch.cat([cols.sin(), cols.cos()], dim=1)[None, :, :].expand(height, -1, -1)
    return torch.cat([row_code, col_code], dim=2).reshape(height * width, dim)  # (L, dim)


class Encoder(nn.Module):
    """Backbone + optional pooling to a fixed grid + optional 2-D positions → (B, L, D).

    Args:
        stages: the backbone's convolutional stages in order.
        out_channels: D, the feature size of the last stage.
        image_size: the side length images are resized to.
        mean, std: normalisation statistics of the backbone's weights.
        grid_size: adaptive average pooling to ``grid_size x grid_size``; None keeps the
            backbone's own grid.
        positional: ``none``, ``learned`` or ``sinusoidal`` position codes added to the grid.
        fine_tune: ``none`` (frozen, kept in eval mode), ``all``, or ``last_N``.
        channels_last: run the convolutions on channels-last (NHWC) tensors, which oneDNN on
            the CPU and cuDNN with tensor cores both prefer (the small CNN's step: about 15%
            less time on the CPU, see docs/speed.md); the grid is the same either way.
        summary_stages: the backbone's later stages, run on the last stage's output: for a
            summary, averaged over their cells into one vector per image (what the image
            shows, beside the grid that says where), and for hypercolumns, upsampled to the
            grid. None: neither. They never train.
        tiles: cut the image into ``tiles x tiles`` cells and run the stages on each cell's
            window alone, averaging each window's output into its cell's vector (local
            cells, see :meth:`windows`); a summary is then the whole image's, run through
            every stage and the summary stages. None: the backbone's own grid.
        tile_size: the side of a window in pixels (default: twice a cell).
        summary: pack the later stages' pooled output after the cells (needs
            ``summary_stages``).
        hypercolumn: join to each cell's channels the later stages' output at its place,
            upsampled bilinearly to the grid (Hariharan et al. 2015): D is then the last
            stage's channels plus the later stages' (needs ``summary_stages``).

    With a summary, :meth:`backbone` returns the S summary channels packed after the L grid
    cells as ``summary_rows`` = ceil(S / D) extra rows of D channels (zero-padded), so that
    every path that carries a grid (the feature cache, batches, beam search's rows per
    image) carries the summary with it; :func:`split_summary` takes them apart.
    """

    def __init__(
        self,
        stages: list[nn.Module],
        out_channels: int,
        image_size: int,
        mean: tuple[float, ...] = IMAGENET_MEAN,
        std: tuple[float, ...] = IMAGENET_STD,
        grid_size: int | None = None,
        positional: str = "none",
        fine_tune: str = "none",
        channels_last: bool = True,
        summary_stages: list[nn.Module] | None = None,
        tiles: int | None = None,
        tile_size: int | None = None,
        summary: bool = True,
        hypercolumn: bool = False,
    ) -> None:
        super().__init__()
        if hypercolumn and (not summary_stages or tiles):
            raise ValueError("hypercolumns need the later stages and the backbone's own grid")
        self.hypercolumn = hypercolumn
        self.tiles = tiles
        self.tile_size = (tile_size or 2 * -(-image_size // tiles)) if tiles else None
        self.stages = nn.ModuleList(stages)
        self.summary_stages = nn.ModuleList(summary_stages) if summary_stages else None
        self.channels_last = channels_last
        self.image_size = image_size
        self.register_buffer("mean", torch.tensor(mean).view(1, 3, 1, 1) * 255.0)
        self.register_buffer("std", torch.tensor(std).view(1, 3, 1, 1) * 255.0)
        # a tiled grid pools each window to one cell
        pooled = 1 if tiles else grid_size
        self.pool = nn.AdaptiveAvgPool2d(pooled) if pooled else nn.Identity()
        with torch.no_grad():
            probe = torch.zeros(1, 3, self.tile_size or image_size, self.tile_size or image_size)
            try:
                for stage in self.stages:
                    stage.eval()
                    probe = stage(probe)
                later = probe
                for stage in self.summary_stages or []:
                    stage.eval()
                    later = stage(later)
                if hypercolumn:
                    out_channels += int(later.shape[1])
                probe = self.pool(probe)
            except RuntimeError as exc:  # a stage's output would be smaller than 1 x 1
                raise ConfigError(
                    f"model.image_size={image_size} is too small for this encoder (a stage's "
                    f"output would be empty); use a larger image size"
                ) from exc
        self.out_channels = out_channels
        self.summary_dim = int(later.shape[1]) if summary and self.summary_stages else 0
        self.summary_rows = -(-self.summary_dim // out_channels)  # ceil(S / D)
        if self.summary_stages is not None:
            self.summary_stages.requires_grad_(False)
        if channels_last:
            self.stages.to(memory_format=torch.channels_last)
            if self.summary_stages is not None:
                self.summary_stages.to(memory_format=torch.channels_last)
        self.grid_shape = (tiles, tiles) if tiles else (int(probe.shape[2]), int(probe.shape[3]))
        num_cells = self.grid_shape[0] * self.grid_shape[1]
        if positional == "learned":
            self.positions = nn.Parameter(torch.randn(num_cells, out_channels) * 0.02)
        elif positional == "sinusoidal":
            self.register_buffer("positions", sinusoidal_positions(*self.grid_shape, out_channels))
        elif positional == "none":
            self.positions = None
        else:
            raise ConfigError(f"model.positional must be none, learned or sinusoidal: {positional}")
        self._set_trainable(fine_tune)

    def _set_trainable(self, fine_tune: str) -> None:
        if fine_tune == "all":
            trainable = len(self.stages)
        elif fine_tune == "none":
            trainable = 0
        else:
            trainable = int(fine_tune.split("_", 1)[1])
            if trainable > len(self.stages):
                raise ConfigError(
                    f"model.fine_tune={fine_tune} but the encoder has {len(self.stages)} stages"
                )
        self.frozen_stages = len(self.stages) - trainable
        for i, stage in enumerate(self.stages):
            for param in stage.parameters():
                param.requires_grad_(i >= self.frozen_stages)

    def train(self, mode: bool = True) -> Encoder:
        super().train(mode)
        # Frozen stages stay in eval mode so their BatchNorm statistics never drift.
        for stage in list(self.stages)[: self.frozen_stages]:
            stage.eval()
        if self.summary_stages is not None:
            self.summary_stages.eval()
        return self

    @property
    def num_cells(self) -> int:
        return self.grid_shape[0] * self.grid_shape[1]

    @property
    def num_rows(self) -> int:
        """The rows of :meth:`backbone`'s output: the L cells and the summary's rows."""
        return self.num_cells + self.summary_rows

    def transform(self, image: Image.Image) -> torch.Tensor:
        """A PIL RGB image → uint8 tensor (3, S, S), S = ``image_size``."""
        resized = image.resize((self.image_size, self.image_size), Image.BICUBIC)
        return torch.from_numpy(np.asarray(resized, dtype=np.uint8).copy()).permute(2, 0, 1)

    def fold_batch_norms(self, fuse: bool = True) -> int:
        """Fold every BatchNorm that directly follows a convolution in a frozen stage into
        that convolution's weights, for inference: an eval-mode BatchNorm is an affine map per
        channel, so the folded convolution computes the same grid (to float rounding) in one
        pass instead of two (a MobileNetV2 at 320 px spends about a third of its CPU time in
        its BatchNorms). With ``fuse``, a ReLU or ReLU6 after a convolution then joins it
        (:mod:`captioning.models.fused_conv`: the same grid, its activation written once;
        ``benchmarks/encoder_speed.py`` times the two).
        Only in eval mode; the folded encoder has other parameter names and must not be
        trained or saved. Returns how many BatchNorms were folded."""
        if self.training:
            raise RuntimeError("fold BatchNorms only into an encoder in eval mode")
        folded = 0
        for stage in [*list(self.stages)[: self.frozen_stages], *(self.summary_stages or [])]:
            for module in stage.modules():  # the stage itself first
                if isinstance(module, nn.Sequential):
                    folded += _fold_in_sequence(module)
                    if fuse:
                        fuse_activations(module)
                elif isinstance(module, ResidualBlock):
                    folded += module.fold_batch_norm()
        if folded and self.channels_last:
            self.stages.to(memory_format=torch.channels_last)  # the folded weights too
            if self.summary_stages is not None:
                self.summary_stages.to(memory_format=torch.channels_last)
        return folded

    @property
    def frozen(self) -> bool:
        """True when no backbone weight trains (``fine_tune: none``): its grid can be cached."""
        return self.frozen_stages == len(self.stages)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        """``images`` (B, 3, S, S), uint8 or float in 0..255 → features (B, L, D)."""
        return self.add_positions(self.backbone(images))

    def add_positions(self, grid: torch.Tensor) -> torch.Tensor:
        """Backbone grid (B, L, D) → features (B, L, D) with the position codes added
        (cached grids come in here: learned positions keep training); a summary's rows
        after the L cells get none."""
        if self.positions is None:
            return grid
        if self.summary_rows:
            cells, summary = grid[:, : self.num_cells], grid[:, self.num_cells :]
            return torch.cat([cells + self.positions.to(grid.dtype), summary], dim=1)
        return grid + self.positions.to(grid.dtype)

    def windows(self, x: torch.Tensor) -> torch.Tensor:
        """Normalised images (B, 3, S, S) → each cell's window (B * T * T, 3, W, W), row by
        row: cell (r, c) covers rows r S / T to (r + 1) S / T of the image (the grid's own
        geometry, which the figures and the grounding use), and its window is the square of
        ``tile_size`` W px centred on the cell, zero (the mean colour) past the image's
        edge."""
        size, tiles, window = x.shape[-1], self.tiles, self.tile_size
        starts = [round((k + 0.5) * size / tiles - window / 2) for k in range(tiles)]
        margin = max(0, -starts[0], starts[-1] + window - size)
        padded = F.pad(x, (margin, margin, margin, margin))
        crops = [
            padded[
                :, :, top + margin : top + margin + window, left + margin : left + margin + window
            ]
            for top in starts
            for left in starts
        ]
        return torch.stack(crops, dim=1).flatten(0, 1)

    def backbone(self, images: torch.Tensor) -> torch.Tensor:
        """``images`` (B, 3, S, S) → the backbone's pooled grid (B, L, D), no positions."""
        photo = (images.float() - self.mean) / self.std
        x = self._stages(self.windows(photo) if self.tiles else photo)
        later = None if self.tiles else self._later(x)  # a tiled summary is the whole photo's
        if self.hypercolumn:  # the later stages' output at each cell's place
            up = F.interpolate(
                later.float(), size=x.shape[-2:], mode="bilinear", align_corners=False
            )
            x = torch.cat([x, up.to(x.dtype)], dim=1)
        grid = self.pool(x).flatten(2).transpose(1, 2)  # (B, L, D)
        if self.tiles:  # (B * L, 1, D): one vector per window
            grid = grid.reshape(photo.shape[0], self.num_cells, -1)
        if not self.summary_dim:
            return grid.contiguous()
        if self.tiles:  # what the whole photo shows, not the windows' mean
            later = self._later(self._stages(photo))
        summary = later.float().mean(dim=(2, 3)).to(grid.dtype)  # (B, S)
        padding = self.summary_rows * grid.shape[2] - self.summary_dim
        rows = F.pad(summary, (0, padding)).view(grid.shape[0], self.summary_rows, -1)
        return torch.cat([grid, rows], dim=1)  # (B, L + summary_rows, D)

    def _later(self, x: torch.Tensor) -> torch.Tensor | None:
        """The last stage's output → the later stages' (never trained), or None without
        them."""
        if self.summary_stages is None:
            return None
        with torch.no_grad() if self.frozen else contextlib.nullcontext():
            for stage in self.summary_stages:
                x = stage(x)
        return x

    def _stages(self, x: torch.Tensor) -> torch.Tensor:
        """Normalised images → the last stage's output, the frozen stages without a graph."""
        if self.channels_last:
            x = x.contiguous(memory_format=torch.channels_last)
        frozen = self.frozen_stages
        if frozen:
            with torch.no_grad():
                for stage in list(self.stages)[:frozen]:
                    x = stage(x)
        for stage in list(self.stages)[frozen:]:
            x = stage(x)
        return x


def split_summary(
    features: torch.Tensor, summary_rows: int, summary_dim: int
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """:meth:`Encoder.backbone`'s rows (B, L + R, D) → the grid cells (B, L, D) and the
    summary (B, S), or the features themselves and None when there are no summary rows."""
    if not summary_rows:
        return features, None
    cells = features[:, :-summary_rows]
    summary = features[:, -summary_rows:].flatten(1)[:, :summary_dim]
    return cells, summary


def _fold_in_sequence(sequence: nn.Sequential) -> int:
    """Replace each (Conv2d, BatchNorm2d) pair of consecutive children by the folded
    convolution and an identity; the number of pairs folded."""
    children = list(sequence.named_children())
    folded = 0
    for (name, conv), (norm_name, norm) in zip(children, children[1:]):
        if (
            isinstance(conv, nn.Conv2d)
            and type(norm) is nn.BatchNorm2d
            and norm.track_running_stats
            and norm.running_mean is not None
        ):
            fused = fuse_conv_bn_eval(conv, norm)
            fused.requires_grad_(False)
            setattr(sequence, name, fused)
            setattr(sequence, norm_name, nn.Identity())
            folded += 1
    return folded


def _set_output_stride(name: str, stages: list[nn.Module], output_stride: int) -> None:
    """Halve ``stages``' output stride once, when ``output_stride`` asks for half of it."""
    with torch.no_grad():
        probe = torch.zeros(1, 3, 64, 64)
        for stage in stages:
            stage.eval()
            probe = stage(probe)
    native = 64 // probe.shape[-1]
    if output_stride == native:
        return
    if output_stride != native // 2:
        raise ConfigError(
            f"model.output_stride={output_stride}: {name}'s grid has stride {native}; "
            f"set {native // 2} (a grid twice as fine) or leave it null"
        )
    halve_stride(stages)


def read_weights(path: str | Path, name: str | None = None) -> Any:
    """A weights file read as plain data only (``torch.load(weights_only=True)``): a file
    from a stranger cannot run code.

    Args:
        path: the file.
        name: what the error messages call it (default: the path).

    Raises:
        ConfigError: one line, when the file holds objects other than plain data or is not a
            file torch can read.
    """
    name = name or str(path)
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        raise ConfigError(
            f"{name}: refused to load: it holds objects other than plain data, which could "
            f"run code; save the model's state_dict() with torch.save"
        ) from exc
    except Exception as exc:
        reason = " ".join(str(exc).split())[:200] or type(exc).__name__
        raise ConfigError(f"{name}: not a readable weights file ({reason})") from exc


def _load_small_cnn_weights(cnn: SmallCNN, path: str) -> None:
    """``model.weights`` for the small CNN: a state dict saved with ``torch.save``, read as
    plain data only."""
    state = read_weights(path, f"model.weights={path}")
    try:
        cnn.load_state_dict(state)
    except (RuntimeError, TypeError, AttributeError) as exc:
        raise ConfigError(
            f"model.weights={path}: does not fit model.cnn_channels "
            f"({' '.join(str(exc).split())[:200]})"
        ) from exc


@dataclass
class Backbone:
    """What an encoder factory gives: the convolutional stages in order, the normalisation
    statistics of their weights, and the stages after them that a summary pools (the
    backbone's later stages, for ``model.summary``; empty when it has none)."""

    stages: list[nn.Module]
    mean: tuple[float, ...] = IMAGENET_MEAN
    std: tuple[float, ...] = IMAGENET_STD
    later: list[nn.Module] = field(default_factory=list)


BackboneFactory = Callable[[ModelConfig], Backbone]

# model.encoder's names and the factories of their backbones; any other name is looked up
# among torchvision's classifiers (vgg19, resnet101, mobilenet_v2, ...).
ENCODERS: dict[str, BackboneFactory] = {}


def register_encoder(name: str, factory: BackboneFactory) -> BackboneFactory:
    """Make ``factory`` the backbone ``model.encoder=name`` builds; a name already taken is
    an error (remove it from :data:`ENCODERS` first). docs/extending.md has an example."""
    if name in ENCODERS:
        raise ValueError(f"an encoder named {name!r} is already registered")
    ENCODERS[name] = factory
    return factory


def small_cnn_backbone(cfg: ModelConfig) -> Backbone:
    """``model.encoder=small_cnn``: the small CNN of ``model.cnn_channels``, trained from
    scratch or from ``model.weights``."""
    if cfg.drop_stages:
        raise ConfigError(
            "model.drop_stages is for a pretrained backbone; the small CNN's "
            "stages are model.cnn_channels"
        )
    if cfg.summary != "none":
        raise ConfigError(
            "model.summary pools a pretrained backbone's later stages; the "
            "small CNN has none to spare (set model.summary=none)"
        )
    weights = cfg.weights if cfg.weights and cfg.weights.lower() != "none" else None
    if weights and not Path(weights).is_file():
        raise ConfigError(f"model.weights file {weights} does not exist")
    cnn = SmallCNN(cfg.cnn_channels or [32, 64, 128, 128], block=cfg.cnn_block)
    if weights:
        _load_small_cnn_weights(cnn, weights)
    elif cfg.fine_tune != "all":
        logger.warning("model.fine_tune=%s freezes a randomly initialised CNN", cfg.fine_tune)
    return Backbone(list(cnn.stages), (0.5, 0.5, 0.5), (0.25, 0.25, 0.25))


register_encoder("small_cnn", small_cnn_backbone)


def torchvision_backbone(cfg: ModelConfig) -> Backbone:
    """A torchvision classifier by name (``vgg19``, ``resnet101``, ``mobilenet_v2``, ...)
    cut at its last convolutional stage, at ``model.output_stride``, less the
    ``model.drop_stages`` last stages (which a summary pools)."""
    model, mean, std = _load_torchvision(cfg.encoder, cfg.weights)
    stages = _cut_backbone(cfg.encoder, model)
    if cfg.output_stride is not None:
        _set_output_stride(cfg.encoder, stages, cfg.output_stride)
    kept = len(stages) - cfg.drop_stages
    if kept < 1:
        raise ConfigError(
            f"model.drop_stages={cfg.drop_stages} leaves nothing of {cfg.encoder}'s "
            f"{len(stages)} stages; drop at most {len(stages) - 1}"
        )
    return Backbone(stages[:kept], mean, std, stages[kept:])


def build_encoder(cfg: ModelConfig, runtime: RuntimeConfig | None = None) -> Encoder:
    """The :class:`Encoder` that ``cfg`` describes: the backbone ``model.encoder`` names (a
    registered one, see :data:`ENCODERS`, else a torchvision classifier), pooled to
    ``model.grid_size``, with ``model.positional`` codes and a summary where
    ``model.summary`` asks, frozen as ``model.fine_tune`` says; ``runtime.channels_last``
    runs its convolutions on NHWC tensors (see :class:`Encoder`)."""
    runtime = runtime or RuntimeConfig()
    backbone = ENCODERS.get(cfg.encoder, torchvision_backbone)(cfg)
    with torch.no_grad():
        probe = torch.zeros(1, 3, 64, 64)
        for stage in backbone.stages:
            stage.eval()
            probe = stage(probe)
    later = None
    if cfg.hypercolumn and not backbone.later:
        raise ConfigError(
            f"model.hypercolumn joins the stages model.drop_stages leaves out to the grid; "
            f"{cfg.encoder} has none left out: set model.drop_stages to 1 or more"
        )
    if cfg.summary != "none" or cfg.hypercolumn:
        later = backbone.later or [nn.Identity()]
    return Encoder(
        backbone.stages,
        int(probe.shape[1]),
        cfg.image_size,
        backbone.mean,
        backbone.std,
        cfg.grid_size,
        cfg.positional,
        cfg.fine_tune,
        runtime.channels_last,
        later,
        cfg.tiles,
        cfg.tile_size,
        summary=cfg.summary != "none",
        hypercolumn=cfg.hypercolumn,
    )
