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

One gradient's path, in this file but for the counting:

1. :meth:`~DataParallelOverlapped._gradient_ready`, the hook: it copies the
   gradient into its slot of the bucket's flat buffer, divided by the world size on
   the way (``Bucket.place_grad``); with ``gradient_as_bucket_view`` (our default)
   ``param.grad`` becomes that slot;
2. ``self._round.ready(b)`` (:class:`~dpcourse.ddp.rounds.BucketRound`) counts it;
   once bucket ``b`` and every bucket before it are complete, it calls
3. :meth:`~DataParallelOverlapped._launch_bucket`: all-reduce the bucket's buffer
   asynchronously (``Bucket.launch``);
4. at the end of backward, :meth:`~DataParallelOverlapped.finish_gradient_synchronization`
   has the round wait for every launched bucket, in launch order
   (:meth:`~DataParallelOverlapped._wait_bucket`).

Buckets are launched strictly in index order, even if a later one is complete
first: collectives are matched across ranks by the order they are issued, so
every rank must issue them in the same order (torch's reducer does the same).
ZeRO-2 (:class:`~dpcourse.zero.ShardedOptimizer`) runs the same round with a
reduce-scatter in place of the all-reduce.

torch DDP's further options (``Join``, communication hooks, unused parameters,
bucket rebuilds) are the :class:`~dpcourse.ddp.reducer.Reducer`'s, lesson 11.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.join import Joinable

from dpcourse.comm.collective import AllReduce
from dpcourse.ddp import guards, torch_interface
from dpcourse.ddp.broadcast import broadcast_module_state
from dpcourse.ddp.buckets import Bucket
from dpcourse.ddp.grad_hooks import hook_every_parameter
from dpcourse.ddp.reducer import Reducer
from dpcourse.ddp.rounds import BucketRound


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
        **options: torch DDP's options, see :class:`~dpcourse.ddp.reducer.Reducer`
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
                 **options: Any):
        """Check the arguments; then steps 1-4: rank 0's state, buckets and their round, hooks."""
        nn.Module.__init__(self)
        self.module, self.reducer = module, Reducer(self, module, group, all_reduce, bucket_cap_mb,
                                                    **options)
        # 1. Every replica starts from rank 0's parameters and buffers.
        broadcast_module_state(module, group)
        # 2. Flat buckets, filled in reverse registration order (lesson 05), and the round
        #    that launches them in order as their gradients arrive.
        self._use_buckets(*self.reducer.make_buckets())
        # 3. Where this rank is in the step.
        self._sync_this_backward = True   # the last forward was outside no_sync
        self._unsynced: set[int] = set()  # params with a gradient not yet averaged
        self._divisor: int | None = None  # set when a synchronised backward starts
        # 4. The hook, on every trainable parameter.
        self._hook_handles = hook_every_parameter(self, self._gradient_ready)  # held weakly

    def _use_buckets(self, buckets: list[Bucket], where: dict[int, tuple[int, int]]) -> None:
        """Reduce in ``buckets`` (``where[i]``: parameter ``i``'s bucket and slot), in a new round."""
        self.buckets, self._where = buckets, where
        self._round = BucketRound([len(b.params) for b in buckets], self._launch_bucket,
                                  on_backward_end=self._backward_end, finish=self._wait_bucket)

    def forward(self, *args, **kwargs):
        """Run the wrapped module (after torch's forward-time collectives, see the Reducer)."""
        if self._round.in_backward:  # the previous backward raised before finishing
            self._round.reset()
        self._sync_this_backward = self.reducer.pre_forward()
        if torch.is_grad_enabled():
            if self.reducer.rebuild_pending and self.reducer.arrival:  # lesson 11
                self._use_buckets(*self.reducer.rebuild())
            for bucket in self.buckets:
                bucket.placed.clear()  # a backward that raised may have placed some
        output = self.module(*args, **kwargs)
        return self.reducer.post_forward(output, self._sync_this_backward)  # unused parameters

    # -- during backward ---------------------------------------------------------
    def _gradient_ready(self, index: int, param: nn.Parameter) -> None:
        """The hook: count parameter ``index``'s gradient in its bucket; launch the buckets now full."""
        if self._sync_this_backward and not self._round.in_backward:
            self._start_backward()
        self._unsynced.add(index)
        self.reducer.note_used(index)
        b, k = self._where[index]
        if self._sync_this_backward:
            # Into the bucket, divided on the way: one pass over the gradient (torch does the same).
            self.buckets[b].place_grad(k, self._divisor)
            self.reducer.note_ready(index)
            self._round.ready(b)  # the bucket's last gradient: launch it (and complete ones after it)
        elif self.reducer.gradient_as_bucket_view and param.grad is not self.buckets[b].views[k]:
            self.buckets[b].attach_grad(k)  # inside no_sync: accumulate in the bucket, undivided

    def _start_backward(self) -> None:
        """The first gradient of a synchronised backward: sync once autograd is done."""
        guards.check_backward_start(self)
        self._round.start()  # autograd will call self._backward_end once backward is done
        # What each gradient is divided by; None: a communication hook reduces (and divides).
        self._divisor = None if self.reducer.reduce_hook() else self.reducer.divisor()
        # Parameters the forward did not use (find_unused_parameters) get no gradient:
        # their slots (zeros) are ready now, so their buckets need not wait.
        for i in self.reducer.unused_at_forward:
            if i not in self._unsynced:
                self._unsynced.add(i)
                self.reducer.note_ready(i)
                self._round.ready(self._where[i][0])

    def _launch_bucket(self, b: int) -> Any:
        """Divide bucket ``b`` by the world size, then start its all-reduce; return the handle."""
        return self.buckets[b].launch(self.reducer.all_reduce, self.reducer.divisor(), async_op=True,
                                      comm_hook=self.reducer.reduce_hook())

    # -- after backward ----------------------------------------------------------
    def _wait_bucket(self, b: int, work: Any) -> None:
        """Wait for bucket ``b``'s all-reduce (on GPU: the current stream waits for it)."""
        if work is not None:  # None: a custom all_reduce= already ran to completion
            work.wait()  # the bucket's all_reduce, launched with async_op=True

    def finish_gradient_synchronization(self) -> None:
        """Wait for every bucket's all-reduce, launching those still waiting first.

        autograd calls it (as ``_backward_end``) when a backward outside :meth:`no_sync`
        is done, so ``loss.backward()`` returns averaged gradients; a second call does
        nothing, and a call after a ``no_sync`` backward averages what accumulated.
        """
        try:
            with self.reducer.synchronizing() as anything_to_average:
                if anything_to_average:
                    # Launch the buckets still waiting (their gradients came in a no_sync
                    # backward, or this is an explicit call), then wait for every one, in
                    # launch order (GPU: the current stream waits for each).
                    self._round.finish()
        finally:
            self._round.reset()

    # -- torch DDP's interface (lessons 07, 10, 11), the same in every wrapper ------
    require_backward_grad_sync, trace = True, None  # False inside no_sync(); a CommTrace
    no_sync, register_comm_hook = torch_interface.no_sync, torch_interface.register_comm_hook
    join_hook, join_device, join_process_group = torch_interface.JOINABLE
    _backward_end = torch_interface.finish_after_backward  # autograd's end-of-backward callback
    _remove_hooks = torch_interface.remove_hooks
