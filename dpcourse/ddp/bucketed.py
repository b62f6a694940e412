"""DataParallelBucketed: one all-reduce per bucket of gradients instead of one per parameter.

Gradients live in a few flat buffers (see :mod:`dpcourse.ddp.buckets`); each
``param.grad`` is a *view* into its bucket's buffer, so the bucket is reduced
in place with a single collective and no gradient is stored twice (torch DDP
calls this ``gradient_as_bucket_view=True``). A post-accumulate-grad hook on
every parameter keeps each gradient in its bucket and records that it needs
averaging; when backward ends, a callback averages the buckets one by one.
Communication still waits for the end of backward;
:class:`~dpcourse.ddp.DataParallelOverlapped` starts it earlier.

torch DDP's further options (``Join``, communication hooks, unused parameters,
the first bucket's size, bucket rebuilds) are the
:class:`~dpcourse.ddp.reducer.Reducer`'s, lesson 11.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.autograd import Variable
from torch.distributed.algorithms.join import Joinable

from dpcourse.comm.collective import AllReduce
from dpcourse.ddp import guards, torch_interface
from dpcourse.ddp.broadcast import broadcast_module_state
from dpcourse.ddp.buckets import attach_grads_to_buckets
from dpcourse.ddp.grad_hooks import hook_every_parameter
from dpcourse.ddp.reducer import Reducer

class DataParallelBucketed(nn.Module, Joinable):
    """Average gradients after backward with one all-reduce per flat bucket.

    Args:
        module: the model, already on this rank's device.
        bucket_cap_mb: a bucket closes once it holds at least this many MiB
            (it may exceed the cap by its last tensor); 0 gives one bucket per
            parameter, ``math.inf`` one bucket per dtype and device.
        group: process group to average over (``None``: the default group).
        all_reduce: collective ``fn(tensor, group=None)`` summing in place
            (default ``torch.distributed.all_reduce``).
        **options: torch DDP's options, see :class:`~dpcourse.ddp.reducer.Reducer`
            (``broadcast_buffers``, ``find_unused_parameters``, ``static_graph``,
            ``first_bucket_mb``, ``rebuild_buckets``, ``gradient_as_bucket_view``).

    Attributes:
        module: the wrapped model.
        buckets: list of :class:`~dpcourse.ddp.buckets.Bucket` in reduction order
            (``.names``, ``.nbytes``, ``.buffer``).
        require_backward_grad_sync: False inside :meth:`no_sync`.
        reducer: the :class:`~dpcourse.ddp.reducer.Reducer` of torch's options.
        trace: optionally a :class:`dpcourse.comm.CommTrace`; the wrapper marks
            ``"backward_end"`` on it when autograd has computed every gradient and
            ``"sync_end"`` when the gradients are averaged.
    """

    def __init__(self, module: nn.Module, *, bucket_cap_mb: float = 25.0,
                 group: dist.ProcessGroup | None = None, all_reduce: AllReduce | None = None,
                 **options: Any):
        nn.Module.__init__(self)
        self.module, self.reducer = module, Reducer(self, module, group, all_reduce, bucket_cap_mb,
                                                    **options)
        # 1. Every replica starts from rank 0's parameters and buffers.
        broadcast_module_state(module, group)
        # 2. Flat buckets, filled in reverse registration order.
        self.buckets, self._where = self.reducer.make_buckets()
        # 3. Where this rank is in the step.
        self._sync_this_backward = True   # the last forward was outside no_sync
        self._in_backward = False         # a synchronised backward is running
        self._unsynced: set[int] = set()  # params with a gradient not yet averaged
        # 4. A hook on every trainable parameter.
        self._hook_handles = hook_every_parameter(self, self._gradient_ready)  # held weakly

    def forward(self, *args, **kwargs):
        """Run the wrapped module; first re-point each ``param.grad`` at its bucket."""
        self._in_backward = False  # a previous backward that raised left nothing in flight
        self._sync_this_backward = self.reducer.pre_forward()
        if torch.is_grad_enabled():
            if self.reducer.rebuild_pending and self.reducer.arrival:  # lesson 11
                self.buckets, self._where = self.reducer.rebuild()
            if self.reducer.gradient_as_bucket_view:
                attach_grads_to_buckets(self.buckets)
        output = self.module(*args, **kwargs)
        return self.reducer.post_forward(output, self._sync_this_backward)  # unused parameters

    def _gradient_ready(self, index: int, param: nn.Parameter) -> None:
        """The hook: keep parameter ``index``'s new gradient in its bucket, to average after backward."""
        if self._sync_this_backward and not self._in_backward:
            self._start_backward()
        b, k = self._where[index]
        if self.reducer.gradient_as_bucket_view and param.grad is not self.buckets[b].views[k]:
            self.buckets[b].attach_grad(k)  # autograd made a new tensor: into the bucket
        self._unsynced.add(index)
        self.reducer.note_used(index)
        if self._sync_this_backward:
            self.reducer.note_ready(index)

    def _start_backward(self) -> None:
        """The first gradient of a synchronised backward: sync once autograd is done."""
        guards.check_backward_start(self)
        self._in_backward = True
        Variable._execution_engine.queue_callback(self._backward_end)
        for i in self.reducer.unused_at_forward:  # find_unused_parameters: zeros, ready now
            if i not in self._unsynced:
                self._unsynced.add(i)
                self.reducer.note_ready(i)

    def finish_gradient_synchronization(self) -> None:
        """All-reduce the buckets, one after the other: every gradient since the last synchronisation.

        Called by autograd once a backward outside :meth:`no_sync` is done, and
        idempotent; call it yourself after a ``no_sync`` backward to average at once.
        """
        self._in_backward = False
        with self.reducer.synchronizing() as anything_to_average:
            if not anything_to_average:
                return
            for bucket in self.buckets:  # one collective per bucket, divided first
                work = bucket.launch(self.reducer.all_reduce, self.reducer.divisor(), async_op=False,
                                     comm_hook=self.reducer.reduce_hook())
                if work is not None:
                    work.wait()  # a hook's result, or separate gradients copied back

    # -- torch DDP's interface (lessons 07, 10, 11), the same in every wrapper ------
    require_backward_grad_sync, trace = True, None  # False inside no_sync(); a CommTrace
    no_sync, register_comm_hook = torch_interface.no_sync, torch_interface.register_comm_hook
    join_hook, join_device, join_process_group = torch_interface.JOINABLE
    _backward_end = torch_interface.finish_after_backward  # autograd's end-of-backward callback
    _remove_hooks = torch_interface.remove_hooks
