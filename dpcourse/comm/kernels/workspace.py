"""Symmetric-memory workspaces: one buffer per (group, device), mapped on every rank of the group.

``torch.distributed._symmetric_memory.empty`` allocates GPU memory that
:func:`~torch.distributed._symmetric_memory.rendezvous` maps into every peer's
address space; the handle it returns lists each rank's address of the buffer
(``buffer_ptrs``) and of its signal pad (``signal_pad_ptrs``). A kernel gets
one local pointer and the distances to the peers' mappings
(:attr:`Workspace.deltas`), which is all it needs to load and store there.

NVLink multicast stays off: :func:`require_multicast_off` sets
``TORCH_SYMM_MEM_DISABLE_MULTICAST=1``, ``NCCL_NVLS_ENABLE=0`` and
``NVSHMEM_DISABLE_NVLS=1`` where they are unset and refuses to run where
they are set otherwise; the kernels use plain loads, stores and atomics only
(never ``multimem`` instructions).
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from dpcourse.comm.kernels.schedule import half_offset

MULTICAST_OFF = {"TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NCCL_NVLS_ENABLE": "0",
                 "NVSHMEM_DISABLE_NVLS": "1"}
MIN_BYTES = 1 << 20


def process_group(group: dist.ProcessGroup | None) -> dist.ProcessGroup:
    """Return ``group``, or the default group for ``None`` (it must be initialised)."""
    pg = group if group is not None else dist.group.WORLD
    if pg is None:
        raise RuntimeError("the NVLink kernels need a process group: run them on ranks "
                           "started by dpcourse.run or after dist.init_process_group.")
    return pg


def require_multicast_off() -> None:
    """Set the variables that keep NVLink multicast off where unset; refuse any other value.

    Call it before the process group starts (child processes inherit it);
    calling it later still sets the variables for symmetric-memory rendezvous.

    Raises:
        RuntimeError: one of the variables is set to a value that allows multicast.
    """
    for key, value in MULTICAST_OFF.items():
        have = os.environ.setdefault(key, value)
        if have != value:
            raise RuntimeError(
                f"{key}={have} allows NVLink multicast, which these kernels refuse to use: "
                f"start the processes with {key}={value}.")


class Workspace:
    """A symmetric buffer of at least ``nbytes`` on this rank's device, rendezvoused over ``group``.

    Attributes:
        buffer: the local buffer (uint8).
        pad: the local signal pad (int32, zeros between calls).
        pad_deltas: int64 tensor on the device, rank ``p``'s pad minus ours, in int32 slots.
        rank, world_size: this rank and the group's size.
        max_blocks: the most blocks a kernel may launch (flag slots ``block * world + peer``).
        calls: calls through this workspace so far (they alternate between its two halves).
    """

    def __init__(self, nbytes: int, group, device: torch.device):
        import torch.distributed._symmetric_memory as symm_mem

        require_multicast_off()
        self.group = process_group(group)
        self.nbytes = max(MIN_BYTES, 1 << max(0, int(nbytes) - 1).bit_length())
        self.buffer = symm_mem.empty(self.nbytes, dtype=torch.uint8, device=device)
        self.handle = symm_mem.rendezvous(self.buffer, self.group)
        self.rank, self.world_size = self.handle.rank, self.handle.world_size
        self.pad = self.handle.get_signal_pad(self.rank, dtype=torch.int32)
        # Signal pads hold zeros after allocation and after every barrier; no reset needed.
        self.pad_deltas = _offsets(self.handle.signal_pad_ptrs, self.rank, 4, device)
        self._buf_deltas: dict[int, torch.Tensor] = {}
        self._device = device
        # Every block must be resident at once (blocks spin on flags): at most one per SM,
        # and one flag slot per (block, peer) on the pad.
        sms = torch.cuda.get_device_properties(device).multi_processor_count
        self.max_blocks = min(sms, self.pad.numel() // self.world_size)
        self.calls = 0
        self._views: dict = {}

    def deltas(self, element_size: int) -> torch.Tensor:
        """Return each rank's buffer minus ours, in elements of ``element_size`` bytes (on device)."""
        if element_size not in self._buf_deltas:
            self._buf_deltas[element_size] = _offsets(self.handle.buffer_ptrs, self.rank,
                                                      element_size, self._device)
        return self._buf_deltas[element_size]

    def next_half(self, dtype: torch.dtype, numel: int) -> torch.Tensor:
        """Return the first ``numel`` elements of this call's half of the buffer; count the call.

        Every rank makes the same calls, so every rank picks the same half.
        Why two fixed halves: :func:`~dpcourse.comm.kernels.schedule.half_offset`.
        """
        view = self.halves(dtype, numel)[self.calls % 2]
        self.calls += 1
        return view

    def halves(self, dtype: torch.dtype, numel: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Return the first ``numel`` elements of each half of the buffer, as ``dtype``."""
        half_len = (self.nbytes // 2) // dtype.itemsize
        if numel > half_len:
            raise ValueError(f"{numel} elements do not fit in half of a {self.nbytes}-byte "
                             "workspace: ask get_workspace for twice the bytes of a call.")
        first, second = (self.view(dtype, numel, offset=half_offset(call, half_len))
                         for call in (0, 1))
        return first, second

    def view(self, dtype: torch.dtype, numel: int, offset: int = 0) -> torch.Tensor:
        """Return ``numel`` elements of the local buffer as ``dtype``, starting at element ``offset``."""
        key = (dtype, numel, offset)
        view = self._views.get(key)
        if view is None:  # cached: making a view costs microseconds, on every call
            if len(self._views) > 64:
                self._views.clear()
            view = self._views[key] = self.buffer.view(dtype)[offset:offset + numel]
        return view


def _offsets(ptrs, rank: int, element_size: int, device) -> torch.Tensor:
    """Return ``(ptrs[p] - ptrs[rank]) / element_size`` for every ``p`` as an int64 device tensor."""
    base = ptrs[rank]
    if any((p - base) % element_size for p in ptrs):
        raise RuntimeError("peer mappings are not aligned to the element size.")
    return torch.tensor([(p - base) // element_size for p in ptrs], dtype=torch.int64,
                        device=device)


# Cached workspaces: {(group name, device index): Workspace}. A cache, not state the
# results depend on: dropping it (release_workspaces) only costs a new rendezvous.
_CACHE: dict = {}
# Tensors that live in symmetric memory of their own, for the whole process: {data_ptr: Workspace}.
_SYMMETRIC: dict = {}
# Launch plans of the all-reduce kernels (dpcourse.comm.kernels.allreduce keeps them here), each
# bound to addresses in one workspace: emptied whenever a workspace is replaced or released and
# whenever a symmetric tensor is made, so a plan never launches on memory that moved.
PLANS: dict = {}


def cache_key(group, device_index: int) -> tuple:
    """Return the key under which :func:`get_workspace` keeps ``group``'s workspace on a device."""
    return (id(group), device_index)


def get_workspace(nbytes: int, group, device: torch.device) -> Workspace:
    """Return this rank's cached workspace for ``group`` with at least ``nbytes``; grow if needed.

    Collective when it allocates (the first call, or a call that needs more
    memory): every rank of ``group`` must make the same calls, as for any
    collective. Growing waits for the device and the group first, so no peer
    is still reading the old buffer when it is freed.
    """
    key = cache_key(group, device.index)
    ws = _CACHE.get(key)  # fast path: no c10d calls
    if ws is not None and ws.nbytes >= nbytes and (group is None or ws.group is group):
        return ws
    pg = process_group(group)
    ws = _CACHE.get(key)
    if ws is not None and ws.group is not pg:  # a new default group under the same key
        ws = None
    if ws is not None:
        torch.cuda.synchronize(device)
        dist.barrier(group=pg)
        del ws
    PLANS.clear()
    _CACHE[key] = Workspace(nbytes, pg, device)
    return _CACHE[key]


def release_workspaces() -> None:
    """Free the cached workspaces of this process (after the GPU has finished with them)."""
    if _CACHE and torch.cuda.is_available():
        torch.cuda.synchronize()
    PLANS.clear()
    _CACHE.clear()


def symmetric_empty(numel: int, dtype: torch.dtype = torch.float32, group=None) -> torch.Tensor:
    """Return an uninitialised 1-D tensor that lives in symmetric memory (collective).

    The two-shot kernel reduces such a tensor in place without copying it in
    and out of a workspace (e.g. a DDP bucket allocated here). The tensor and
    its memory stay until the process ends: freeing symmetric memory that a
    peer's kernel may still load from or store into needs every rank to agree
    first (as :func:`get_workspace` waits before it replaces a workspace), and
    these tensors have no collective release.

    Args:
        numel: number of elements.
        dtype: element type.
        group: the process group whose ranks map it; ``None`` means the default group.
    """
    device = torch.device("cuda", torch.cuda.current_device())
    element = torch.empty((), dtype=dtype).element_size()
    ws = Workspace(max(1, numel) * element, group, device)
    tensor = ws.view(dtype, numel)  # the workspace keeps it (and so itself) alive
    PLANS.clear()
    _SYMMETRIC[tensor.data_ptr()] = ws
    return tensor


def symmetric_allocation(tensor: torch.Tensor) -> Workspace | None:
    """Return the workspace ``tensor`` starts when it came from :func:`symmetric_empty` (any group)."""
    return _SYMMETRIC.get(tensor.data_ptr())


def symmetric_workspace_of(tensor: torch.Tensor, group) -> Workspace | None:
    """Return the workspace ``tensor`` lives in when it came from :func:`symmetric_empty`."""
    ws = symmetric_allocation(tensor)
    if ws is None:
        return None
    pg = process_group(group)
    if ws.group is not pg or not tensor.is_contiguous():
        return None
    return ws
