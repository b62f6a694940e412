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
:class:`~dpcourse.ddp.reducer.Reducer`'s ``pre_forward``, with the collectives of
:mod:`dpcourse.ddp.pre_forward`, then the wrapper's buckets, each divided by
:class:`JoinDivisor`'s answer); :class:`WrapperJoinHook` issues the right one.

Reference: ``torch/distributed/algorithms/join.py`` and
``torch/nn/parallel/distributed.py`` (``_DDPJoinHook``).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.algorithms.join import Join, Joinable, JoinHook

from dpcourse.ddp.broadcast import group_src
from dpcourse.ddp.buckets import Bucket, views_into
from dpcourse.ddp.pre_forward import all_reduce_sync_flag, sync_buffers

# Join, Joinable and JoinHook are torch's, re-exported for the exercises.
__all__ = ["Join", "Joinable", "JoinHook", "JoinDivisor", "WrapperJoinHook", "find_common_rank"]


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


class JoinDivisor:
    """What a rank with data divides its summed gradients by: the world size, or the ranks with data.

    Before each forward, :meth:`notify` issues ``Join``'s "I have not joined"
    all-reduce (nothing outside ``Join``); its sum is the number of ranks that
    still have data. By default (``Join(..., divide_by_initial_world_size=True)``)
    the gradients are still divided by the world size, the joined ranks counting
    as zeros, and that all-reduce is never waited for.

    Args:
        world_size: number of ranks in the wrapper's group.

    Attributes:
        divide_by_initial_world_size: ``Join``'s keyword, set by :class:`WrapperJoinHook`.
    """

    def __init__(self, world_size: int):
        self.world_size = world_size
        self.divide_by_initial_world_size = True
        self._work: Any = None     # this step's "I have not joined" all-reduce
        self._ranks_with_data: int | None = None

    def notify(self, joinable: Joinable) -> None:
        """Before a forward: tell the joined ranks that this rank still trains (no-op outside ``Join``)."""
        self._work = Join.notify_join_context(joinable)
        self._ranks_with_data = None

    def __call__(self) -> int:
        """The divisor of this step (waits for the notification's sum the first time it is needed)."""
        if self._work is not None and not self.divide_by_initial_world_size:
            work, self._work = self._work, None
            # Its result: how many ranks announced that they still have data.
            self._ranks_with_data = int(work.get_future().wait()[0].item())
        return self._ranks_with_data or self.world_size


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
        reducer.join_divisor.divide_by_initial_world_size = divide_by_initial_world_size

    @torch.no_grad()
    def main_hook(self) -> None:
        """Issue the collectives of one step of the others: buffers, sync flag, zero buckets."""
        r = self.reducer
        if r.buffers_due():   # the source: a rank still training, never this one
            sync_buffers(r._wrapper.module, find_common_rank(r.group, r.device, False), r.group)
        should_sync = bool(all_reduce_sync_flag(False, r.device, r.group).item() != 0)
        r.broadcast_buffers_next = should_sync
        if should_sync:
            self.shadow_reduce()

    @torch.no_grad()
    def shadow_reduce(self) -> None:
        """Issue the gradient collectives of one synchronised backward, on zeros."""
        r = self.reducer
        hook = r.reduce_hook()   # a communication hook reduces the zeros as it would gradients
        works = []
        for bucket in _buckets_of(r):
            zeros = torch.zeros_like(bucket.buffer)
            if hook is None:
                works.append(r.all_reduce(zeros, async_op=True))
            else:
                works.append(hook(replace(bucket, buffer=zeros,
                                          views=views_into(zeros, bucket.params))))
        for work in works:
            if work is not None:
                work.wait()

    @torch.no_grad()
    def post_hook(self, is_last_joiner: bool) -> None:
        """Copy parameters and buffers from one of the last ranks to join, so all ranks agree."""
        r = self.reducer
        w = r._wrapper
        src = group_src(r.group, find_common_rank(r.group, r.device, is_last_joiner))
        for t in list(w.module.parameters()) + list(w.module.buffers()):
            dist.broadcast(t.detach(), src=src, group=r.group)


def _buckets_of(reducer) -> list[Bucket]:
    """The buckets a rank with data reduces: the wrapper's, or one per parameter (``DataParallelNaive``)."""
    buckets = getattr(reducer._wrapper, "buckets", None)
    if buckets is not None:
        return buckets
    params = [p for _, p in reducer.named_params]
    flat = [torch.zeros(p.numel(), dtype=p.dtype, device=p.device) for p in params]
    return [Bucket(i, [i], [""], [p], f, [f.view(p.shape)])
            for i, (p, f) in enumerate(zip(params, flat))]
