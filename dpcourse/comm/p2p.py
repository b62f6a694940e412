"""Shared plumbing for collectives built from point-to-point messages.

Everything here looks ``torch.distributed`` functions up at call time
(``dist.isend``, never a cached reference) so that :class:`CommTrace` sees
every message the hand-built collectives send.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
import torch.distributed as dist


def group_rank_and_size(group: dist.ProcessGroup | None = None) -> tuple[int, int]:
    """Return this process's rank inside ``group`` and the group's size.

    Args:
        group: a process group; ``None`` means the default group.

    Returns:
        ``(rank, world_size)`` counted inside ``group``.

    Raises:
        ValueError: this process is not a member of ``group``.
    """
    if isinstance(group, dist.ReduceOp):
        raise TypeError("the second positional argument is `group` here: pass op=... by keyword.")
    rank = dist.get_rank(group)
    if rank < 0:
        raise ValueError(
            "this process is not a member of the group it was asked to communicate in: "
            "call the collective only on the ranks passed to dist.new_group(ranks=...)."
        )
    return rank, dist.get_world_size(group)


def global_rank(group: dist.ProcessGroup | None, rank: int) -> int:
    """Translate a rank counted inside ``group`` to the global rank point-to-point calls take.

    Args:
        group: a process group; ``None`` means the default group (ranks are already global).
        rank: the rank inside ``group``.

    Returns:
        The matching rank in the default group.
    """
    return rank if group is None else dist.get_global_rank(group, rank)


def check_reduce_args(tensor: torch.Tensor, op) -> None:
    """Raise a clear error for inputs the hand-built collectives do not support.

    Args:
        tensor: the tensor to reduce.
        op: the requested ``dist.ReduceOp``; only ``SUM`` is supported.
    """
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"expected a torch.Tensor, got {type(tensor).__name__}.")
    if op != dist.ReduceOp.SUM:
        raise ValueError(
            f"only op=dist.ReduceOp.SUM is supported, got {op}. To average, sum and then "
            "divide by the world size."
        )
    if tensor.is_sparse:
        raise ValueError("sparse tensors are not supported: pass tensor.to_dense().")


@contextmanager
def flat_view(tensor: torch.Tensor):
    """Yield a 1-D tensor sharing ``tensor``'s storage; results reach ``tensor`` on exit.

    A contiguous tensor is viewed without copying. A non-contiguous one (e.g. a
    transposed matrix) is copied into a contiguous buffer, and the buffer is
    copied back on exit, so the caller's tensor is updated in place either way.

    Args:
        tensor: any-shaped tensor.

    Yields:
        A flat tensor of ``tensor.numel()`` elements.
    """
    if tensor.is_contiguous():
        yield tensor.view(-1)
        return
    work = tensor.contiguous()
    yield work.view(-1)
    tensor.copy_(work)


def exchange(send: torch.Tensor | None, dst: int, recv: torch.Tensor | None, src: int,
             group: dist.ProcessGroup | None = None, tag: int = 0) -> list:
    """Start sending ``send`` to ``dst`` while receiving into ``recv`` from ``src``.

    Both directions go in one ``dist.batch_isend_irecv`` call: with NCCL, a
    blocking send followed by a blocking receive on every rank of a ring would
    wait for each other forever; a batch is posted as one unit, so it cannot.
    Empty tensors are skipped (both ends know the sizes, so they skip alike).

    Args:
        send: tensor to send (contiguous), or ``None``.
        dst: global rank to send to.
        recv: contiguous tensor to receive into, or ``None``.
        src: global rank to receive from.
        group: the process group; ``None`` means the default group.
        tag: message tag (gloo uses it to match messages; NCCL ignores it).

    Returns:
        The work handles; call ``wait()`` on each before reading ``recv`` or
        writing ``send``.
    """
    ops = []
    if send is not None and send.numel() > 0:
        ops.append(dist.P2POp(dist.isend, send, dst, group, tag))
    if recv is not None and recv.numel() > 0:
        ops.append(dist.P2POp(dist.irecv, recv, src, group, tag))
    if not ops:
        return []
    return [w for w in dist.batch_isend_irecv(ops) if w is not None]


def wait_all(works: list) -> None:
    """Wait for every work handle in ``works`` (on GPU: order the current stream after them)."""
    for w in works:
        if w is not None:
            w.wait()


def send(tensor: torch.Tensor, dst: int, group: dist.ProcessGroup | None = None) -> None:
    """Send ``tensor`` to global rank ``dst`` and wait until it has gone (a blocking send)."""
    wait_all([dist.isend(tensor, dst=dst, group=group)])


def recv(tensor: torch.Tensor, src: int, group: dist.ProcessGroup | None = None) -> None:
    """Receive into ``tensor`` from global rank ``src``, waiting for the data (a blocking receive)."""
    wait_all([dist.irecv(tensor, src=src, group=group)])


class CompletedWork:
    """A work handle for a collective that was complete, for its caller, when it returned.

    On CPU the hand-built collectives finish before returning; on GPU their
    messages and additions are queued on the current stream, so anything
    queued after them sees the result (as with a synchronous
    ``dist.all_reduce``). This handle lets code written for
    ``dist.all_reduce(..., async_op=True)`` call ``wait()``.
    """

    def wait(self, timeout=None) -> bool:
        """Return at once: the work is already done."""
        return True

    def is_completed(self) -> bool:
        """Return True: the work is already done."""
        return True

