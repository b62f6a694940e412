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

import contextlib
import weakref
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.autograd import Variable
from torch.distributed.algorithms.join import Joinable, JoinHook
from torch.utils.hooks import RemovableHandle

from dpcourse.comm.p2p import AllReduce
from dpcourse.ddp import guards
from dpcourse.ddp.broadcast import broadcast_module_state
from dpcourse.ddp.buckets import attach_grads_to_buckets, check_bucket_cap
from dpcourse.ddp.grad_hooks import take_over
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
        **torch_options: torch DDP's options, see :class:`~dpcourse.ddp.reducer.Reducer`
            (``broadcast_buffers``, ``find_unused_parameters``, ``static_graph``,
            ``first_bucket_mb``, ``rebuild_buckets``, ``gradient_as_bucket_view``).

    Attributes:
        module: the wrapped model.
        buckets: list of :class:`~dpcourse.ddp.buckets.Bucket` in reduction order
            (``.names``, ``.nbytes``, ``.buffer``).
        bucket_cap_mb: the cap used.
        require_backward_grad_sync: False inside :meth:`no_sync`.
        reducer: the :class:`~dpcourse.ddp.reducer.Reducer` of torch's options.
        trace: optionally a :class:`dpcourse.comm.CommTrace`; the wrapper marks
            ``"backward_end"`` on it when autograd has computed every gradient and
            ``"sync_end"`` when the gradients are averaged.
    """

    def __init__(self, module: nn.Module, *, bucket_cap_mb: float = 25.0,
                 group: dist.ProcessGroup | None = None, all_reduce: AllReduce | None = None,
                 **torch_options: Any):
        self.bucket_cap_mb = check_bucket_cap(bucket_cap_mb)  # before any communication
        nn.Module.__init__(self)
        self._named_params = guards.check_wrappable(module, group, all_reduce)
        guards.check_same_model(module, group, self._named_params[0][1].device)
        self.module, self.group, self.world_size = module, group, dist.get_world_size(group)
        self._custom_all_reduce = all_reduce
        self.require_backward_grad_sync = True
        self.trace: Any = None
        self.reducer = Reducer(self, **torch_options)
        # 1. Every replica starts from rank 0's parameters and buffers.
        broadcast_module_state(module, group)
        # 2. Flat buckets, filled in reverse registration order.
        self.buckets, self._where = self.reducer.make_buckets(self.bucket_cap_mb)
        # 3. Where this rank is in the step.
        self._sync_this_backward = True   # the last forward was outside no_sync
        self._forward_pending = False     # a forward whose backward has not synchronised yet
        self._in_backward = False         # a synchronised backward is running
        self._unsynced: set[int] = set()  # params with a gradient not yet averaged
        self._replaced = False            # True once a newer wrapper took this module over
        # 4. A hook on every trainable parameter (held weakly: a discarded wrapper is freed).
        take_over(module, self)  # wrapping a module again unhooks the older wrapper
        ready = weakref.WeakMethod(self._gradient_ready)
        self._hook_handles: list[RemovableHandle] = [
            p.register_post_accumulate_grad_hook(
                lambda p, i=i: None if ready() is None else ready()(i, p))  # type: ignore[misc]
            for i, (_, p) in enumerate(self._named_params)]
        self._step_guard: RemovableHandle
        guards.install_step_guard(self)

    def forward(self, *args, **kwargs):
        """Run the wrapped module (after torch's forward-time collectives, see the Reducer)."""
        guards.check_forward(self)
        self._in_backward = False  # a previous backward that raised left nothing in flight
        self.reducer.pre_forward()  # Join's flags and the buffers, in torch's order
        if torch.is_grad_enabled():  # a no-grad forward (evaluation) leaves pending work alone
            self._sync_this_backward = self.require_backward_grad_sync
            self._forward_pending = self._sync_this_backward
            if self.reducer.rebuild_pending and self.reducer.arrival:  # lesson 11
                self.buckets, self._where = self.reducer.rebuild(self.bucket_cap_mb)
            if self.reducer.gradient_as_bucket_view:
                attach_grads_to_buckets(self.buckets)
        output = self.module(*args, **kwargs)
        self.reducer.post_forward(output, self._sync_this_backward)
        return output

    def _gradient_ready(self, index: int, param: nn.Parameter) -> None:
        """The hook: ``param.grad`` now holds this backward's gradient of parameter ``index``."""
        if self._sync_this_backward and not self._in_backward:
            self._start_backward()
        self._unsynced.add(index)
        self.reducer.note_used(index)
        b, k = self._where[index]
        if self.reducer.gradient_as_bucket_view and param.grad is not self.buckets[b].views[k]:
            self.buckets[b].attach_grad(k)  # autograd made a new tensor: into the bucket
        if self._sync_this_backward:
            self.reducer.note_ready(index)

    def _start_backward(self) -> None:
        """The first gradient of a synchronised backward: sync once autograd is done."""
        guards.check_backward_start(self)
        self._forward_pending = False
        self._in_backward = True
        Variable._execution_engine.queue_callback(self._backward_end)
        for i in self.reducer.unused_at_forward:  # find_unused_parameters: zeros, ready now
            if i not in self._unsynced:
                self._unsynced.add(i)
                self.reducer.note_ready(i)

    def _backward_end(self) -> None:
        """Runs inside the autograd engine once backward has computed every gradient."""
        self._in_backward = False
        if self.trace is not None:
            self.trace.mark("backward_end")
        self.finish_gradient_synchronization()
        if self.trace is not None:
            self.trace.mark("sync_end")

    def finish_gradient_synchronization(self) -> None:
        """Average, across ranks, every gradient accumulated since the last synchronisation.

        Called automatically at the end of each ``loss.backward()`` outside
        :meth:`no_sync`; calling it again does nothing. Calling it after a backward
        inside ``no_sync`` averages the accumulated gradients right away.
        """
        if not self._unsynced:
            return
        self.reducer.before_sync(self._unsynced)
        try:
            guards.check_all_gradients(self)
        except RuntimeError:
            self._unsynced.clear()
            raise
        reduced = False
        try:
            for bucket in self.buckets:  # one collective per bucket, divided first
                bucket.launch(self.all_reduce, self.reducer.divisor(), async_op=False,
                              comm_hook=self.reducer.reduce_hook())
                bucket.wait()  # a hook's result, or separate gradients copied back
                bucket.reset()
            reduced = True
        finally:
            self._unsynced.clear()
            self.reducer.after_sync(reduced)

    def all_reduce(self, tensor: torch.Tensor, async_op: bool = False):
        """Sum ``tensor`` in place over the group with the configured collective.

        Args:
            tensor: contiguous tensor, summed in place.
            async_op: return a work handle instead of blocking (only for the default
                ``dist.all_reduce``; a custom ``all_reduce=`` always runs to completion).

        Returns:
            A work handle when ``async_op`` and the default collective are used, else ``None``.
        """
        if self._custom_all_reduce is None:
            # Looked up at call time so that CommTrace sees the call.
            return dist.all_reduce(tensor, group=self.group, async_op=async_op)
        self._custom_all_reduce(tensor, group=self.group)
        return None

    @contextlib.contextmanager
    def no_sync(self):
        """Skip gradient communication for forward/backward passes run inside this context.

        Gradients accumulate locally in ``param.grad``; the first backward after
        leaving the context averages the accumulated sum. As in torch DDP, the
        decision is taken at forward time: run the forward inside the context too.
        """
        old = self.require_backward_grad_sync
        self.require_backward_grad_sync = False
        try:
            yield
        finally:
            self.require_backward_grad_sync = old

    # -- torch DDP's interface for lessons 10 and 11 (the Reducer does the work) --
    def register_comm_hook(self, state: Any, hook) -> None:
        """Let ``hook(state, bucket) -> Future[Tensor]`` reduce each bucket (torch's API)."""
        self.reducer.register_comm_hook(state, hook)

    def join_hook(self, **kwargs) -> JoinHook:
        """The hook ``Join`` calls once this rank has run out of data (see :mod:`dpcourse.ddp.join`)."""
        return self.reducer.join_hook(**kwargs)

    @property
    def join_device(self) -> torch.device:
        """Device of the gradients (where Join's flags live)."""
        return self.reducer.device

    @property
    def join_process_group(self):
        """The group the wrapper averages over."""
        return self.group if self.group is not None else dist.group.WORLD

    def _remove_hooks(self) -> None:
        for h in self._hook_handles:
            h.remove()
        self._hook_handles = []
        self._step_guard.remove()
        self._replaced = True
