"""Data-parallel training with PyTorch's own engine, launched by ``torchrun``.

``torchrun --nproc_per_node=N -m captioning train --config C`` starts N processes that each
see ``RANK``, ``LOCAL_RANK`` and ``WORLD_SIZE`` in their environment. Each process trains
on its slice of every global batch (see :class:`captioning.data.CaptionBatchSampler`),
DistributedDataParallel averages the gradients, and rank 0 alone writes logs, figures and
checkpoints. Without those variables everything here is a no-op for one process.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from captioning.errors import CaptioningError
from captioning.runtime import resolve_device


@dataclass(frozen=True)
class World:
    """This process's place among the training processes."""

    rank: int = 0
    local_rank: int = 0
    size: int = 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def enabled(self) -> bool:
        return self.size > 1


SINGLE = World()  # one process, no process group


def launched_by_torchrun() -> bool:
    return int(os.environ.get("WORLD_SIZE", "1")) > 1


def init_world(device_name: str) -> tuple[World, torch.device]:
    """Join the process group when launched by torchrun; pick this process's device.

    CUDA processes use NCCL and the GPU ``cuda:LOCAL_RANK``; CPU processes use gloo.
    """
    if not launched_by_torchrun():
        return SINGLE, resolve_device(device_name)
    world = World(
        rank=int(os.environ["RANK"]),
        local_rank=int(os.environ.get("LOCAL_RANK", "0")),
        size=int(os.environ["WORLD_SIZE"]),
    )
    device = resolve_device(device_name)
    if device.type == "cuda":
        if world.local_rank >= torch.cuda.device_count():
            raise CaptioningError(
                f"local rank {world.local_rank} has no GPU ({torch.cuda.device_count()} "
                f"visible); use --nproc_per_node at most the number of GPUs"
            )
        device = torch.device("cuda", world.local_rank)
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        dist.init_process_group(backend="nccl" if device.type == "cuda" else "gloo")
    return world, device


def close_world(world: World) -> None:
    if world.enabled and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def gather_objects(world: World, obj: Any) -> list[Any]:
    """Every rank's ``obj``, in rank order (one process: ``[obj]``)."""
    if not world.enabled:
        return [obj]
    gathered: list[Any] = [None] * world.size
    dist.all_gather_object(gathered, obj)
    return gathered


def broadcast_object(world: World, obj: Any) -> Any:
    """Rank 0's ``obj`` on every rank."""
    if not world.enabled:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def mean_over_ranks(world: World, values: dict[str, float], device: torch.device) -> dict:
    """The mean of each value over the ranks (for logging)."""
    if not world.enabled or not values:
        return values
    keys = sorted(values)
    tensor = torch.tensor([values[k] for k in keys], dtype=torch.float64, device=device)
    dist.all_reduce(tensor)
    return {k: float(v) / world.size for k, v in zip(keys, tensor.tolist())}


def any_rank(world: World, flag: bool, device: torch.device) -> bool:
    """True when ``flag`` is true on at least one rank (all ranks must call this)."""
    if not world.enabled:
        return flag
    tensor = torch.tensor([1.0 if flag else 0.0], device=device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return bool(tensor.item() > 0)


def sum_over_ranks(world: World, values: list[float], device: torch.device) -> list[float]:
    """The sum of each value over the ranks (all ranks must call this)."""
    if not world.enabled:
        return list(values)
    tensor = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(tensor)
    return tensor.tolist()
