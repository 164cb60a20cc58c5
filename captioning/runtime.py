"""Where and how code runs: device choice, seeding and mixed precision.

Every layer may import this module; it imports nothing from the rest of the package but its
errors.
"""

from __future__ import annotations

import contextlib
import random

import numpy as np
import torch

from captioning.errors import CaptioningError


def resolve_device(name: str) -> torch.device:
    """``auto`` picks CUDA when present, else CPU; any other name is used as given."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError as exc:
        raise CaptioningError(f"unknown device {name!r}; use auto, cpu, cuda or cuda:N") from exc
    if device.type == "cuda" and not torch.cuda.is_available():
        raise CaptioningError(f"device {name} asked for but CUDA is not available; use cpu or auto")
    return device


def seed_everything(seed: int) -> None:
    """Seed Python's, NumPy's and torch's global generators."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def autocast(device: torch.device, precision: str) -> contextlib.AbstractContextManager:
    """Mixed precision (``bf16`` or ``fp16``) for a forward pass; ``fp32`` is a no-op."""
    if precision == "fp32":
        return contextlib.nullcontext()
    dtype = torch.bfloat16 if precision == "bf16" else torch.float16
    return torch.autocast(device_type=device.type, dtype=dtype)
