"""Ring all-reduce built only from point-to-point messages.

The flat tensor is cut into ``world_size`` chunks (:func:`chunk_bounds`). The
ranks form a ring: rank ``r`` only ever sends to ``r + 1`` and receives from
``r - 1`` (mod ``world_size``). Two phases of ``world_size - 1`` steps each:

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
and gloo do; accumulating in fp32 would be more accurate than the library,
not equal to it. Results match ``dist.all_reduce`` exactly when the additions
happen in the same order (e.g. 2 ranks), and otherwise to within a couple of
units in the last place of the partial sums (measured on gloo with 2-4 ranks:
at most 2 ulps for fp16 and bf16; integer-valued data match exactly).

Speed: ``num_pipeline_chunks=k`` (k >= 2) cuts every chunk into ``k`` slices
and keeps one slice in flight while the previous one is added, so the adds
hide behind the transfers (and the all-gather of early slices starts while
late slices are still being reduced). ``1`` (the default) is the plain
loop the lessons read.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from dpcourse.comm.p2p import (CompletedWork, check_reduce_args, exchange, flat_view,
                               global_rank, group_rank_and_size, wait_all)

PHASES = ("reduce_scatter", "all_gather")
AUTO_SLICE_BYTES = 4 * 2**20  # "auto" pipelining: slices of about 4 MiB, at most 8 per chunk


def chunk_bounds(numel: int, world_size: int, index: int) -> tuple[int, int]:
    """Return ``(start, end)`` of chunk ``index`` of ``numel`` elements cut into ``world_size``.

    Chunks are as equal as possible: the first ``numel % world_size`` chunks
    have one element more. When ``numel < world_size`` the last chunks are empty.

    Args:
        numel: number of elements in the flat tensor.
        world_size: number of chunks (one per rank).
        index: which chunk, ``0 <= index < world_size``.

    Returns:
        ``(start, end)`` such that ``flat[start:end]`` is the chunk.
    """
    if not 0 <= index < world_size:
        raise ValueError(f"chunk index {index} out of range for world_size={world_size}.")
    base, extra = divmod(numel, world_size)
    start = index * base + min(index, extra)
    return start, start + base + (1 if index < extra else 0)


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


def _check_pipeline(num_pipeline_chunks, flat: torch.Tensor, world_size: int) -> int:
    if num_pipeline_chunks == "auto":
        chunk_bytes = -(-flat.numel() // world_size) * flat.element_size()
        return max(1, min(8, chunk_bytes // AUTO_SLICE_BYTES))
    if isinstance(num_pipeline_chunks, bool) or not isinstance(num_pipeline_chunks, int) \
            or num_pipeline_chunks < 1:
        raise ValueError(
            f"num_pipeline_chunks must be an int >= 1 or 'auto', got {num_pipeline_chunks!r}."
        )
    return num_pipeline_chunks


def _ring_phase(flat: torch.Tensor, phase: str, group) -> None:
    """Run one phase of the ring on ``flat``, one whole chunk per step (the readable version)."""
    rank, world_size = group_rank_and_size(group)
    right = global_rank(group, (rank + 1) % world_size)
    left = global_rank(group, (rank - 1) % world_size)
    numel = flat.numel()
    # One receive buffer, reused at every step: the largest chunk is chunk 0.
    buffer = flat.new_empty(chunk_bounds(numel, world_size, 0)[1]) if phase == PHASES[0] else None
    for step in range(world_size - 1):
        send_chunk, recv_chunk = ring_step_chunks(rank, world_size, phase, step)
        s0, s1 = chunk_bounds(numel, world_size, send_chunk)
        r0, r1 = chunk_bounds(numel, world_size, recv_chunk)
        if phase == "reduce_scatter":
            incoming = buffer[: r1 - r0]
            wait_all(exchange(flat[s0:s1], right, incoming, left, group))
            flat[r0:r1].add_(incoming)  # our partial sum + everything the left side summed so far
        else:
            wait_all(exchange(flat[s0:s1], right, flat[r0:r1], left, group))


def pipeline_tasks(rank: int, world_size: int, numel: int, phases: tuple[str, ...],
                   slices: int) -> list[tuple[int, int, int, int, bool]]:
    """List the pipelined ring's messages in issue order.

    Args:
        rank: rank inside the group.
        world_size: size of the group.
        numel: elements in the flat tensor.
        phases: the phases to run, in order (a subset of :data:`PHASES`).
        slices: pieces per chunk.

    Returns:
        One ``(send_start, send_end, recv_start, recv_end, reduce)`` per message;
        ``reduce`` is True when the received slice is added (reduce-scatter).
    """
    tasks = []
    for phase in phases:
        for step in range(world_size - 1):
            send_chunk, recv_chunk = ring_step_chunks(rank, world_size, phase, step)
            s0, s1 = chunk_bounds(numel, world_size, send_chunk)
            r0, r1 = chunk_bounds(numel, world_size, recv_chunk)
            for k in range(slices):
                a, b = chunk_bounds(s1 - s0, slices, k)
                c, d = chunk_bounds(r1 - r0, slices, k)
                tasks.append((s0 + a, s0 + b, r0 + c, r0 + d, phase == "reduce_scatter"))
    return tasks


def _ring_pipelined(flat: torch.Tensor, phases: tuple[str, ...], group, slices: int) -> None:
    """Run ``phases`` with every chunk cut into ``slices`` pieces, one piece always in flight.

    Task ``i`` is (phase, step, slice) in order. Task ``i`` only reads data that
    task ``i - slices`` produced, so issuing task ``i`` before finishing task
    ``i - 1`` is safe when ``slices >= 2``; that overlap is the whole gain.
    """
    rank, world_size = group_rank_and_size(group)
    right = global_rank(group, (rank + 1) % world_size)
    left = global_rank(group, (rank - 1) % world_size)
    numel = flat.numel()
    tasks = pipeline_tasks(rank, world_size, numel, phases, slices)
    largest = chunk_bounds(chunk_bounds(numel, world_size, 0)[1], slices, 0)[1]
    # Two receive buffers used alternately: task i receives into one while task
    # i - 1's data is being added from the other.
    buffers = [flat.new_empty(largest), flat.new_empty(largest)] if PHASES[0] in phases else None
    pending = None
    for i, (s0, s1, r0, r1, reduce) in enumerate(tasks):
        incoming = buffers[i % 2][: r1 - r0] if reduce else flat[r0:r1]
        works = exchange(flat[s0:s1], right, incoming, left, group, tag=i % 2)
        if pending is not None:
            _finish(flat, *pending)
        pending = (works, incoming, r0, r1, reduce)
    if pending is not None:
        _finish(flat, *pending)


def _finish(flat, works, incoming, r0, r1, reduce) -> None:
    wait_all(works)
    if reduce:
        flat[r0:r1].add_(incoming)


@torch.no_grad()  # like dist.all_reduce, works on tensors that require grad
def _run(tensor: torch.Tensor, phases: tuple[str, ...], group, num_pipeline_chunks) -> None:
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"expected a torch.Tensor, got {type(tensor).__name__}.")
    _, world_size = group_rank_and_size(group)
    with flat_view(tensor) as flat:
        slices = _check_pipeline(num_pipeline_chunks, flat, world_size)
        if world_size == 1 or flat.numel() == 0:
            return
        if slices >= 2 and flat.is_cuda:
            from dpcourse.comm.ring_streams import ring_pipelined_on_streams

            ring_pipelined_on_streams(flat, phases, group, slices)
        elif slices >= 2:
            _ring_pipelined(flat, phases, group, slices)
        else:
            for phase in phases:
                _ring_phase(flat, phase, group)


def ring_reduce_scatter(tensor: torch.Tensor, group=None, *, num_pipeline_chunks=1) -> None:
    """Sum chunk ``r`` of ``tensor`` over all ranks into rank ``r``'s copy, in place.

    Only chunk ``chunk_bounds(tensor.numel(), world_size, rank)`` (of the
    flattened tensor) is meaningful afterwards; the other chunks hold partial sums.

    Args:
        tensor: any shape and dtype, same shape on every rank; updated in place.
        group: the process group; ``None`` means the default group.
        num_pipeline_chunks: slices per chunk kept in flight (``1``: plain loop; ``"auto"``).
    """
    _run(tensor, PHASES[:1], group, num_pipeline_chunks)


def ring_all_gather(tensor: torch.Tensor, group=None, *, num_pipeline_chunks=1) -> None:
    """Copy each rank's own chunk into every rank's ``tensor``, in place.

    On entry rank ``r`` must hold valid data in its chunk ``r`` (see
    :func:`chunk_bounds`); on exit every chunk holds its owner's data.

    Args:
        tensor: any shape and dtype, same shape on every rank; updated in place.
        group: the process group; ``None`` means the default group.
        num_pipeline_chunks: slices per chunk kept in flight (``1``: plain loop; ``"auto"``).
    """
    _run(tensor, PHASES[1:], group, num_pipeline_chunks)


def ring_all_reduce(tensor: torch.Tensor, group=None, *, op=dist.ReduceOp.SUM,
                    async_op: bool = False, num_pipeline_chunks=1):
    """Sum ``tensor`` over all ranks in place, like ``dist.all_reduce``, with a ring of messages.

    It is :func:`ring_reduce_scatter` followed by :func:`ring_all_gather`.

    Args:
        tensor: any shape and dtype, same shape on every rank; updated in place.
        group: the process group; ``None`` means the default group.
        op: only ``dist.ReduceOp.SUM`` (accepted for drop-in use where ``dist.all_reduce`` was).
        async_op: if True, return a work handle; the ring has already been issued
            (on GPU, queued on the current stream) when it returns, so ``wait()`` is immediate.
        num_pipeline_chunks: slices per chunk kept in flight (``1``: plain loop; ``"auto"``).

    Returns:
        ``None``, or a handle with ``wait()`` when ``async_op`` is True.
    """
    check_reduce_args(tensor, op)
    _run(tensor, PHASES, group, num_pipeline_chunks)
    return CompletedWork() if async_op else None
