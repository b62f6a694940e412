"""Start every replica equal: rank 0's parameters and buffers, broadcast to the group.

Data parallelism is exact only if every rank starts from the same weights (and
then takes the same steps). Seeding every rank alike is not enough: a model
built on another device, or a buffer that differs, breaks it silently. So
every wrapper overwrites its replica with rank 0's copy at construction, as
torch DDP does (``_sync_module_states``).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn


def group_src(group: dist.ProcessGroup | None, group_rank: int = 0) -> int:
    """Global rank of ``group_rank`` in ``group`` (``broadcast`` takes a global ``src``)."""
    return group_rank if group is None else dist.get_global_rank(group, group_rank)


@torch.no_grad()
def broadcast_module_state(module: nn.Module, group: dist.ProcessGroup | None = None) -> None:
    """Overwrite every parameter and buffer with rank 0's copy, so all replicas start equal.

    Args:
        module: the model; frozen parameters and buffers are included.
        group: process group (``None``: the default group).
    """
    src = group_src(group)
    for t in list(module.parameters()) + list(module.buffers()):
        dist.broadcast(t.detach(), src=src, group=group)
