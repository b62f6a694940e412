"""The two halves of an all-reduce on flat tensors, as every sharded scheme uses them.

``reduce_scatter``: every rank contributes a full-size tensor, rank ``r`` gets
the sum of block ``r``. ``all_gather``: every rank contributes its block, every
rank gets all of them. Each moves ``(N - 1) / N`` of the full tensor per rank,
half of what an all-reduce moves (which is one of each).

torch >= 2.13 renames ``all_gather_into_tensor`` / ``reduce_scatter_tensor``
(same semantics, a deprecation warning on every call). The old names are
called here because :class:`~dpcourse.comm.CommTrace` records them and older
torch versions (e.g. GPU images) lack the new ones.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist

_RENAMED = r".*(all_gather_into_tensor|reduce_scatter_tensor)` is deprecated"


@contextmanager
def _old_name_is_deliberate() -> Iterator[None]:
    """Silence torch's rename warning for the call inside, and only there.

    The call is deliberate (see the module docstring); unsilenced, the warning
    would repeat in every lesson's output. ``catch_warnings`` restores the
    caller's filters on exit.
    """
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_RENAMED, category=FutureWarning)
        yield


def all_gather(output: torch.Tensor, block: torch.Tensor, group=None, async_op: bool = False):
    """Fill ``output`` (``N * block.numel()`` elements) with every rank's ``block``, rank order.

    Args:
        output: flat tensor of ``world_size * block.numel()`` elements, overwritten.
        block: this rank's flat block.
        group: process group (``None``: the default group).
        async_op: return a work handle instead of waiting.

    Returns:
        A work handle when ``async_op``, else ``None``.
    """
    # Looked up at call time so that CommTrace sees the call.
    with _old_name_is_deliberate():
        return dist.all_gather_into_tensor(output, block, group=group, async_op=async_op)


def reduce_scatter(output: torch.Tensor, full: torch.Tensor, group=None, async_op: bool = False):
    """Sum ``full`` over ranks and keep block ``rank`` of the sum in ``output``.

    ``full`` is this rank's flat contribution, ``world_size`` equal blocks; ``output``
    (``full.numel() / world_size`` elements) is overwritten. ``group``, ``async_op`` and
    the return value are :func:`all_gather`'s.
    """
    with _old_name_is_deliberate():
        return dist.reduce_scatter_tensor(output, full, group=group, async_op=async_op)


def wire_bytes(op: str, nbytes: float, world_size: int) -> float:
    """Return the bytes one rank sends for a collective over a tensor of ``nbytes`` (ring algorithm).

    ``nbytes`` is what :class:`~dpcourse.comm.CommTrace` records: the full
    tensor for ``all_reduce``, the gathered output for ``all_gather_into_tensor``,
    the full input for ``reduce_scatter_tensor``.

    Args:
        op: ``"all_reduce"``, ``"all_gather_into_tensor"``, ``"reduce_scatter_tensor"``
            or ``"broadcast"`` (the root sends the tensor once per peer on a tree or
            pipeline: counted as ``nbytes``).
        nbytes: recorded size of the tensor.
        world_size: number of ranks ``N``.

    Returns:
        ``2 (N-1)/N * nbytes`` for all-reduce, ``(N-1)/N * nbytes`` for each half.
    """
    if op == "all_reduce":
        return 2.0 * (world_size - 1) / world_size * nbytes
    if op in ("all_gather_into_tensor", "reduce_scatter_tensor"):
        return (world_size - 1) / world_size * nbytes
    if op == "broadcast":
        return float(nbytes) if world_size > 1 else 0.0
    raise ValueError(f"wire_bytes knows all_reduce, all_gather_into_tensor, "
                     f"reduce_scatter_tensor and broadcast, not {op!r}.")


def trace_wire_bytes(records, world_size: int) -> float:
    """Total bytes one rank sent for the collectives in a CommTrace (``trace.to_records()``)."""
    return sum(wire_bytes(r["op"], r["nbytes"], world_size) for r in records
               if r["op"] != "barrier")
