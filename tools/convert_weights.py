"""Backbone weights saved in another key layout -> a plain state dict in torchvision's, which
``model.weights: FILE`` then loads (with ``model.encoder`` the same architecture).

    python -m tools.convert_weights SRC DST --arch mobilenet_v2 [--force]

SRC is read as plain data only (``torch.load(weights_only=True)``): a state dict, or a dict
holding one under ``state_dict`` or ``model`` (keys may carry DataParallel's ``module.``). Every
key must find its place in torchvision's model of that architecture, with the same shape, and
every tensor of that model but its classifier must be given; the first that does not is named
in a one-line error. A SRC already in torchvision's layout is written unchanged. DST is written
atomically and never replaced without ``--force``; the key count and DST's sha256 are printed.

Each architecture is one entry of ``RENAMES``: a function from SRC's keys to their torchvision
names. ``mobilenet_v2`` reads the older layout of MobileNetV2 code written before torchvision's
``ConvBNReLU`` blocks, where an inverted residual block is one flat ``nn.Sequential``:

    expansion 1 (features.1)   conv.0 dw-conv, conv.1 BN, (2 ReLU6), conv.3 pw-conv, conv.4 BN
    the other blocks           conv.0 pw-conv, conv.1 BN, (2 ReLU6), conv.3 dw-conv, conv.4 BN,
                               (5 ReLU6), conv.6 pw-linear conv, conv.7 BN

torchvision nests the conv-BN-ReLU6 pairs: ``conv.0.0/conv.0.1`` (and ``conv.1.0/conv.1.1``),
then the linear conv and its BN (``conv.2``, ``conv.3``; in features.1 ``conv.1``, ``conv.2``).
The stem (features.0) and the last 1x1 conv (features.18) are the same in both.
"""

from __future__ import annotations

import argparse
import hashlib
import re
import sys
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import torch
import torchvision

from captioning import checkpoint
from captioning.errors import ConfigError
from captioning.models.encoder import read_weights

# Heads that a backbone file may leave out: the encoder cuts them off anyway.
CLASSIFIER_PREFIXES = ("classifier.", "fc.")
# BatchNorm fills in a missing counter itself (and it is only used with momentum=None).
OPTIONAL_SUFFIXES = (".num_batches_tracked",)


class ConversionError(Exception):
    """SRC cannot become a state dict of the architecture (the message is one line)."""


# --------------------------------------------------------------------------- mobilenet_v2

_MOBILENET_BLOCK = re.compile(r"^(features\.\d+)\.conv\.(\d+)\.(.+)$")
# index in the old flat block -> torchvision's name, by the indices the block has
_MOBILENET_EXPANDED = {
    0: "conv.0.0",
    1: "conv.0.1",
    3: "conv.1.0",
    4: "conv.1.1",
    6: "conv.2",
    7: "conv.3",
}
_MOBILENET_EXPANSION_ONE = {0: "conv.0.0", 1: "conv.0.1", 3: "conv.1", 4: "conv.2"}


def rename_mobilenet_v2(keys: Sequence[str]) -> dict[str, str]:
    """torchvision's name of every key of an old-layout MobileNetV2 (see the module's doc).

    Args:
        keys: the source state dict's keys.

    Raises:
        ConversionError: a block whose layer indices are neither layout's.
    """
    indices: dict[str, set[int]] = defaultdict(set)
    for key in keys:
        if match := _MOBILENET_BLOCK.match(key):
            indices[match[1]].add(int(match[2]))
    names = {}
    for key in keys:
        match = _MOBILENET_BLOCK.match(key)
        if match is None:  # the stem, the last conv and the classifier keep their names
            names[key] = key
            continue
        block = match[1]
        table = {
            frozenset(_MOBILENET_EXPANDED): _MOBILENET_EXPANDED,
            frozenset(_MOBILENET_EXPANSION_ONE): _MOBILENET_EXPANSION_ONE,
        }.get(frozenset(indices[block]))
        if table is None:
            found = " ".join(f"conv.{i}" for i in sorted(indices[block]))
            raise ConversionError(
                f"block {block} has layers {found}: the old MobileNetV2 layout has conv.0 1 3 4 "
                f"(features.1) or conv.0 1 3 4 6 7"
            )
        names[key] = f"{block}.{table[int(match[2])]}.{match[3]}"
    return names


RENAMES: dict[str, Callable[[Sequence[str]], dict[str, str]]] = {
    "mobilenet_v2": rename_mobilenet_v2,
}


# --------------------------------------------------------------------------- conversion


def reference_shapes(arch: str) -> dict[str, torch.Size]:
    """The shape of every tensor of torchvision's ``arch``, untrained (nothing downloads)."""
    with torch.device("meta"):  # shapes only: no memory, no initialisation time
        model = torchvision.models.get_model(arch, weights=None)
    return {key: value.shape for key, value in model.state_dict().items()}


