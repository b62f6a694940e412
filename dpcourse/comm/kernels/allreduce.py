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
from dpcourse.comm.kernels.workspace import (Workspace, cache_key, get_workspace,
                                             is_current,
                                             symmetric_allocation, symmetric_workspace_of)
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
    try:
        from dpcourse.comm.kernels import triton_allreduce
    except ImportError as err:  # pragma: no cover - depends on the install
        raise RuntimeError("the NVLink kernels need Triton (installed with PyTorch's CUDA "
                           f"wheels): {err}") from err
    return triton_allreduce


class _Plan:
    """A repeated call's launch, bound once: only the tensor and the workspace half change.

    Made after the first call of a shape (kernel, dtype, length, device,
    group, grid cap, alignment; for a tensor in symmetric memory, the tensor
    itself): a later call of that shape skips the argument checks, the
    workspace lookup and the launch arithmetic, which on a small message cost
    the host about as long as the kernel takes on the GPU. Valid while its
    workspace is the group's current one (a larger call replaces it), or, for
    a symmetric tensor, while the tensor's allocation is alive.

    The launcher gets addresses, not tensors, and the current stream: given a
    tensor, Triton's launcher calls its ``data_ptr()`` and asks the CUDA driver
    about the pointer, on every call and for every tensor argument; an integer
    it passes on as it is. Without a stream it looks up the current device and
    its stream itself. The workspace the plan holds keeps every address alive.
    """

    __slots__ = ("group", "ws", "ws_key", "launch", "halves", "rest", "resident", "device")

    def __init__(self, flat: torch.Tensor, group, ws: Workspace, launch, rest: tuple,
                 resident: bool):
        # The group is held so that its id, part of the key, is never reused by another.
        self.group, self.ws, self.launch = group, ws, launch
        self.rest = tuple(a.data_ptr() if isinstance(a, torch.Tensor) else a for a in rest)
        self.device = flat.device.index
        self.resident = resident  # the tensor is its own buffer: no workspace halves
        self.ws_key: tuple = ()
        self.halves: tuple[int, ...] = ()
        if resident:
            return
        self.ws_key = cache_key(group, flat.device.index)
        half_len = (ws.nbytes // 2) // flat.element_size()
        self.halves = tuple(ws.view(flat.dtype, flat.numel(), offset=h * half_len).data_ptr()
                            for h in (0, 1))

    def __call__(self, tensor: torch.Tensor, address: int, home: Workspace | None) -> bool:
        """Launch on ``tensor`` if it fits this plan; return whether it ran.

        The key already matched the tensor's type, dtype, length, device and address (or
        alignment); ``address`` is ``tensor.data_ptr()`` and ``home`` what
        ``symmetric_allocation(tensor)`` returned for it.
        """
        ws = self.ws
        if tensor.dim() != 1 or not tensor.is_contiguous():
            return False
        if self.resident:  # the same allocation, still alive (not freed and reused)
            if home is not ws:
                return False
            buf = address
        else:
            if not is_current(ws, self.ws_key):
                return False
            buf = self.halves[ws.calls % 2]
            ws.calls += 1
        self.launch(address, buf, *self.rest,
                    stream=torch._C._cuda_getCurrentRawStream(self.device))
        return True


_PLANS: dict = {}
RESIDENT = "two_shot_symm"  # the plan kind of two-shot on a tensor in symmetric memory


def _plan_key(kind: str, tensor: torch.Tensor, address: int, group, max_blocks: int,
              kernel) -> tuple:
    # A symmetric tensor's plan is its own (its address); others share one per alignment.
    where = address if kind == RESIDENT else address % 16
    return (kind, where, tensor.numel(), tensor.dtype, tensor.get_device(), id(group),
            max_blocks, kernel)


def _run_plan(kind: str, tensor: torch.Tensor, address: int, home: Workspace | None, group,
              max_blocks: int, kernel) -> bool:
    """Launch through the plan for this call's shape, if there is one; return whether it ran."""
    plan = _PLANS.get(_plan_key(kind, tensor, address, group, max_blocks, kernel))
    return plan is not None and plan(tensor, address, home)


def _remember(kind: str, flat: torch.Tensor, group, max_blocks: int, kernel, ws: Workspace,
              launch, rest: tuple) -> None:
    """Keep a :class:`_Plan` for calls shaped like this one (``rest``: the launch's other args).

    ``flat`` is the caller's own tensor: a plan launches on the tensor it is given, so
    calls that pass another shape (reduced through a flat view) get none.
    """
    if len(_PLANS) >= 256:  # bounded: a few bucket sizes per model in practice
        _PLANS.clear()
    key = _plan_key(kind, flat, flat.data_ptr(), group, max_blocks, kernel)
    _PLANS[key] = _Plan(flat, group, ws, launch, rest, kind == RESIDENT)


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
    if (type(tensor) is torch.Tensor and op is SUM
            and _run_plan("one_shot", tensor, tensor.data_ptr(), None, group, max_blocks, kernel)):
        return  # a call shaped like an earlier one (the full path's checks explain the rest)
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
    launch = _kernels().launch_one_shot(flat, buf, ws.deltas(element), ws.pad, ws.pad_deltas,
                                        ws.rank, ws.world_size, grid, block, NUM_WARPS, kernel)
    if flat is tensor:
        _remember("one_shot", flat, group, max_blocks, kernel, ws, launch,
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
    if type(tensor) is torch.Tensor and op is SUM:  # a call shaped like an earlier one?
        home = symmetric_allocation(tensor)
        if _run_plan("two_shot" if home is None else RESIDENT, tensor, tensor.data_ptr(), home,
                     group, max_blocks, kernel):
            return
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
    launch = _kernels().launch_two_shot(flat, buf, ws.deltas(element), ws.pad, ws.pad_deltas,
                                        length, ws.rank, ws.world_size, grid, block, NUM_WARPS,
                                        copy, kernel)
    if flat is tensor:  # a resident tensor is its own buffer: no workspace halves
        _remember("two_shot" if copy else RESIDENT, flat, group, max_blocks, kernel, ws, launch,
                  (ws.deltas(element), ws.pad, ws.pad_deltas, n, length, ws.rank, ws.world_size,
                   block, copy))
