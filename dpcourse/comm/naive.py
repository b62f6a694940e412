"""The simplest collectives: everything through one root, and one all-reduce per tensor."""

from __future__ import annotations

import torch
import torch.distributed as dist

from dpcourse.comm.averaging import divide_before_sum
from dpcourse.comm.collective import AllReduce
from dpcourse.comm.p2p import (CompletedWork, check_reduce_args, flat_view, global_rank,
                               group_rank_and_size, recv, send)


@torch.no_grad()  # like dist.all_reduce, works on tensors that require grad
def naive_all_reduce(tensor: torch.Tensor, group: dist.ProcessGroup | None = None, *,
                     op=dist.ReduceOp.SUM, async_op: bool = False) -> CompletedWork | None:
    """Sum ``tensor`` over all ranks in place by gathering it on one root and sending the sum back.

    Rank 0 of ``group`` receives every other rank's tensor in turn, adds it to
    its own, then sends the total to every rank. It is written with single
    messages (``dist.isend`` / ``dist.irecv``, each waited at once: the blocking
    :func:`~dpcourse.comm.p2p.send` / :func:`~dpcourse.comm.p2p.recv`) rather than ``dist.gather`` + ``dist.broadcast``,
    so that the traffic is visible message by message (in ``CommTrace``): the
    root receives ``(N - 1)`` full tensors and sends ``(N - 1)`` full tensors,
    so its link carries ``2 (N - 1)`` times the size while the other links idle.
    Its time therefore grows linearly with the number of ranks, unlike the
    ring's. The sum is accumulated in the tensor's dtype, in rank order.

    Args:
        tensor: any shape and dtype, same shape on every rank; updated in place.
        group: the process group; ``None`` means the default group.
        op: only ``dist.ReduceOp.SUM`` (accepted for drop-in use where ``dist.all_reduce`` was).
        async_op: if True, return an already-completed work handle.

    Returns:
        ``None``, or a handle with ``wait()`` when ``async_op`` is True.
    """
    check_reduce_args(tensor, op)
    rank, world_size = group_rank_and_size(group)
    root = global_rank(group, 0)
    if world_size > 1 and tensor.numel() > 0:
        with flat_view(tensor) as flat:
            if rank == 0:
                incoming = torch.empty_like(flat)
                for src in range(1, world_size):
                    recv(incoming, global_rank(group, src), group)
                    flat.add_(incoming)
                for dst in range(1, world_size):
                    send(flat, global_rank(group, dst), group)
            else:
                send(flat, root, group)
                recv(flat, root, group)
    return CompletedWork() if async_op else None


def all_reduce_per_tensor(tensors, group: dist.ProcessGroup | None = None,
                          all_reduce: AllReduce | None = None, average: bool = False) -> None:
    """All-reduce each tensor with its own call: the naive way to synchronize gradients.

    One collective per tensor pays the per-call latency once per parameter,
    which is what bucketing later removes.

    Args:
        tensors: an iterable of tensors (e.g. gradients), each updated in place.
            ``None`` entries (parameters without a gradient) are skipped.
        group: the process group; ``None`` means the default group.
        all_reduce: the collective, with ``dist.all_reduce``'s in-place signature
            (``fn(tensor, group=group)``); ``None`` means ``dist.all_reduce``.
        average: divide by the world size, giving the mean instead of the sum.
            The division comes before the sum, as in torch DDP (why:
            :mod:`dpcourse.comm.averaging`).
    """
    world_size = dist.get_world_size(group)
    for t in tensors:
        if t is None:
            continue
        if average:
            divide_before_sum(t, world_size)
        # Looked up at call time so CommTrace, which patches dist, sees the call.
        (all_reduce or dist.all_reduce)(t, group=group)
