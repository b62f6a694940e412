"""This rank's device, and waiting for it before reading a clock.

Lessons and benchmarks run the same function on gloo (CPU tensors) and on
NCCL (each rank owns ``cuda:local_rank``); these helpers keep that choice in
one place.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist


def visible_gpus() -> int:
    """Return how many CUDA GPUs this process can use (0 without CUDA)."""
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def rank_device(group=None) -> torch.device:
    """Return the device this rank's tensors should live on.

    Args:
        group: process group whose backend decides (None: the default group).

    Returns:
        ``cuda:<local rank>`` when the backend is NCCL, else ``cpu`` (also when no
        process group is initialised).
    """
    if dist.is_available() and dist.is_initialized() and dist.get_backend(group) == "nccl":
        local_rank = int(os.environ.get("LOCAL_RANK", dist.get_rank()))
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def synchronize(device: torch.device | str | None = None) -> None:
    """Wait for queued GPU work on ``device`` (no-op on CPU) so a clock reading means something.

    Args:
        device: the device to wait for (None: ``rank_device()``).
    """
    device = torch.device(device) if device is not None else rank_device()
    if device.type == "cuda":
        torch.cuda.synchronize(device)

