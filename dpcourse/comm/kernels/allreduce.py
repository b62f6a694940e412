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

from dpcourse.comm.kernels.schedule import grid_size
from dpcourse.comm.kernels.workspace import (PLANS, Workspace, get_workspace,
                                             symmetric_workspace_of)
from dpcourse.comm.sharding import chunk_size

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
TILE_BYTES = 16 * 1024  # bytes of one tensor a block handles per loop iteration
NUM_WARPS = 16
ONE_SHOT_MAX_BLOCKS = 32  # latency-bound: a few blocks reach every peer in parallel
# Bandwidth-bound: enough loads in flight to fill NVLink. Measured on 2x H200 (bf16,
# tensor in symmetric memory): 32 blocks 1.04x NCCL at 256 MiB, 128 blocks 1.11x, 256 1.11x.
# Capped by the number of SMs, so that every block is resident (a block spins on a flag).
TWO_SHOT_MAX_BLOCKS = 128
ALIGN = 16  # elements: every rank's slice starts 16-element aligned (16-byte accesses)
MAX_NUMEL = 2**31 - 2**24  # the kernels index with 32-bit offsets
SUM = dist.ReduceOp.SUM  # the one op the kernels do (bound once: read on every call)
ONE_SHOT, TWO_SHOT = "one_shot", "two_shot"  # the kinds of plan


def _check(tensor: torch.Tensor, op) -> torch.Tensor:
    """Validate the arguments; return the 1-D view to reduce."""
    if (type(tensor) is torch.Tensor and tensor.is_cuda and op is SUM
            and tensor.dtype in DTYPES and tensor.is_contiguous() and tensor.dim() == 1
            and tensor.numel() <= MAX_NUMEL):
        return tensor  # the common case, checked cheaply: this runs on every call
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"expected a torch.Tensor, got {type(tensor).__name__}.")
    if op != SUM:
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
    return tensor.view(-1)


def _prepare(tensor: torch.Tensor, op) -> torch.Tensor | None:
    """Validate the arguments; return the 1-D view to reduce, or ``None`` when it is empty."""
    flat = _check(tensor, op)
    return flat if flat.numel() else None


def _launch_shape(length: int, dtype: torch.dtype, max_blocks: int,
                  ws: Workspace) -> tuple[int, int]:
    """Return ``(grid, block)`` for a kernel over ``length`` elements of ``dtype``."""
    block = block_elems(dtype)
    return grid_size(length, block, min(max_blocks, ws.max_blocks)), block


def _kernels():
    """Return the module that launches the kernels (imports Triton: a CUDA machine only)."""
    try:
        from dpcourse.comm.kernels import triton_launch
    except ImportError as err:  # pragma: no cover - depends on the install
        raise RuntimeError("the NVLink kernels need Triton (installed with PyTorch's CUDA "
                           f"wheels): {err}") from err
    return triton_launch


class _Plan:
    """A repeated call's launch, bound once: each call only picks the buffer and the stream.

    Made after the first call on a tensor (its address, length and dtype, its
    device, the group, grid cap and kernel): a later call on the same tensor
    skips the argument checks, the workspace lookup, the launch arithmetic and
    Triton's runner, which on a small message cost the host about as long as
    the kernel takes on the GPU. Each launch's arguments are built here, once:
    addresses as integers (given a tensor, Triton's launcher calls its
    ``data_ptr()`` and asks the CUDA driver about the pointer, on every call and
    for every tensor argument; an integer it passes on as it is).

    An ordinary tensor is copied through the group's workspace, alternating its
    two halves (``tails[0]``, ``tails[1]``); a tensor in symmetric memory is its
    own buffer (both tails launch on it). Plans live in
    :data:`~dpcourse.comm.kernels.workspace.PLANS`, which is emptied whenever a
    workspace is replaced or released (a tensor in symmetric memory is never
    freed): a plan never outlives the memory its addresses point into.
    """

    __slots__ = ("ws", "launcher", "c_launch", "grid", "tails", "device")

    def __init__(self, ws: Workspace, launcher, device: int, tails: tuple):
        self.ws, self.device, self.tails, self.launcher = ws, device, tails, launcher
        # copied out of the launcher: one attribute read each instead of two, on every call
        self.c_launch, self.grid = launcher.c_launch, launcher.grid

    def __call__(self) -> None:
        ws = self.ws
        tail = self.tails[ws.calls & 1]
        ws.calls += 1
        self.c_launch(self.grid, 1, 1, torch._C._cuda_getCurrentRawStream(self.device), *tail)


def _plan_key(kind: str, tensor: torch.Tensor, group, max_blocks: int, kernel) -> tuple:
    """What a plan is found by: the memory (address, length, dtype, device), the call's options."""
    return (kind, tensor.data_ptr(), tensor.numel(), tensor.dtype, tensor.get_device(), group,
            max_blocks, kernel)


