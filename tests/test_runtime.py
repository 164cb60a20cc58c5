"""Device, precision and seeding helpers."""

import pytest
import torch
import yaml

import captioning.runtime as runtime
from captioning.checkpoint import load_checkpoint
from captioning.errors import CaptioningError
from captioning.runtime import autocast, native_bf16, resolve_device, resolve_precision
from captioning.training.train import fit

from .test_train import tiny

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def shapes(tmp_path_factory):
    from captioning.data.shapes import generate_shapes

    root = tmp_path_factory.mktemp("shapes")
    generate_shapes(root, num_train=24, num_val=6, num_test=6, seed=0, image_size=48)
    return root


@pytest.mark.parametrize(
    ("flags", "native"),
    [({"avx2", "avx512f"}, False), ({"avx512f", "avx512_bf16"}, True), ({"amx_bf16"}, True)],
)
def test_auto_precision_is_bf16_only_where_the_cpu_has_it(monkeypatch, flags, native):
    monkeypatch.setattr(runtime, "cpu_flags", lambda: flags)
    assert native_bf16(CPU) is native
    assert resolve_precision("auto", CPU) == ("bf16" if native else "fp32")
    assert resolve_precision("fp16", CPU) == "fp16"  # an explicit choice is kept
    with autocast(CPU, "auto"):
        product = torch.ones(2, 2) @ torch.ones(2, 2)
    assert product.dtype == (torch.bfloat16 if native else torch.float32)


@pytest.mark.parametrize("native", [False, True])
def test_training_records_the_precision_auto_chose(shapes, tmp_path, monkeypatch, native):
    monkeypatch.setattr(runtime, "cpu_flags", lambda: {"avx512_bf16"} if native else set())
    fit(tiny(shapes, "train.precision=auto", "train.epochs=1"), out_dir=tmp_path / "run")
    expected = "bf16" if native else "fp32"
    saved = yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())
    assert saved["train"]["precision"] == saved["runtime"]["precision"] == expected
    config = load_checkpoint(tmp_path / "run" / "last.pt")["config"]
    assert config["train"]["precision"] == config["runtime"]["precision"] == expected


def test_resolve_device_errors_are_one_line():
    assert resolve_device("cpu") == CPU
    with pytest.raises(CaptioningError, match="unknown device 'gpu0'"):
        resolve_device("gpu0")
    for name in ("tpu9", "meta", "xla", "cpu:x"):  # torch knows some of them; we run on none
        with pytest.raises(CaptioningError, match=f"unknown device '{name}'; use auto, cpu"):
            resolve_device(name)
    if not torch.cuda.is_available():
        with pytest.raises(CaptioningError, match="CUDA is not available"):
            resolve_device("cuda:7")


def test_in_passing_thread_returns_and_raises_on_the_caller():
    import threading

    from captioning.runtime import in_passing_thread

    caller = threading.get_ident()
    ran_on = in_passing_thread(threading.get_ident)
    assert ran_on != caller
    assert in_passing_thread(lambda a, b=0: a + b, 2, b=3) == 5
    with pytest.raises(ValueError, match="bad"):
        in_passing_thread(int, "bad")
