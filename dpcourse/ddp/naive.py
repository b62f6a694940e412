"""DataParallelNaive: data parallelism in its simplest correct form.

Every rank holds a full replica. At construction rank 0's parameters and
buffers are broadcast, so all replicas start equal; after each backward every
gradient is averaged with one all-reduce per parameter, so every rank takes the
same optimizer step and the replicas stay equal.

This is correct but slow: one collective per parameter pays the per-message
latency many times over, and communication only starts once backward is over.
:class:`~dpcourse.ddp.DataParallelBucketed` and
:class:`~dpcourse.ddp.DataParallelOverlapped` fix those two problems.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from dpcourse.comm.p2p import AllReduce
from dpcourse.ddp.base import DataParallelBase


class DataParallelNaive(DataParallelBase):
    """Wrap a module so that ``loss.backward()`` leaves the rank-averaged gradient in ``.grad``.

    A drop-in for ``torch.nn.parallel.DistributedDataParallel`` in a training
    loop: no extra call is needed after ``loss.backward()``. The averaging runs
    in a callback the autograd engine calls when backward ends (see
    :mod:`dpcourse.ddp.base` for the mechanism).

    Args:
        module: the model, already on this rank's device.
        group: process group to average over (``None``: the default group).
        all_reduce: collective used for each gradient, called as
            ``all_reduce(tensor, group=group)`` and summing in place like
            ``torch.distributed.all_reduce`` (e.g. ``dpcourse.comm.ring_all_reduce``);
            ``None`` uses ``torch.distributed.all_reduce``.
    """

    def __init__(self, module: nn.Module, *, group: dist.ProcessGroup | None = None,
                 all_reduce: AllReduce | None = None):
        super().__init__(module, group=group, all_reduce=all_reduce)

    @torch.no_grad()
    def _reduce(self) -> None:
        for _, p in self._named_params:
            grad = p.grad
            assert grad is not None  # every parameter has one: checked before reducing
            # Collectives need contiguous memory; a strided gradient is reduced via a copy.
            buf = grad if grad.is_contiguous() else grad.contiguous()
            # Divide BEFORE summing (as torch DDP does): the sum of N already-scaled
            # values stays in the range of one gradient, which matters in fp16/bf16
            # where summing first can overflow. In fp32 either order gives the mean.
            buf.div_(self.world_size)
            self.all_reduce(buf)
            if buf is not grad:
                grad.copy_(buf)
