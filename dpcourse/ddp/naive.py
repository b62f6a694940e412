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

import contextlib
import weakref
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.autograd import Variable
from torch.distributed.algorithms.join import Joinable, JoinHook
from torch.utils.hooks import RemovableHandle

from dpcourse.comm.averaging import divide_before_sum
from dpcourse.comm.p2p import AllReduce
from dpcourse.ddp import guards
from dpcourse.ddp.broadcast import broadcast_module_state
from dpcourse.ddp.buckets import Bucket
from dpcourse.ddp.grad_hooks import take_over
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
        **torch_options: ``broadcast_buffers``, ``find_unused_parameters``,
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
                 all_reduce: AllReduce | None = None, **torch_options: Any):
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
        # 2. Where this rank is in the step (torch decides at forward time whether the
        #    next backward synchronises).
        self._sync_this_backward = True   # the last forward was outside no_sync
        self._forward_pending = False     # a forward whose backward has not synchronised yet
        self._in_backward = False         # a synchronised backward is running
        self._unsynced: set[int] = set()  # params with a gradient not yet averaged
        self._replaced = False            # True once a newer wrapper took this module over
        # 3. A hook on every trainable parameter (held weakly: a discarded wrapper is freed).
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
        self.reducer.pre_forward()  # rank 0's buffers (and Join's flags), in torch's order
        if torch.is_grad_enabled():  # a no-grad forward (evaluation) leaves pending work alone
            self._sync_this_backward = self.require_backward_grad_sync
            self._forward_pending = self._sync_this_backward
        output = self.module(*args, **kwargs)
        self.reducer.post_forward(output, self._sync_this_backward)
        return output

    def _gradient_ready(self, index: int, param: nn.Parameter) -> None:
        """The hook: ``param.grad`` now holds this backward's gradient of parameter ``index``."""
        if self._sync_this_backward and not self._in_backward:
            # The first gradient of a synchronised backward: average once autograd is done.
            guards.check_backward_start(self)
            self._forward_pending = False
            self._in_backward = True
            Variable._execution_engine.queue_callback(self._backward_end)
            self._unsynced.update(self.reducer.unused_at_forward)  # find_unused_parameters
        self._unsynced.add(index)
        self.reducer.note_used(index)

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
            self._average_every_gradient()
            reduced = True
        finally:
            self._unsynced.clear()
            self.reducer.after_sync(reduced)

    @torch.no_grad()
    def _average_every_gradient(self) -> None:
        """One all-reduce per parameter, registration order."""
        divisor, hook = self.reducer.divisor(), self.reducer.reduce_hook()
        for i, (name, p) in enumerate(self._named_params):
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
                self.all_reduce(buf)
            if buf is not grad:
                grad.copy_(buf)

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
        """Let ``hook(state, bucket) -> Future[Tensor]`` reduce each parameter (torch's API)."""
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
