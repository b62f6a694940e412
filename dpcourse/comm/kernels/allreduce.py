"""``one_shot_all_reduce`` and ``two_shot_all_reduce``: in place, like ``dist.all_reduce(tensor)``.

Both sum a CUDA tensor over the ranks of ``group`` with one Triton kernel
launch and no host-side synchronisation (see
:mod:`dpcourse.comm.kernels.triton_allreduce` for the kernels and their
memory-ordering arguments). Calls on one rank must be issued in one stream
order (as NCCL's are), and every rank must make the same calls with tensors
of the same size and dtype: a block waits for the same block on every peer.

* **one-shot**: every rank loads every peer's whole tensor and adds. One
  barrier, ``N - 1`` times the tensor over NVLink into each GPU: the lowest
  latency, for small messages.
* **two-shot**: rank ``r`` loads slice ``r`` from every peer, adds, and
  stores the sum into every peer. Two barriers, ``2 (N - 1) / N`` times the
  tensor each way: the bandwidth of a ring, in one step each way.

An ordinary tensor is copied into a cached symmetric workspace and back
inside the kernel (no extra launch); a tensor from
:func:`~dpcourse.comm.kernels.workspace.symmetric_empty` is reduced in
place by two-shot without those copies.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from dpcourse.comm.kernels.schedule import grid_size, slice_len
from dpcourse.comm.kernels.workspace import get_workspace, symmetric_workspace_of

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
TILE_BYTES = 16 * 1024  # bytes of one tensor a block handles per loop iteration
NUM_WARPS = 16
ONE_SHOT_MAX_BLOCKS = 32  # latency-bound: a few blocks reach every peer in parallel
TWO_SHOT_MAX_BLOCKS = 64  # bandwidth-bound: enough loads in flight to fill NVLink
ALIGN = 16  # elements: slices and buffer halves start 16-element aligned
MAX_NUMEL = 2**31 - 2**24  # the kernels index with 32-bit offsets


def _check(tensor: torch.Tensor, group, op) -> torch.Tensor:
    """Validate the arguments; return the 1-D view to reduce."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"expected a torch.Tensor, got {type(tensor).__name__}.")
    if op != dist.ReduceOp.SUM:
        raise ValueError(f"only op=dist.ReduceOp.SUM is supported, got {op}.")
    if tensor.device.type != "cuda":
        raise ValueError(
            f"the NVLink kernels run on CUDA tensors, got a {tensor.device.type} tensor: "
            "use dist.all_reduce or dpcourse.comm.ring_all_reduce on CPU ranks.")
    if tensor.dtype not in DTYPES:
        raise ValueError(f"dtype {tensor.dtype} is not supported: use one of "
                         f"{[str(d) for d in DTYPES]}.")
    if not tensor.is_contiguous():
        raise ValueError("the tensor must be contiguous (call .contiguous() and copy back).")
    if tensor.numel() > MAX_NUMEL:
        raise ValueError(f"at most {MAX_NUMEL} elements per call; split the tensor.")
    if dist.get_rank(group) < 0:
        raise ValueError("this process is not a member of the group.")
    return tensor.view(-1)


def _kernels():
    try:
        from dpcourse.comm.kernels import triton_allreduce
    except ImportError as err:  # pragma: no cover - depends on the install
        raise RuntimeError("the NVLink kernels need Triton (installed with PyTorch's CUDA "
                           f"wheels): {err}") from err
    return triton_allreduce


def block_elems(dtype: torch.dtype) -> int:
    """Return ``BLOCK``, the elements a block handles per loop iteration for ``dtype``."""
    return TILE_BYTES // torch.empty((), dtype=dtype).element_size()


def one_shot_all_reduce(tensor: torch.Tensor, group=None, op=dist.ReduceOp.SUM,
                        max_blocks: int = ONE_SHOT_MAX_BLOCKS) -> None:
    """Sum ``tensor`` over ``group`` in place: every rank loads every peer's copy and adds.

    Args:
        tensor: contiguous CUDA tensor (float32, bfloat16 or float16), same size on every rank.
        group: the process group; ``None`` means the default group.
        op: only ``dist.ReduceOp.SUM``.
        max_blocks: cap on the grid (blocks per rank).
    """
    flat = _check(tensor, group, op)
    n = flat.numel()
    if n == 0 or dist.get_world_size(group) == 1:
        return
    element = flat.element_size()
    half = -(-n // ALIGN) * ALIGN
    ws = get_workspace(2 * half * element, group, flat.device)
    # Two halves, alternating: a rank rewrites a half only after the barrier of the
    # call in between, so no peer can still be reading it (see the kernel).
    buf = ws.view(flat.dtype, n, offset=(ws.calls % 2) * half)
    ws.calls += 1
    block = block_elems(flat.dtype)
    grid = grid_size(n, block, min(max_blocks, ws.max_blocks))
    _kernels().launch_one_shot(flat, buf, ws.deltas(element), ws.pad, ws.pad_deltas,
                               ws.rank, ws.world_size, grid, block, NUM_WARPS)


def two_shot_all_reduce(tensor: torch.Tensor, group=None, op=dist.ReduceOp.SUM,
                        max_blocks: int = TWO_SHOT_MAX_BLOCKS) -> None:
    """Sum ``tensor`` over ``group`` in place: reduce-scatter by peer loads, all-gather by stores.

    Args:
        tensor: contiguous CUDA tensor (float32, bfloat16 or float16), same size on every
            rank; one from :func:`symmetric_empty` is reduced without copies.
        group: the process group; ``None`` means the default group.
        op: only ``dist.ReduceOp.SUM``.
        max_blocks: cap on the grid (blocks per rank).
    """
    flat = _check(tensor, group, op)
    n, world = flat.numel(), dist.get_world_size(group)
    if n == 0 or world == 1:
        return
    element = flat.element_size()
    length = slice_len(n, world, ALIGN)
    ws = symmetric_workspace_of(flat, group)
    copy = ws is None
    if copy:
        ws = get_workspace(length * world * element, group, flat.device)
        buf = ws.view(flat.dtype, n)
    else:  # the tensor is the symmetric buffer: peers load and store it directly
        buf = flat
    block = block_elems(flat.dtype)
    grid = grid_size(length, block, min(max_blocks, ws.max_blocks))
    _kernels().launch_two_shot(flat, buf, ws.deltas(element), ws.pad, ws.pad_deltas, length,
                               ws.rank, ws.world_size, grid, block, NUM_WARPS, copy)
