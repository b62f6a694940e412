"""DataParallelBucketed: one all-reduce per bucket of gradients instead of one per parameter.

Gradients live in a few flat buffers (see :mod:`dpcourse.ddp.buckets`); each
``param.grad`` is a *view* into its bucket's buffer, so the bucket is reduced
in place with a single collective and no gradient is stored twice (torch DDP
calls this ``gradient_as_bucket_view=True``). Communication still waits for
the end of backward; :class:`~dpcourse.ddp.DataParallelOverlapped` starts it
earlier.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from dpcourse.comm.p2p import AllReduce
from dpcourse.ddp.base import DataParallelBase
from dpcourse.ddp.bucket_order import agree_on_order, assign_buckets_in_order
from dpcourse.ddp.buckets import check_bucket_cap, make_buckets
from dpcourse.ddp.comm_hooks import launch_comm_hook


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

    Attributes:
        buckets: list of :class:`~dpcourse.ddp.buckets.Bucket` in reduction order
            (``.names``, ``.nbytes``, ``.buffer``).
        bucket_cap_mb: the cap used.
    """

    def __init__(self, module: nn.Module, *, bucket_cap_mb: float = 25.0,
                 group: dist.ProcessGroup | None = None, all_reduce: AllReduce | None = None):
        cap = check_bucket_cap(bucket_cap_mb)  # before any communication or hook
        if first_bucket_mb is not None:
            check_bucket_cap(first_bucket_mb)
        super().__init__(module, group=group, all_reduce=all_reduce,
                         broadcast_buffers=broadcast_buffers,
                         find_unused_parameters=find_unused_parameters, static_graph=static_graph)
        self.bucket_cap_mb = cap
        self.first_bucket_mb = first_bucket_mb
        self.gradient_as_bucket_view = bool(gradient_as_bucket_view)
        # As torch: rebuild once, and not while unused parameters are searched for each step
        # (their arrival order is not a property of the model then).
        self._rebuild_pending = bool(rebuild_buckets) and (static_graph or
                                                           not find_unused_parameters)
        self._arrival: list[int] = []
        order = list(reversed(range(len(self._named_params))))
        assignment = (None if first_bucket_mb is None else assign_buckets_in_order(
            [p for _, p in self._named_params], order, cap, first_bucket_mb))
        self.buckets, self._where = make_buckets(self._named_params, cap, assignment)

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
                                                 assignment)
        if self.gradient_as_bucket_view:  # keep accumulated gradients, now in the new buckets
            for i, p in enumerate(params):
                if p.grad is not None:
                    self._point_grad_at_bucket(i, p)
        self._buckets_rebuilt()

    def _buckets_rebuilt(self) -> None:
        """Subclasses reset per-bucket state after :meth:`_rebuild`."""

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
            for k, (p, view) in enumerate(zip(bucket.params, bucket.views)):
                if p.grad is not view:
                    bucket.attach_grad(k)

    def _prepare_grads(self) -> None:
        if self._rebuild_pending and self._arrival:  # before the second forward, as torch
            self._rebuild()
        if self.gradient_as_bucket_view:
            self._attach_grads_to_buckets()

    def _reduce(self) -> None:
        for bucket in self.buckets:
            bucket.launch(self.all_reduce, self.world_size, async_op=False)
            bucket.reset()
