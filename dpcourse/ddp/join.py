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

Reference: ``torch/distributed/algorithms/join.py`` and
``torch/nn/parallel/distributed.py`` (``_DDPJoinHook``).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.join import Join, Joinable, JoinHook, _JoinConfig

from dpcourse.ddp.broadcast import group_src


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


class JoinableWrapper(Joinable):
    """What a dpcourse wrapper adds to be driven by ``torch.distributed.algorithms.Join``.

    The wrapper calls :meth:`_init_join` in its constructor and
    :meth:`_join_pre_forward` at the start of each forward, and provides
    ``module``, ``group``, ``world_size``, ``broadcast_buffers``,
    ``_broadcast_buffers_next``, ``require_backward_grad_sync`` and
    ``_shadow_reduce()`` (the zero all-reduces of one synchronised backward,
    issued exactly as the real ones would be).
    """

    # Provided by the wrapper (DataParallelBase).
    module: nn.Module
    group: Any
    world_size: int
    require_backward_grad_sync: bool
    broadcast_buffers: bool
    _broadcast_buffers_next: bool
    _named_params: list[tuple[str, nn.Parameter]]

    def __init__(self):  # Joinable's abstract constructor; wrappers call _init_join instead
        super().__init__()

    def _init_join(self) -> None:
        # Join overwrites this config for the duration of its context.
        self._join_config = _JoinConfig.construct_disabled_join_config()
        self._divide_by_initial_world_size = True
        self._join_work = None  # the "I have not joined" all-reduce of this step
        self._join_divisor = None

    # -- Joinable interface --------------------------------------------------
    def join_hook(self, **kwargs) -> JoinHook:
        """Return the hook ``Join`` calls for this wrapper once this rank has run out of data.

        Args:
            divide_by_initial_world_size: keyword, default True: divide the summed
                gradient by the world size (joined ranks counted as zeros) rather
                than by the number of ranks still with data.
        """
        divide = kwargs.get("divide_by_initial_world_size", True)
        return WrapperJoinHook(self, divide)

    @property
    def join_device(self) -> torch.device:
        """Device of the wrapper's gradients (where the join collectives' tensors live)."""
        return self._named_params[0][1].device

    @property
    def join_process_group(self):
        """The group the wrapper averages over."""
        return self.group if self.group is not None else dist.group.WORLD

    # -- the rank that still has data -----------------------------------------
    def _join_pre_forward(self) -> None:
        """Tell joined ranks this rank has not joined yet (no-op outside ``Join``)."""
        self._join_work = Join.notify_join_context(self)
        self._join_divisor = None

    def _buffer_src(self) -> int:
        """Global rank whose buffers every rank copies before this forward."""
        if self._join_config.enable:  # rank 0 may have joined with stale buffers
            return group_src(self.group, find_common_rank(self.group, self.join_device, True))
        return group_src(self.group, 0)

    def _join_announce_sync(self) -> None:
        """Tell joined ranks whether this step's backward will all-reduce gradients."""
        if self._join_config.enable:
            flag = torch.tensor([1.0 if self.require_backward_grad_sync else 0.0],
                                device=self.join_device)
            dist.all_reduce(flag, group=self.group)

    def _gradient_divisor(self) -> int:
        """What the summed gradients are divided by: the world size, or the ranks with data."""
        if self._join_work is not None and not self._divide_by_initial_world_size:
            work, self._join_work = self._join_work, None
            # Its result: how many ranks announced that they still have data.
            self._join_divisor = int(work.get_future().wait()[0].item())
        return self._join_divisor or self.world_size


class WrapperJoinHook(JoinHook):
    """Shadow a dpcourse wrapper's collectives on a rank that ran out of data.

    Args:
        wrapper: the :class:`JoinableWrapper` (a dpcourse data-parallel wrapper).
        divide_by_initial_world_size: see :meth:`JoinableWrapper.join_hook`.
    """

    def __init__(self, wrapper, divide_by_initial_world_size: bool):
        self.wrapper = wrapper
        wrapper._divide_by_initial_world_size = divide_by_initial_world_size

    @torch.no_grad()
    def main_hook(self) -> None:
        """Issue the collectives of one step of the others: buffers, sync flag, zero buckets."""
        w = self.wrapper
        if w._broadcast_buffers_next and w.broadcast_buffers and list(w.module.buffers()):
            src = group_src(w.group, find_common_rank(w.group, w.join_device, False))
            for b in w.module.buffers():
                dist.broadcast(b, src=src, group=w.group)
        flag = torch.zeros(1, device=w.join_device)
        dist.all_reduce(flag, group=w.group)
        should_sync = bool(flag.item() != 0)
        w._broadcast_buffers_next = should_sync
        if should_sync:
            w._shadow_reduce()

    @torch.no_grad()
    def post_hook(self, is_last_joiner: bool) -> None:
        """Copy parameters and buffers from one of the last ranks to join, so all ranks agree."""
        w = self.wrapper
        src = group_src(w.group, find_common_rank(w.group, w.join_device, is_last_joiner))
        for t in list(w.module.parameters()) + list(w.module.buffers()):
            dist.broadcast(t.detach(), src=src, group=w.group)
