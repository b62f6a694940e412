"""Uneven inputs: let ``torch.distributed.algorithms.Join`` drive a dpcourse wrapper.

When one rank runs out of batches before the others, the others still issue
the collectives of their next step, and would wait forever for the missing
rank. ``Join`` (torch's context manager for this) keeps the finished rank in
the game: after every step of the others it calls the wrapper's *join hook*,
which issues the very collectives the others issue in that step, but with
zeros (a **shadow all-reduce**). Zeros add nothing to the sum, so the others'
gradients are averaged over the ranks that still had data (divided by the
initial world size, or by the number still running with
``divide_by_initial_world_size=False``). When the last rank finishes, every
rank receives the final parameters from one of the last ranks to join.

The collectives must line up exactly, in this order per step
(torch's ``DistributedDataParallel._pre_forward`` and ``_DDPJoinHook``):

=====================================  =========================================
a rank with data (forward, backward)   a joined rank (``main_hook``)
=====================================  =========================================
all-reduce 1 ("I have not joined")     all-reduce 0 (issued by ``Join`` itself)
all-reduce MAX(rank) + buffer          all-reduce MAX(-1) + buffer broadcast
broadcast (only with buffers to sync)  (same condition)
all-reduce 1/0 ("I will sync grads")   all-reduce 0, read: shadow or not
one all-reduce per bucket              one all-reduce of zeros per bucket
=====================================  =========================================

Every wrapper is a ``Joinable``. A rank with data issues the left column (its
:class:`~dpcourse.ddp.reducer.Reducer`'s ``pre_forward``, then the wrapper's
buckets); :class:`WrapperJoinHook` issues the right one (``Reducer.shadow_reduce``).

Reference: ``torch/distributed/algorithms/join.py`` and
``torch/nn/parallel/distributed.py`` (``_DDPJoinHook``).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.algorithms.join import Join, Joinable, JoinHook

from dpcourse.ddp.broadcast import group_src

# Join, Joinable and JoinHook are torch's, re-exported for the exercises.
__all__ = ["Join", "Joinable", "JoinHook", "WrapperJoinHook", "find_common_rank"]


def find_common_rank(group, device, candidate: bool) -> int:
    """Agree on the highest group rank among those that pass ``candidate=True``.

    Args:
        group: process group (``None``: the default group).
        device: device of the one-element tensor (NCCL needs a GPU tensor).
        candidate: whether this rank may be chosen.

    Returns:
        The chosen group rank, the same on every rank.
    """
    mine = dist.get_rank(group) if candidate else -1
    t = torch.tensor([mine], device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    rank = int(t.item())
    if rank < 0:
        raise RuntimeError("no rank could be chosen as the source of the shared state: "
                           "every rank has joined. This is a bug in the join protocol.")
    return rank


class WrapperJoinHook(JoinHook):
    """Shadow a dpcourse wrapper's collectives on a rank that ran out of data.

    Args:
        reducer: the wrapper's :class:`~dpcourse.ddp.reducer.Reducer`.
        divide_by_initial_world_size: keyword of ``Join``, default True: divide the
            summed gradient by the world size (joined ranks counted as zeros) rather
            than by the number of ranks still with data.
    """

    def __init__(self, reducer, divide_by_initial_world_size: bool):
        self.reducer = reducer
        reducer.divide_by_initial_world_size = divide_by_initial_world_size

    @torch.no_grad()
    def main_hook(self) -> None:
        """Issue the collectives of one step of the others: buffers, sync flag, zero buckets."""
        r = self.reducer
        w = r._wrapper
        if r.broadcast_buffers_next and r.broadcast_buffers and list(w.module.buffers()):
            src = group_src(r.group, find_common_rank(r.group, r.device, False))
            for b in w.module.buffers():
                dist.broadcast(b, src=src, group=r.group)
        flag = torch.zeros(1, device=r.device)
        dist.all_reduce(flag, group=r.group)
        should_sync = bool(flag.item() != 0)
        r.broadcast_buffers_next = should_sync
        if should_sync:
            r.shadow_reduce()

    @torch.no_grad()
    def post_hook(self, is_last_joiner: bool) -> None:
        """Copy parameters and buffers from one of the last ranks to join, so all ranks agree."""
        r = self.reducer
        w = r._wrapper
        src = group_src(r.group, find_common_rank(r.group, r.device, is_last_joiner))
        for t in list(w.module.parameters()) + list(w.module.buffers()):
            dist.broadcast(t.detach(), src=src, group=r.group)
