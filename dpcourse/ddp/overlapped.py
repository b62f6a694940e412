"""DataParallelOverlapped: start each bucket's all-reduce while backward is still running.

Backward computes gradients from the last layer to the first. A
*post-accumulate-grad hook* on every parameter hears each gradient the moment
autograd has added it into ``param.grad``. The hook counts it in its bucket;
when that was the bucket's last gradient it launches the bucket's all-reduce
asynchronously (``async_op=True``) and returns, so autograd goes on computing
earlier layers' gradients while the bytes move. When backward ends, a callback
queued on the autograd engine waits for the work handles. A step then costs
about ``max(compute, communication)`` instead of their sum, apart from the last
bucket, which can only start when backward is done.

One gradient's path, all in this file but for the bucket itself:
:meth:`~DataParallelOverlapped._gradient_ready` (the hook) ->
:meth:`~DataParallelOverlapped._mark_ready` -> ``Bucket.mark_ready`` ->
:meth:`~DataParallelOverlapped._launch_ready_buckets` -> ``Bucket.launch``
(divide, then all-reduce) -> :meth:`~DataParallelOverlapped.finish_gradient_synchronization`
(wait). Buckets are launched strictly in index order, even if a later one is
complete first: collectives are matched across ranks by the order they are
issued, so every rank must issue them in the same order (torch's reducer does
the same).

torch DDP's further options (``Join``, communication hooks, unused parameters,
bucket rebuilds) are the :class:`~dpcourse.ddp.reducer.Reducer`'s, lesson 11.
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


class DataParallelOverlapped(nn.Module, Joinable):
    """Average gradients in buckets, each all-reduced asynchronously the moment it is complete.

    With the default collective the all-reduces run in the background while
    backward continues. A custom ``all_reduce=`` (e.g. a hand-built ring made of
    blocking sends and receives) is called synchronously from the hook instead:
    it still starts before backward has finished, but backward pauses while it
    runs. Running it on a side thread would hide that pause, but would let two
    threads issue collectives on one group at once, which the backends do not
    order; correctness comes first.

    Args:
        module: the model, already on this rank's device.
        bucket_cap_mb: a bucket closes once it holds at least this many MiB
            (it may exceed the cap by its last tensor); 0 gives one bucket per parameter.
        group: process group to average over (``None``: the default group).
        all_reduce: collective ``fn(tensor, group=None)`` summing in place
            (default: asynchronous ``torch.distributed.all_reduce``).
        **torch_options: torch DDP's options, see :class:`~dpcourse.ddp.reducer.Reducer`
            (``broadcast_buffers``, ``find_unused_parameters``, ``static_graph``,
            ``first_bucket_mb``, ``rebuild_buckets``, ``gradient_as_bucket_view``).

    Attributes:
        module: the wrapped model.
        buckets: list of :class:`~dpcourse.ddp.buckets.Bucket` in launch order.
        require_backward_grad_sync: False inside :meth:`no_sync`.
        reducer: the :class:`~dpcourse.ddp.reducer.Reducer` of torch's options.
        trace: optionally a :class:`dpcourse.comm.CommTrace`; the wrapper marks
            ``"backward_end"`` on it when autograd has computed every gradient
            (before waiting) and ``"sync_end"`` when the gradients are averaged.
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
        # 2. Flat buckets, filled in reverse registration order (lesson 05).
        self.buckets, self._where = self.reducer.make_buckets(self.bucket_cap_mb)
        # 3. Where this rank is in the step (torch decides at forward time whether the
        #    next backward synchronises).
        self._sync_this_backward = True   # the last forward was outside no_sync
        self._forward_pending = False     # a forward whose backward has not synchronised yet
        self._in_backward = False         # a synchronised backward is running
        self._unsynced: set[int] = set()  # params with a gradient not yet averaged
        self._replaced = False            # True once a newer wrapper took this module over
        self._reset_round()
        # 4. The hook, on every trainable parameter (held weakly: a discarded wrapper is freed).
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
        if self._in_backward:  # the previous backward raised before finishing
            self._in_backward = False
            self._reset_round()
        self.reducer.pre_forward()  # Join's flags and the buffers, in torch's order
        if torch.is_grad_enabled():  # a no-grad forward (evaluation) leaves pending work alone
            self._sync_this_backward = self.require_backward_grad_sync
            self._forward_pending = self._sync_this_backward
            if self.reducer.rebuild_pending and self.reducer.arrival:  # lesson 11
                self.buckets, self._where = self.reducer.rebuild(self.bucket_cap_mb)
                self._reset_round()
            if self.reducer.gradient_as_bucket_view:
                attach_grads_to_buckets(self.buckets)
        output = self.module(*args, **kwargs)
        self.reducer.post_forward(output, self._sync_this_backward)
        return output

    # -- during backward ---------------------------------------------------------
    def _gradient_ready(self, index: int, param: nn.Parameter) -> None:
        """The hook: ``param.grad`` now holds this backward's gradient of parameter ``index``."""
        if self._sync_this_backward and not self._in_backward:
            self._start_backward()
        self._unsynced.add(index)
        self.reducer.note_used(index)
        b, k = self._where[index]
        if self.reducer.gradient_as_bucket_view and param.grad is not self.buckets[b].views[k]:
            self.buckets[b].attach_grad(k)  # autograd made a new tensor: into the bucket
        if self._sync_this_backward:  # inside no_sync the gradient stays local
            self._mark_ready(index)

    def _start_backward(self) -> None:
        """The first gradient of a synchronised backward: sync once autograd is done."""
        guards.check_backward_start(self)
        self._forward_pending = False
        self._in_backward = True
        self._reset_round()
        Variable._execution_engine.queue_callback(self._backward_end)
        # Parameters the forward did not use (find_unused_parameters) get no gradient:
        # their slots (zeros) are ready now, so their buckets need not wait.
        for i in self.reducer.unused_at_forward:
            if i not in self._unsynced:
                self._unsynced.add(i)
                self._mark_ready(i)

    def _mark_ready(self, index: int) -> None:
        """Count one more gradient in its bucket; launch the buckets that are complete."""
        self.reducer.note_ready(index)
        b, k = self._where[index]
        if self.buckets[b].mark_ready(k):
            self._launch_ready_buckets()

    def _launch_ready_buckets(self) -> None:
        """Launch complete buckets, strictly in index order, asynchronously."""
        while self._next_bucket < len(self.buckets) and self.buckets[self._next_bucket].pending == 0:
            self.buckets[self._next_bucket].launch(self.all_reduce, self.reducer.divisor(),
                                                   async_op=True, comm_hook=self.reducer.reduce_hook())
            self._next_bucket += 1

    def _backward_end(self) -> None:
        """Runs inside the autograd engine once backward has computed every gradient."""
        self._in_backward = False
        if self.trace is not None:
            self.trace.mark("backward_end")
        self.finish_gradient_synchronization()
        if self.trace is not None:
            self.trace.mark("sync_end")

    def _reset_round(self) -> None:
        """Forget the previous synchronisation: every bucket waits for all its gradients again."""
        for bucket in self.buckets:
            bucket.reset()
        self._next_bucket = 0  # the next bucket to launch

    # -- after backward ----------------------------------------------------------
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
            self._reset_round()
            raise
        reduced = False
        try:
            # Buckets still waiting got their gradients in a no_sync backward, or this is
            # an explicit call (every parameter has a gradient: checked above).
            for bucket in self.buckets[self._next_bucket:]:
                bucket.pending = 0
            self._launch_ready_buckets()
            for bucket in self.buckets:  # in launch order (GPU: the stream waits for each)
                bucket.wait()
            reduced = True
        finally:
            self._reset_round()
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
        """Let ``hook(state, bucket) -> Future[Tensor]`` reduce each bucket (torch's API).

        The wrapper then does not divide by the world size first: the hook owns the
        reduction (see :mod:`dpcourse.ddp.comm_hooks`).
        """
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
