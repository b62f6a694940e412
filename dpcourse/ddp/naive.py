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

from dpcourse.comm.averaging import divide_before_sum
from dpcourse.comm.p2p import AllReduce
from dpcourse.ddp.base import DataParallelBase
from dpcourse.ddp.comm_hooks import launch_comm_hook


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
        broadcast_buffers, find_unused_parameters, static_graph: as in torch DDP
            (see :class:`~dpcourse.ddp.base.DataParallelBase`).

    A communication hook (:meth:`register_comm_hook`) sees each parameter as a
    bucket of its own.
    """

    def __init__(self, module: nn.Module, *, group: dist.ProcessGroup | None = None,
                 all_reduce: AllReduce | None = None, broadcast_buffers: bool = True,
                 find_unused_parameters: bool = False, static_graph: bool = False):
        super().__init__(module, group=group, all_reduce=all_reduce,
                         broadcast_buffers=broadcast_buffers,
                         find_unused_parameters=find_unused_parameters, static_graph=static_graph)

    @torch.no_grad()
    def _reduce(self) -> None:
        divisor = self._gradient_divisor()
        last = len(self._named_params) - 1
        for i, (_, p) in enumerate(self._named_params):
            if p.grad is None:  # unused on this rank (find_unused_parameters): contribute zeros
                p.grad = torch.zeros_like(p)
            grad = p.grad
            # Collectives need contiguous memory; a strided gradient is reduced via a copy.
            buf = grad if grad.is_contiguous() else grad.contiguous()
            if self._comm_hook is not None:  # each parameter is a bucket of its own
                launch_comm_hook(self._comm_hook, self._comm_hook_state, i, buf.view(-1),
                                 [buf], [p], i == last).wait()
                if buf is not grad:
                    grad.copy_(buf)
                continue
            # Divide before summing, as torch DDP does (why: dpcourse.comm.averaging).
            divide_before_sum(buf, divisor)
            self.all_reduce(buf)
            if buf is not grad:
                grad.copy_(buf)

    @torch.no_grad()
    def _shadow_reduce(self) -> None:
        last = len(self._named_params) - 1
        for i, (_, p) in enumerate(self._named_params):
            zeros = torch.zeros_like(p, memory_format=torch.contiguous_format)
            if self._comm_hook is not None:
                launch_comm_hook(self._comm_hook, self._comm_hook_state, i, zeros.view(-1),
                                 [zeros], [p], i == last).wait()
            else:
                self.all_reduce(zeros)
