"""DataParallelNaive: data parallelism in its simplest correct form.

Every rank holds a full replica. At construction rank 0's parameters and
buffers are broadcast, so all replicas start equal; after each backward every
gradient is averaged with one all-reduce per parameter, so every rank takes the
same optimizer step and the replicas stay equal.

How "after each backward" happens without an extra call in the training loop:
a *post-accumulate-grad hook* on every parameter tells the wrapper that a
gradient has arrived; the first one of a backward queues a callback on the
autograd engine, which runs it once the whole backward is done, before
``loss.backward()`` returns. That callback averages the gradients.

This is correct but slow: one collective per parameter pays the per-message
latency many times over, and communication only starts once backward is over.
:class:`~dpcourse.ddp.DataParallelBucketed` and
:class:`~dpcourse.ddp.DataParallelOverlapped` fix those two problems. torch
DDP's further options (``Join``, communication hooks, unused parameters) are
the :class:`~dpcourse.ddp.reducer.Reducer`'s, lessons 10 and 11.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.autograd import Variable
from torch.distributed.algorithms.join import Joinable

from dpcourse.comm.averaging import divide_before_sum
from dpcourse.comm.collective import AllReduce
from dpcourse.ddp import guards, torch_interface
from dpcourse.ddp.broadcast import broadcast_module_state
from dpcourse.ddp.buckets import Bucket
from dpcourse.ddp.grad_hooks import hook_every_parameter
from dpcourse.ddp.reducer import Reducer


class DataParallelNaive(nn.Module, Joinable):
    """Wrap a module so that ``loss.backward()`` leaves the rank-averaged gradient in ``.grad``.

    A drop-in for ``torch.nn.parallel.DistributedDataParallel`` in a training
    loop: no extra call is needed after ``loss.backward()``.

    Args:
        module: the model, already on this rank's device.
        group: process group to average over (``None``: the default group).
        all_reduce: collective used for each gradient, called as
            ``all_reduce(tensor, group=group)`` and summing in place like
            ``torch.distributed.all_reduce`` (e.g. ``dpcourse.comm.ring_all_reduce``);
            ``None`` uses ``torch.distributed.all_reduce``.
        **options: ``broadcast_buffers``, ``find_unused_parameters``,
            ``static_graph``: as in torch DDP (see :class:`~dpcourse.ddp.reducer.Reducer`).

    Attributes:
        module: the wrapped model.
        require_backward_grad_sync: False inside :meth:`no_sync`.
        reducer: the :class:`~dpcourse.ddp.reducer.Reducer` of torch's options. A
            communication hook (:meth:`register_comm_hook`) sees each parameter as a
            bucket of its own.
        trace: optionally a :class:`dpcourse.comm.CommTrace`; the wrapper marks
            ``"backward_end"`` and ``"sync_end"`` on it.
    """

    def __init__(self, module: nn.Module, *, group: dist.ProcessGroup | None = None,
                 all_reduce: AllReduce | None = None, **options: Any):
        nn.Module.__init__(self)
        self.module, self.reducer = module, Reducer(self, module, group, all_reduce, **options)
        # 1. Every replica starts from rank 0's parameters and buffers.
        broadcast_module_state(module, group)
        # 2. Where this rank is in the step (torch decides at forward time whether the
        #    next backward synchronises).
        self._sync_this_backward = True   # the last forward was outside no_sync
        self._in_backward = False         # a synchronised backward is running
        self._unsynced: set[int] = set()  # params with a gradient not yet averaged
        # 3. A hook on every trainable parameter.
        self._hook_handles = hook_every_parameter(self, self._gradient_ready)  # held weakly

    def forward(self, *args, **kwargs):
        """Run the wrapped module, after the collectives torch DDP issues before a forward.

        Those are :meth:`Reducer.pre_forward`'s (rank 0's buffers, Join's flags). It also
        reads the flag ``no_sync()`` sets: it decides whether the next backward averages.
        """
        self._sync_this_backward = self.reducer.pre_forward()
        self._in_backward = False  # a previous backward that raised left nothing in flight
        output = self.module(*args, **kwargs)
        return self.reducer.post_forward(output, self._sync_this_backward)  # unused parameters

    def _gradient_ready(self, index: int, param: nn.Parameter) -> None:
        """The hook: ``param.grad`` now holds this backward's gradient of parameter ``index``."""
        if self._sync_this_backward and not self._in_backward:
            # The first gradient of a synchronised backward: average once autograd is done.
            guards.check_backward_start(self)
            self._in_backward = True
            Variable._execution_engine.queue_callback(self._backward_end)
            self._unsynced.update(self.reducer.unused_at_forward)  # find_unused_parameters
        self._unsynced.add(index)
        self.reducer.note_used(index)

    def finish_gradient_synchronization(self) -> None:
        """Average every gradient that arrived since the last synchronisation, one all-reduce each.

        Runs by itself at the end of each ``loss.backward()`` outside :meth:`no_sync`
        (a second call does nothing); after a backward inside ``no_sync`` it averages
        the accumulated gradients at once.
        """
        self._in_backward = False
        with self.reducer.synchronizing() as anything_to_average:
            if anything_to_average:
                self._average_every_gradient()

    @torch.no_grad()
    def _average_every_gradient(self) -> None:
        """One all-reduce per parameter, registration order."""
        divisor, hook = self.reducer.divisor(), self.reducer.reduce_hook()
        for i, (name, p) in enumerate(self.reducer.named_params):
            if p.grad is None:  # unused on this rank (find_unused_parameters): contribute zeros
                p.grad = torch.zeros_like(p)
            grad = p.grad
            # Collectives need contiguous memory; a strided gradient is reduced via a copy.
            buf = grad if grad.is_contiguous() else grad.contiguous()
            if hook is not None:  # a communication hook: each parameter a bucket of its own
                work = hook(Bucket(i, [i], [name], [p], buf.view(-1), [buf]))
                if work is not None:
                    work.wait()
            else:
                # Divide before summing, as torch DDP does (why: dpcourse.comm.averaging).
                divide_before_sum(buf, divisor)
                self.reducer.all_reduce(buf)
            if buf is not grad:
                grad.copy_(buf)

    # -- torch DDP's interface (lessons 07, 10, 11), the same in every wrapper ------
    require_backward_grad_sync, trace = True, None  # False inside no_sync(); a CommTrace
    no_sync, register_comm_hook = torch_interface.no_sync, torch_interface.register_comm_hook
    join_hook, join_device, join_process_group = torch_interface.JOINABLE
    _backward_end = torch_interface.finish_after_backward  # autograd's end-of-backward callback
    _remove_hooks = torch_interface.remove_hooks
