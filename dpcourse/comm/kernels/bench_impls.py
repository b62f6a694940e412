"""The kernels as benchmark rows, beside PyTorch's own symmetric-memory all-reduces as anchors.

Every entry has ``dist.all_reduce``'s signature ``fn(tensor, group=None)``:

* ``one_shot``, ``two_shot``: our kernels on the tensor given (an ordinary
  tensor: copied into the workspace and back inside the kernel);
* ``two_shot_symm``: our two-shot on a tensor that already lives in symmetric
  memory (no copies), as when buckets are allocated there;
* ``torch_one_shot``, ``torch_two_shot``: ``torch.ops.symm_mem.one_shot_all_reduce``
  and ``two_shot_all_reduce_`` (CUDA kernels with peer loads and stores, no
  multicast), which also need their input in symmetric memory.

The symmetric-memory rows reduce a resident tensor of the same size and dtype
instead of the one given (allocated at the first call of each size): they
time the collective, not a usable in-place call.
"""

from __future__ import annotations

import torch

from dpcourse.comm.kernels.allreduce import one_shot_all_reduce, two_shot_all_reduce
from dpcourse.comm.kernels.workspace import process_group


class _Resident:
    """Call ``op(resident, group)`` on a symmetric tensor shaped like the argument."""

    def __init__(self, op, allocate):
        self.op, self.allocate, self.key, self.tensor = op, allocate, None, None

    def __call__(self, tensor: torch.Tensor, group=None) -> None:
        key = (tensor.numel(), tensor.dtype, id(group))
        if key != self.key:  # one size at a time: free the previous one first
            self.tensor = None
            self.tensor = self.allocate(tensor.numel(), tensor.dtype, group)
            self.tensor.copy_(tensor.view(-1))
            self.key = key
        self.op(self.tensor, group)


def _ours(numel, dtype, group):
    from dpcourse.comm.kernels.workspace import symmetric_empty

    return symmetric_empty(numel, dtype=dtype, group=group)


def _torch_buffer(numel, dtype, group):
    import torch.distributed._symmetric_memory as symm_mem

    from dpcourse.comm.kernels.workspace import require_multicast_off

    require_multicast_off()
    device = torch.device("cuda", torch.cuda.current_device())
    t = symm_mem.empty(numel, dtype=dtype, device=device)
    symm_mem.rendezvous(t, process_group(group))
    return t


def _group_name(group) -> str:
    return process_group(group).group_name


def kernel_impls() -> dict:
    """Return ``{name: fn(tensor, group=None)}`` for the kernel rows (see the module docstring)."""
    return {
        "one_shot": one_shot_all_reduce,
        "two_shot": two_shot_all_reduce,
        "two_shot_symm": _Resident(two_shot_all_reduce, _ours),
        "torch_one_shot": _Resident(lambda t, g: torch.ops.symm_mem.one_shot_all_reduce(
            t, "sum", _group_name(g)), _torch_buffer),
        "torch_two_shot": _Resident(lambda t, g: torch.ops.symm_mem.two_shot_all_reduce_(
            t, "sum", _group_name(g)), _torch_buffer),
    }
