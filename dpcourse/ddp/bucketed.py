"""DataParallelBucketed: one all-reduce per bucket of gradients instead of one per parameter.

Gradients live in a few flat buffers (see :mod:`dpcourse.ddp.buckets`); each
``param.grad`` is a *view* into its bucket's buffer, so the bucket is reduced
in place with a single collective and no gradient is stored twice (torch DDP
calls this ``gradient_as_bucket_view=True``). Communication still waits for
the end of backward; :class:`~dpcourse.ddp.DataParallelOverlapped` starts it
earlier.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import torch
import torch.distributed as dist
from torch import nn

from dpcourse.comm.p2p import AllReduce
from dpcourse.ddp.base import DataParallelBase
from dpcourse.ddp.bucket_order import agree_on_order, assign_buckets_in_order
from dpcourse.ddp.buckets import Bucket, check_bucket_cap, make_buckets, views_into
from dpcourse.ddp.comm_hooks import HookWork, launch_comm_hook


class DataParallelBucketed(DataParallelBase):
    """Average gradients after backward with one all-reduce per flat bucket.

    Args:
        module: the model, already on this rank's device.
        bucket_cap_mb: a bucket closes once it holds at least this many MiB
            (it may exceed the cap by its last tensor); 0 gives one bucket per
            parameter, ``math.inf`` one bucket per dtype and device.
        group: process group to average over (``None``: the default group).
        all_reduce: collective ``fn(tensor, group=None)`` summing in place
            (default ``torch.distributed.all_reduce``).
        broadcast_buffers, find_unused_parameters, static_graph: as in torch DDP
            (see :class:`~dpcourse.ddp.base.DataParallelBase`).
        first_bucket_mb: cap of the first bucket to be reduced (torch: 1 MiB with its
            default ``bucket_cap_mb``); ``None``: ``bucket_cap_mb``.
        rebuild_buckets: before the second forward, rebuild the buckets once in the order
            the gradients arrived in the first synchronised backward (rank 0's order,
            broadcast), as torch's reducer does (see :mod:`dpcourse.ddp.bucket_order`).
        gradient_as_bucket_view: ``param.grad`` is a view into its bucket (no second
            copy of the gradients; torch's default is False, ours True). False keeps
            separate gradient tensors, copied in and out around each reduction.

    Attributes:
        buckets: list of :class:`~dpcourse.ddp.buckets.Bucket` in reduction order
            (``.names``, ``.nbytes``, ``.buffer``).
        bucket_cap_mb: the cap used.
    """

    def __init__(self, module: nn.Module, *, bucket_cap_mb: float = 25.0,
                 group: dist.ProcessGroup | None = None, all_reduce: AllReduce | None = None,
                 broadcast_buffers: bool = True, find_unused_parameters: bool = False,
                 static_graph: bool = False, first_bucket_mb: float | None = None,
                 rebuild_buckets: bool = False, gradient_as_bucket_view: bool = True):
        cap = check_bucket_cap(bucket_cap_mb)  # before any communication or hook
        if first_bucket_mb is not None:
            check_bucket_cap(first_bucket_mb)
        super().__init__(module, group=group, all_reduce=all_reduce,
                         broadcast_buffers=broadcast_buffers,
                         find_unused_parameters=find_unused_parameters, static_graph=static_graph)
        self.bucket_cap_mb = cap
        self.first_bucket_mb = first_bucket_mb
        self.gradient_as_bucket_view = bool(gradient_as_bucket_view)
        # As torch: rebuild once, and not while unused parameters are searched for every
        # step (their arrival order is then not a property of the model).
        self._rebuild_pending = bool(rebuild_buckets) and (static_graph or
                                                           not find_unused_parameters)
        self._arrival: list[int] = []
        order = list(reversed(range(len(self._named_params))))
        assignment = (None if first_bucket_mb is None else assign_buckets_in_order(
            [p for _, p in self._named_params], order, cap, first_bucket_mb))
        self.buckets, self._where = make_buckets(self._named_params, cap, assignment,
                                                 self.gradient_as_bucket_view)

    def _grad_ready(self, index: int, param: nn.Parameter) -> None:
        if self._rebuild_pending:
            self._arrival.append(index)

    @torch.no_grad()
    def _rebuild(self) -> None:
        """Rebuild the buckets in the arrival order seen in the first synchronised backward."""
        self._rebuild_pending = False
        order = agree_on_order(self._arrival, len(self._named_params), self.join_device,
                               self.group)
        params = [p for _, p in self._named_params]
        assignment = assign_buckets_in_order(params, order, self.bucket_cap_mb,
                                             self.first_bucket_mb)
        self.buckets, self._where = make_buckets(self._named_params, self.bucket_cap_mb,
                                                 assignment, self.gradient_as_bucket_view)
        if self.gradient_as_bucket_view:  # keep accumulated gradients, now in the new buckets
            for bucket in self.buckets:
                for k, p in enumerate(bucket.params):
                    if p.grad is not None:
                        bucket.attach_grad(k)
        self._buckets_rebuilt()

    def _buckets_rebuilt(self) -> None:
        """Subclasses reset per-round state after :meth:`_rebuild`."""

    def _grad_accumulated(self, index: int, param: nn.Parameter) -> None:
        # Runs once per parameter per backward on autograd's thread: keep the
        # common case (gradient already in its bucket) to two lookups.
        if not self.gradient_as_bucket_view:
            return
        b, k = self._where[index]
        if param.grad is not self.buckets[b].views[k]:
            self.buckets[b].attach_grad(k)

    @torch.no_grad()
    def _attach_grads_to_buckets(self) -> None:
        """Make every ``param.grad`` its bucket view before backward, so autograd adds in place.

        Optimizers' ``zero_grad()`` sets gradients to ``None`` by default. Left
        alone, autograd would then hand each parameter a freshly allocated
        gradient and the hook would copy it into the bucket: one copy kernel and
        one Python call per parameter, on the thread that runs backward. Zeroing
        the bucket once here (one kernel per bucket) and re-pointing the
        gradients lets autograd accumulate straight into the buckets.
        """
        for bucket in self.buckets:
            if all(p.grad is None for p in bucket.params):
                bucket.buffer.zero_()
                for p, view in zip(bucket.params, bucket.views):
                    p.grad = view
                continue
            bucket.gather_grads()

    def _prepare_grads(self) -> None:
        if self._rebuild_pending and self._arrival:  # before the second forward, as torch
            self._rebuild()
        if self.gradient_as_bucket_view:
            self._attach_grads_to_buckets()

    def _bucket_hook(self) -> Callable[[Bucket], HookWork | None] | None:
        """What :meth:`Bucket.launch` calls instead of dividing and all-reducing, if anything."""
        return None if self._comm_hook is None else self._hand_to_comm_hook

    def _hand_to_comm_hook(self, bucket: Bucket) -> HookWork | None:
        """Give ``bucket`` to the registered communication hook; return its pending work."""
        work = launch_comm_hook(self._comm_hook, self._comm_hook_state, bucket.index,
                                bucket.buffer, bucket.views, bucket.params,
                                bucket.index == len(self.buckets) - 1)
        # A hook may issue more collectives from its future's callbacks (PowerSGD does).
        # NCCL runs those callbacks at once on this thread; gloo runs them later on its
        # own thread, where they could interleave with the next bucket's collectives in a
        # different order on each rank. There, finish each bucket before the next.
        if dist.get_backend(self.group) != "nccl":
            work.wait()
            return None
        return work

    def _reduce(self) -> None:
        for bucket in self.buckets:
            bucket.launch(self.all_reduce, self._gradient_divisor(), async_op=False,
                          comm_hook=self._bucket_hook())
            bucket.wait()  # a hook's result, or separate gradients copied back
            bucket.reset()

    @torch.no_grad()
    def _shadow_reduce(self) -> None:
        works = []
        for bucket in self.buckets:
            zeros = torch.zeros_like(bucket.buffer)
            if self._comm_hook is None:
                works.append(self.all_reduce(zeros, async_op=True))
            else:
                works.append(self._hand_to_comm_hook(
                    replace(bucket, buffer=zeros, views=views_into(zeros, bucket.params))))
        for w in works:
            if w is not None:
                w.wait()
