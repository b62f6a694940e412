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
        async_op: return a work handle instead of blocking. Only ``dist.all_reduce`` and
            an :class:`OnCommStream` have one; any other ``all_reduce`` runs to completion.

    Returns:
        The work handle when ``async_op`` and ``dist.all_reduce`` or an
        :class:`OnCommStream` are used, else ``None``.
    """
    if all_reduce is None:
        # Looked up at call time, so that a CommTrace patching it sees the call.
        return dist.all_reduce(tensor, group=group, async_op=async_op)
    if isinstance(all_reduce, OnCommStream):
        return all_reduce(tensor, group=group, async_op=async_op)
    all_reduce(tensor, group=group)
    return None


# The communication stream of each device, made at its first use: {device index: stream}.
_COMM_STREAMS: dict = {}


class StreamWork:
    """What :class:`OnCommStream` returns: ``wait()`` orders the current stream after the work."""

    def __init__(self, event: torch.cuda.Event, device: torch.device):
        self.event, self.device = event, device

    def wait(self) -> None:
        torch.cuda.current_stream(self.device).wait_event(self.event)


class OnCommStream:
    """An all-reduce that enqueues GPU work, run on a communication stream beside the caller's.

    Our NVLink kernels enqueue on the current stream and return. Called from a
    data-parallel wrapper's gradient hook, the current stream is the backward
    pass's, so each bucket's reduction would run between two backward kernels
    instead of beside them. Wrapped here, a call makes a communication stream
    wait for all the current stream has queued (the bucket's gradients included),
    enqueues the all-reduce there and, with ``async_op=True``, returns a
    :class:`StreamWork` to ``wait()`` on before the result is read, as a
    wrapper waits on the handle of ``dist.all_reduce(..., async_op=True)``.

    One communication stream per device, shared by every ``OnCommStream`` of the
    process, so that the calls keep the order they were made in: the NVLink
    kernels rely on it (make all of a process's calls of them through
    ``OnCommStream``, or none). A CPU tensor is reduced by a direct call.

    Args:
        all_reduce: ``fn(tensor, group=None)`` summing in place by enqueueing GPU
            work on the current stream, e.g. ``dpcourse.comm.kernels.two_shot_all_reduce``.
    """

    def __init__(self, all_reduce: AllReduce):
        self.all_reduce = all_reduce

    def __call__(self, tensor: torch.Tensor, group: dist.ProcessGroup | None = None,
                 async_op: bool = False) -> StreamWork | None:
        if not tensor.is_cuda:
            self.all_reduce(tensor, group=group)
            return None
        device = tensor.device
        comm = _COMM_STREAMS.get(device.index)
        if comm is None:
            comm = _COMM_STREAMS[device.index] = torch.cuda.Stream(device)
        comm.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(comm):
            self.all_reduce(tensor, group=group)
        # the caching allocator must not hand the memory out again before the reduction ends
        tensor.record_stream(comm)
        work = StreamWork(comm.record_event(), device)
        if async_op:
            return work
        work.wait()
        return None