def _remember(kind: str, tensor: torch.Tensor, group, max_blocks: int, kernel, ws: Workspace,
              launcher, buffers: tuple, rest: tuple) -> None:
    """Keep a :class:`_Plan` for later calls on ``tensor`` with the same options.

    ``buffers``: the buffer of each of the two alternating calls (the workspace's
    halves, or the tensor itself twice); ``rest``: the launch's other arguments.
    """
    if len(PLANS) >= 256:  # bounded: a few bucket sizes per model in practice
        PLANS.clear()
    rest = tuple(a.data_ptr() if isinstance(a, torch.Tensor) else a for a in rest)
    tails = tuple(launcher.bind(tensor.data_ptr(), buf.data_ptr(), *rest) for buf in buffers)
    PLANS[_plan_key(kind, tensor, group, max_blocks, kernel)] = _Plan(
        ws, launcher, tensor.get_device(), tails)


def block_elems(dtype: torch.dtype) -> int:
    """Return ``BLOCK``, the elements a block handles per loop iteration for ``dtype``."""
    return TILE_BYTES // dtype.itemsize


def one_shot_all_reduce(tensor: torch.Tensor, group=None, op=dist.ReduceOp.SUM,
                        max_blocks: int = ONE_SHOT_MAX_BLOCKS, kernel=None) -> None:
    """Sum ``tensor`` over ``group`` in place: every rank loads every peer's copy and adds.

    Args:
        tensor: contiguous CUDA tensor (float32, bfloat16 or float16), same size on every rank.
        group: the process group; ``None`` means the default group.
        op: only ``dist.ReduceOp.SUM``.
        max_blocks: cap on the grid (blocks per rank).
        kernel: a Triton kernel with the parameters of ``one_shot_kernel`` to launch instead
            (the exercise's); ``None`` launches ours.
    """
    if type(tensor) is torch.Tensor and op is SUM:  # a call like an earlier one on this tensor?
        plan = PLANS.get(_plan_key(ONE_SHOT, tensor, group, max_blocks, kernel))
        if plan is not None and tensor.is_contiguous():
            return plan()
    flat = _prepare(tensor, op)
    if flat is None:
        return
    n, element = flat.numel(), flat.element_size()
    ws = get_workspace(2 * n * element, group, flat.device)  # two halves, each fits a call
    if ws.world_size == 1:
        return
    # Calls alternate between two fixed halves: a rank rewrites a half only after the
    # barrier of the call in between, so no peer can still be reading it (see the kernel).
    buf = ws.next_half(flat.dtype, n)
    grid, block = _launch_shape(n, flat.dtype, max_blocks, ws)
    launcher = _kernels().launch_one_shot(flat, buf, ws.deltas(element), ws.pad, ws.pad_deltas,
                                          ws.rank, ws.world_size, grid, block, NUM_WARPS, kernel)
    _remember(ONE_SHOT, flat, group, max_blocks, kernel, ws, launcher, ws.halves(flat.dtype, n),
              (ws.deltas(element), ws.pad, ws.pad_deltas, n, ws.rank, ws.world_size, block))


def two_shot_all_reduce(tensor: torch.Tensor, group=None, op=dist.ReduceOp.SUM,
                        max_blocks: int = TWO_SHOT_MAX_BLOCKS, kernel=None) -> None:
    """Sum ``tensor`` over ``group`` in place: reduce-scatter by peer loads, all-gather by stores.

    Args:
        tensor: as for :func:`one_shot_all_reduce`; a tensor from :func:`symmetric_empty`
            is reduced without copies.
        group, op, max_blocks: as for :func:`one_shot_all_reduce`.
        kernel: a Triton kernel with the parameters of ``two_shot_kernel`` to launch instead
            (the exercise's); ``None`` launches ours.
    """
    if type(tensor) is torch.Tensor and op is SUM:  # a call like an earlier one on this tensor?
        plan = PLANS.get(_plan_key(TWO_SHOT, tensor, group, max_blocks, kernel))
        if plan is not None and tensor.is_contiguous():
            return plan()
    flat = _prepare(tensor, op)
    if flat is None:
        return
    n, element = flat.numel(), flat.element_size()
    resident = symmetric_workspace_of(flat, group)
    copy = resident is None
    # Copying: two halves, each with room for world_size aligned slices (<= 64 ranks).
    ws = (get_workspace(2 * (n + 64 * ALIGN) * element, group, flat.device)
          if resident is None else resident)
    if ws.world_size == 1:
        return
    length = chunk_size(n, ws.world_size, align=ALIGN)  # slice r: shard_range(..., align=ALIGN)
    if copy and length * ws.world_size > n + 64 * ALIGN:  # more than 64 ranks
        ws = get_workspace(2 * length * ws.world_size * element, group, flat.device)
    if copy:  # alternating halves, shared with one-shot (its kernel says why)
        buf = ws.next_half(flat.dtype, n)
    else:  # the tensor is the symmetric buffer: peers load and store it directly
        buf = flat
    grid, block = _launch_shape(length, flat.dtype, max_blocks, ws)
    launcher = _kernels().launch_two_shot(flat, buf, ws.deltas(element), ws.pad, ws.pad_deltas,
                                          length, ws.rank, ws.world_size, grid, block, NUM_WARPS,
                                          copy, kernel)
    _remember(TWO_SHOT, flat, group, max_blocks, kernel, ws, launcher,
              ws.halves(flat.dtype, n) if copy else (flat, flat),
              (ws.deltas(element), ws.pad, ws.pad_deltas, n, length, ws.rank, ws.world_size,
               block, copy))
