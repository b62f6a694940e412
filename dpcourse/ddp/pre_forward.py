"""Before each forward: the collectives torch DDP issues ahead of the module (lesson 10).

torch's ``DistributedDataParallel._pre_forward`` may talk to the other ranks
three times before it runs the module, and every rank must issue the same
collectives in the same order (the table in :mod:`dpcourse.ddp.join`):

1. under ``Join``: all-reduce a 1, "I have not joined" (``Join.notify_join_context``,
   kept by :class:`~dpcourse.ddp.join.JoinDivisor`);
2. with ``broadcast_buffers`` (torch's default) and a model with buffers:
   :func:`sync_buffers`, one rank's buffers to every rank, so that BatchNorm's
   running statistics do not drift apart. The source is rank 0, or under
   ``Join`` the highest rank still training (a joined rank's buffers are stale);
3. under ``Join``: :func:`all_reduce_sync_flag`, whether this forward's backward
   reduces gradients, so that a joined rank knows whether to shadow the buckets.

:meth:`Reducer.pre_forward <dpcourse.ddp.reducer.Reducer.pre_forward>` issues
them on a rank with data; a joined rank issues the same ones from
:meth:`WrapperJoinHook.main_hook <dpcourse.ddp.join.WrapperJoinHook.main_hook>`.

Reference: ``torch/nn/parallel/distributed.py`` (``_pre_forward``, ``_sync_buffers``,
``_check_global_requires_backward_grad_sync``).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from dpcourse.ddp.broadcast import group_src

__all__ = ["sync_buffers", "all_reduce_sync_flag"]


@torch.no_grad()
def sync_buffers(module: nn.Module, src: int, group: dist.ProcessGroup | None) -> None:
    """Overwrite every rank's buffers of ``module`` with group rank ``src``'s, one broadcast each.

    Args:
        module: the wrapped model (its buffers, e.g. BatchNorm's running statistics,
            change in place).
        src: group rank whose buffers every rank receives.
        group: process group (``None``: the default group).
    """
    global_src = group_src(group, src)  # broadcast takes a global rank
    for b in module.buffers():
        dist.broadcast(b, src=global_src, group=group)


def all_reduce_sync_flag(syncs: bool, device: torch.device,
                         group: dist.ProcessGroup | None) -> torch.Tensor:
    """All-reduce whether this rank's next backward reduces gradients; return the summed flag.

    Args:
        syncs: this rank's answer (False inside ``no_sync()``; always False on a
            joined rank, which reads the sum instead).
        device: device of the one-element flag (NCCL needs a GPU tensor).
        group: process group (``None``: the default group).

    Returns:
        A one-element float tensor: how many ranks said yes (not zero: the ranks
        still training reduce this step, and a joined rank must shadow them).
    """
    flag = torch.tensor([1.0 if syncs else 0.0], device=device)
    dist.all_reduce(flag, group=group)
    return flag
