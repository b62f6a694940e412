"""The all-reduce a data-parallel wrapper calls: torch's, or one passed as ``all_reduce=``."""

from __future__ import annotations

from typing import Any, Protocol

import torch
import torch.distributed as dist


class AllReduce(Protocol):
    """What ``all_reduce=`` accepts: ``dist.all_reduce``'s in-place signature, summing in ``group``.

    ``dist.all_reduce``, :func:`dpcourse.comm.ring_all_reduce`,
    :func:`dpcourse.comm.naive_all_reduce` and a learner's own ring all fit.
    """

    def __call__(self, tensor: torch.Tensor, group: dist.ProcessGroup | None = None) -> Any:
        """Sum ``tensor`` over ``group`` in place."""


def sum_over_ranks(tensor: torch.Tensor, *, group: dist.ProcessGroup | None = None,
                   all_reduce: AllReduce | None = None, async_op: bool = False) -> Any:
    """Sum ``tensor`` in place over ``group`` with ``all_reduce`` (default ``dist.all_reduce``).

    Args:
        tensor: contiguous tensor, summed in place.
        group: process group (``None``: the default group).
        all_reduce: a collective with ``dist.all_reduce``'s in-place signature, e.g.
            :func:`dpcourse.comm.ring_all_reduce`; ``None``: ``dist.all_reduce``.
        async_op: return a work handle instead of blocking. Only ``dist.all_reduce``
            has one; a given ``all_reduce`` always runs to completion.

    Returns:
        The work handle when ``async_op`` and ``dist.all_reduce`` are used, else ``None``.
    """
    if all_reduce is None:
        # Looked up at call time, so that a CommTrace patching it sees the call.
        return dist.all_reduce(tensor, group=group, async_op=async_op)
    all_reduce(tensor, group=group)
    return None