def first_misfit(
    state_dict: Mapping[str, torch.Tensor], reference: Mapping[str, torch.Size]
) -> tuple[str, str] | None:
    """What stops ``state_dict`` from loading into the model of ``reference``: its first key
    without a place, its first shape that differs, or the first tensor it lacks (the
    classifier's may be absent), as (key, what is wrong); None when it fits."""
    for key, value in state_dict.items():
        if key not in reference:
            return key, "has no place in it"
        if tuple(value.shape) != tuple(reference[key]):
            return key, f"has shape {tuple(value.shape)}, torchvision's {tuple(reference[key])}"
    for key in reference:
        if key not in state_dict and not key.startswith(CLASSIFIER_PREFIXES):
            if not key.endswith(OPTIONAL_SUFFIXES):
                return key, "is missing"
    return None


def is_torchvision_layout(state_dict: Mapping[str, torch.Tensor], arch: str) -> bool:
    """Whether ``state_dict`` already loads into torchvision's ``arch`` as it is."""
    return first_misfit(state_dict, reference_shapes(arch)) is None


def convert(state_dict: Mapping[str, torch.Tensor], arch: str) -> dict[str, torch.Tensor]:
    """``state_dict`` in torchvision's key layout for ``arch``; unchanged when it already is.

    Args:
        state_dict: tensors by name, in the layout that ``RENAMES[arch]`` reads or in
            torchvision's.
        arch: a key of :data:`RENAMES` (a torchvision model name).

    Raises:
        ConversionError: an unknown ``arch``, or a key or shape that does not fit (named).
    """
    if arch not in RENAMES:
        raise ConversionError(f"unknown --arch {arch!r}; known: {', '.join(sorted(RENAMES))}")
    reference = reference_shapes(arch)
    misfit = first_misfit(state_dict, reference)
    if misfit is None:
        return dict(state_dict)
    if all(key in reference for key in state_dict):  # torchvision's names, not its shapes
        key, problem = misfit
        raise ConversionError(f"does not fit torchvision's {arch}: {key} {problem}")
    names = RENAMES[arch](list(state_dict))
    converted: dict[str, torch.Tensor] = {}
    for old, new in names.items():
        if new in converted:
            raise ConversionError(f"{old} and another key both become {new}")
        converted[new] = state_dict[old]
    misfit = first_misfit(converted, reference)
    if misfit is not None:
        key, problem = misfit
        source = {new: old for old, new in names.items()}.get(key, key)
        origin = f" (renamed from {source})" if source != key else ""
        raise ConversionError(f"does not fit torchvision's {arch}: {key}{origin} {problem}")
    return converted


def load_state_dict(path: Path) -> dict[str, torch.Tensor]:
    """The tensors of a weights file: a state dict, or one under ``state_dict`` or ``model``;
    DataParallel's ``module.`` prefix removed."""
    if not path.is_file():
        raise ConversionError(
            f"{path} does not exist" if not path.exists() else f"{path} is not a file"
        )
    try:
        data = read_weights(path)
    except ConfigError as exc:
        raise ConversionError(str(exc)) from exc
    for wrapper in ("state_dict", "model"):
        if isinstance(data, dict) and isinstance(data.get(wrapper), dict):
            data = data[wrapper]
            break
    if not isinstance(data, dict) or not data:
        raise ConversionError(f"{path}: not a state dict (a dict of tensors by name)")
    for key, value in data.items():
        if not isinstance(key, str) or not isinstance(value, torch.Tensor):
            raise ConversionError(f"{path}: not a state dict: {key!r} is not a named tensor")
    if all(key.startswith("module.") for key in data):
        data = {key.removeprefix("module."): value for key, value in data.items()}
    return data


def save_atomically(state_dict: dict[str, torch.Tensor], path: Path) -> str:
    """Write ``state_dict`` to ``path`` as :func:`captioning.checkpoint.save_atomically` does
    (a crash leaves no half-written file); returns the file's sha256."""
    checkpoint.save_atomically(state_dict, path)
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tools.convert_weights", description=__doc__.splitlines()[0]
    )
    parser.add_argument("src", type=Path, help="the weights file to convert")
    parser.add_argument("dst", type=Path, help="the torchvision-layout file to write")
    parser.add_argument("--arch", required=True, help=f"one of: {', '.join(sorted(RENAMES))}")
    parser.add_argument("--force", action="store_true", help="replace DST if it exists")
    args = parser.parse_args(argv)
    try:
        if args.arch not in RENAMES:
            raise ConversionError(
                f"unknown --arch {args.arch!r}; known: {', '.join(sorted(RENAMES))}"
            )
        if args.dst.exists() and not args.force:
            raise ConversionError(f"{args.dst} exists; pass --force to replace it")
        if args.dst.resolve() == args.src.resolve():
            raise ConversionError("SRC and DST are the same file; write DST elsewhere")
        state_dict = load_state_dict(args.src)
        unchanged = is_torchvision_layout(state_dict, args.arch)
        try:
            converted = convert(state_dict, args.arch)
        except ConversionError as exc:
            raise ConversionError(f"{args.src}: {exc}") from exc
        digest = save_atomically(converted, args.dst)
    except ConversionError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if unchanged:
        print(f"{args.src} is already in torchvision's {args.arch} layout: written unchanged")
    print(
        f"wrote {args.dst}: {len(converted)} tensors in torchvision's {args.arch} layout, "
        f"sha256 {digest}"
    )
    print(f"use it with: model.encoder: {args.arch}, model.weights: {args.dst}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
