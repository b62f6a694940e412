"""Ring all-reduce built only from point-to-point messages.

The flat tensor is cut into ``world_size`` chunks as ``dist.reduce_scatter_tensor``
cuts it: chunk ``r`` is :func:`~dpcourse.comm.sharding.shard_range`, ``ceil(numel / N)``
elements, the last chunks short or empty. The ranks form a ring: rank ``r`` only
ever sends to ``r + 1`` and receives from ``r - 1`` (mod ``world_size``). Two
phases of ``world_size - 1`` steps each:

* **reduce-scatter** (:func:`ring_reduce_scatter`): at step ``s`` rank ``r``
  sends chunk ``(r - s - 1) % N`` and receives chunk ``(r - s - 2) % N``,
  adding it to its own copy. After the last step **rank r owns chunk r**:
  that chunk holds the sum over all ranks (the same convention as
  ``dist.reduce_scatter_tensor``, where rank ``r`` gets block ``r``).
* **all-gather** (:func:`ring_all_gather`): at step ``s`` rank ``r`` sends
  chunk ``(r - s) % N`` and receives chunk ``(r - s - 1) % N`` in place, so
  each summed chunk travels once around the ring.

Each rank sends every chunk but one per phase: ``2 (N - 1) / N`` times the
tensor's size in total, whatever ``N`` is: that is why the ring is
bandwidth-optimal. Its number of steps, ``2 (N - 1)``, does grow with ``N``, and
each step waits for one message, so latency-bound all-reduces slow down as ranks are added.

Low precision: each hop adds the received chunk in the tensor's own dtype
(fp16/bf16 partial sums are rounded at every hop), which is what NCCL's ring
and gloo do. Results match ``dist.all_reduce`` exactly when the additions
happen in the same order (e.g. 2 ranks), and otherwise to within a couple of
units in the last place of the partial sums (measured on gloo with 2-4 ranks:
at most 2 ulps for fp16 and bf16; integer-valued data match exactly).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from dpcourse.comm.p2p import (CompletedWork, check_reduce_args, exchange, flat_view,
                               global_rank, group_rank_and_size, wait_all)
from dpcourse.comm.sharding import chunk_size, shard_range

PHASES = ("reduce_scatter", "all_gather")


def ring_step_chunks(rank: int, world_size: int, phase: str, step: int) -> tuple[int, int]:
    """Return ``(send_chunk, recv_chunk)`` for ``rank`` at ``step`` of a ring phase.

    Args:
        rank: rank inside the group.
        world_size: size of the group.
        phase: ``"reduce_scatter"`` or ``"all_gather"``.
        step: ``0 <= step < world_size - 1``.

    Returns:
        The chunk index this rank sends to ``rank + 1`` and the one it receives from ``rank - 1``.
    """
    if phase not in PHASES:
        raise ValueError(f"phase must be one of {PHASES}, got {phase!r}.")
    # The reduce-scatter runs one chunk "behind" the all-gather so that rank r
    # ends up owning chunk r, which is where the all-gather starts from.
    lag = 1 if phase == "reduce_scatter" else 0
    return (rank - step - lag) % world_size, (rank - step - lag - 1) % world_size


@torch.no_grad()  # like dist.all_reduce, works on tensors that require grad
def _ring_phase(tensor: torch.Tensor, phase: str, group: dist.ProcessGroup | None) -> None:
    """Run one phase of the ring on ``tensor`` in place: ``world_size - 1`` steps, one chunk each."""
    rank, world_size = group_rank_and_size(group)
    if world_size == 1 or tensor.numel() == 0:
        return  # nothing to exchange
    right = global_rank(group, (rank + 1) % world_size)
    left = global_rank(group, (rank - 1) % world_size)
    with flat_view(tensor) as flat:
        numel = flat.numel()
        # One receive buffer, reused at every step: no chunk is longer than chunk_size.
        buffer = flat.new_empty(chunk_size(numel, world_size))
        for step in range(world_size - 1):
            send_chunk, recv_chunk = ring_step_chunks(rank, world_size, phase, step)
            s0, s1 = shard_range(numel, world_size, send_chunk)
            r0, r1 = shard_range(numel, world_size, recv_chunk)
            if phase == "reduce_scatter":
                incoming = buffer[: r1 - r0]
                wait_all(exchange(flat[s0:s1], right, incoming, left, group))
                flat[r0:r1].add_(incoming)  # our partial sum + everything the left side summed
            else:
                wait_all(exchange(flat[s0:s1], right, flat[r0:r1], left, group))


def ring_reduce_scatter(tensor: torch.Tensor, group: dist.ProcessGroup | None = None) -> None:
    """Sum chunk ``r`` of ``tensor`` over all ranks into rank ``r``'s copy, in place.

    Only chunk ``shard_range(tensor.numel(), world_size, rank)`` (of the
    flattened tensor) is meaningful afterwards; the other chunks hold partial sums.

    Args:
        tensor: any shape and dtype, same shape on every rank; updated in place.
        group: the process group; ``None`` means the default group.
    """
    check_reduce_args(tensor, dist.ReduceOp.SUM)
    _ring_phase(tensor, "reduce_scatter", group)


def ring_all_gather(tensor: torch.Tensor, group: dist.ProcessGroup | None = None) -> None:
    """Copy each rank's own chunk into every rank's ``tensor``, in place.

    On entry rank ``r`` must hold valid data in its chunk ``r`` (see
    :func:`~dpcourse.comm.sharding.shard_range`); on exit every chunk holds its owner's data.

    Args:
        tensor: any shape and dtype, same shape on every rank; updated in place.
        group: the process group; ``None`` means the default group.
    """
    check_reduce_args(tensor, dist.ReduceOp.SUM)
    _ring_phase(tensor, "all_gather", group)


def ring_all_reduce(tensor: torch.Tensor, group: dist.ProcessGroup | None = None, *,
                    op=dist.ReduceOp.SUM, async_op: bool = False) -> CompletedWork | None:
    """Sum ``tensor`` over all ranks in place, like ``dist.all_reduce``, with a ring of messages.

    It is :func:`ring_reduce_scatter` followed by :func:`ring_all_gather`.

    Args:
        tensor: any shape and dtype, same shape on every rank; updated in place.
        group: the process group; ``None`` means the default group.
        op: only ``dist.ReduceOp.SUM`` (accepted for drop-in use where ``dist.all_reduce`` was).
        async_op: if True, return a work handle; the ring has already been issued
            (on GPU, queued on the current stream) when it returns, so ``wait()`` is immediate.

    Returns:
        ``None``, or a handle with ``wait()`` when ``async_op`` is True.
    """
    check_reduce_args(tensor, op)
    _ring_phase(tensor, "reduce_scatter", group)
    _ring_phase(tensor, "all_gather", group)
    return CompletedWork() if async_op else None
