"""What torch's reducer adds to the wrappers of lessons 03-06, with torch's option names.

Lessons 03-06 build data parallelism itself: broadcast at construction, a hook per
parameter, buckets, all-reduces started during backward. torch's
``DistributedDataParallel`` adds options that lessons 10 and 11 take apart; each
wrapper holds one :class:`Reducer` for them (composition: the wrapper asks it at
four moments, and with its defaults every answer is the plain one):

* **forward** (:meth:`Reducer.pre_forward`, :meth:`Reducer.post_forward`): under
  ``Join`` tell the joined ranks this rank still trains; copy the buffers from one
  rank (``broadcast_buffers``); search the graph for unused parameters
  (``find_unused_parameters``, ``static_graph``); rebuild the buckets once in the
  order gradients arrived (``rebuild_buckets``);
* **a gradient arrives** (:meth:`Reducer.note_used`, :meth:`Reducer.note_ready`):
  note it as used, and its arrival order;
* **a bucket is reduced** (:meth:`Reducer.reduce_hook`, :meth:`Reducer.divisor`): a
  registered communication hook owns the reduction (``register_comm_hook``); under
  ``Join`` the sum may be divided by the ranks that still have data;
* **synchronisation** (:meth:`Reducer.synchronizing`): every parameter must have a
  gradient; parameters nobody used get their ``None`` gradient back.

When one rank runs out of data, ``Join`` calls :meth:`Reducer.join_hook`'s hook,
which issues the same collectives on zeros (:mod:`dpcourse.ddp.join`).

Reference: ``torch/nn/parallel/distributed.py`` and
``torch/csrc/distributed/c10d/reducer.cpp``.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator
from dataclasses import replace
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.join import Join, JoinHook, _JoinConfig

from dpcourse.comm.collective import AllReduce, sum_over_ranks
from dpcourse.ddp import guards
from dpcourse.ddp.broadcast import group_src
from dpcourse.ddp.bucket_order import agree_on_order, assign_buckets_in_order
from dpcourse.ddp.buckets import Bucket, check_bucket_cap, make_buckets, views_into
from dpcourse.ddp.comm_hooks import HookWork, check_comm_hook, launch_comm_hook
from dpcourse.ddp.join import WrapperJoinHook, find_common_rank
from dpcourse.ddp.unused import UnusedParameters

__all__ = ["Reducer"]


class Reducer:
    """torch DDP's options for one wrapper: Join, comm hooks, unused parameters, bucket order.

    It also holds what every wrapper needs alike: the checked trainable parameters,
    the group and the collective.

    Args:
        wrapper: the wrapper that owns this reducer (held weakly); it provides
            ``module``, ``require_backward_grad_sync``, ``_sync_this_backward``,
            ``_unsynced`` and, if bucketed, ``buckets``.
        module: the model the wrapper wraps (checked: :func:`~dpcourse.ddp.guards.check_wrappable`).
        group: process group to average over (``None``: the default group).
        all_reduce: the collective, see :func:`~dpcourse.comm.collective.sum_over_ranks`.
        bucket_cap_mb: the bucketed wrappers' cap (see :func:`~dpcourse.ddp.buckets.assign_buckets`).
        broadcast_buffers: copy the buffers of one rank to every rank before each
            forward (torch's default; under ``Join``, a rank still training).
        find_unused_parameters: after each forward, find the parameters it did not use
            (an autograd-graph walk) and reduce zeros for them.
        static_graph: the same parameters are used every step: find the unused ones in
            the first step only.
        first_bucket_mb: cap of the first bucket to be reduced (torch: 1 MiB with its
            default ``bucket_cap_mb``); ``None``: ``bucket_cap_mb``. Bucketed wrappers only.
        rebuild_buckets: before the second forward, rebuild the buckets once in the order
            the gradients arrived in the first synchronised backward (rank 0's order,
            broadcast), as torch's reducer does (see :mod:`dpcourse.ddp.bucket_order`).
        gradient_as_bucket_view: ``param.grad`` is a view into its bucket (torch's default
            is False, ours True). False keeps separate gradient tensors, copied in and out
            around each reduction.
    """

    def __init__(self, wrapper: Any, module: nn.Module, group: dist.ProcessGroup | None,
                 all_reduce: AllReduce | None, bucket_cap_mb: float | None = None, *,
                 broadcast_buffers: bool = True, find_unused_parameters: bool = False,
                 static_graph: bool = False, first_bucket_mb: float | None = None,
                 rebuild_buckets: bool = False, gradient_as_bucket_view: bool = True):
        # The caps are validated before the checks' first collective.
        self.bucket_cap_mb = None if bucket_cap_mb is None else check_bucket_cap(bucket_cap_mb)
        if first_bucket_mb is not None:
            check_bucket_cap(first_bucket_mb)
        self.named_params = guards.check_wrappable(module, group, all_reduce)
        self.group, self.world_size = group, dist.get_world_size(group)
        self.all_reduce = partial(sum_over_ranks, group=group, all_reduce=all_reduce)
        self._ref = weakref.ref(wrapper)  # the wrapper holds its reducer, not the other way
        wrapper._join_config = _JoinConfig.construct_disabled_join_config()  # Join sets its own
        self.broadcast_buffers = bool(broadcast_buffers)
        self.first_bucket_mb = first_bucket_mb
        self.gradient_as_bucket_view = bool(gradient_as_bucket_view)
        self.unused = UnusedParameters([p for _, p in self.named_params],
                                       find_unused_parameters, static_graph)
        self.comm_hook: Any = None   # hook(state, bucket) -> Future, or None: divide + all-reduce
        self.comm_hook_state: Any = None
        self.broadcast_buffers_next = True   # torch: not after a no_sync or no-grad forward
        # As torch: rebuild once, and not while unused parameters are searched for every
        # step (their arrival order is then not a property of the model).
        self.rebuild_pending = bool(rebuild_buckets) and (static_graph or
                                                          not find_unused_parameters)
        self.arrival: list[int] = []
        self.divide_by_initial_world_size = True
        self._join_work = None     # this step's "I have not joined" all-reduce
        self._join_divisor: int | None = None

    @property
    def _wrapper(self) -> Any:
        return self._ref()

    # -- buckets ---------------------------------------------------------------
    def make_buckets(self, order: list[int] | None = None
                     ) -> tuple[list[Bucket], dict[int, tuple[int, int]]]:
        """Build the wrapper's buckets: reverse registration order, or ``order`` (a rebuild)."""
        named, bucket_cap_mb = self.named_params, self.bucket_cap_mb
        assert bucket_cap_mb is not None, "a bucketed wrapper passes bucket_cap_mb"
        assignment = None
        if order is not None or self.first_bucket_mb is not None:
            order = list(reversed(range(len(named)))) if order is None else order
            assignment = assign_buckets_in_order([p for _, p in named], order, bucket_cap_mb,
                                                 self.first_bucket_mb)
        return make_buckets(named, bucket_cap_mb, assignment, self.gradient_as_bucket_view)

    @torch.no_grad()
    def rebuild(self) -> tuple[list[Bucket], dict[int, tuple[int, int]]]:
        """New buckets in rank 0's arrival order of the first synchronised backward."""
        self.rebuild_pending = False
        order = agree_on_order(self.arrival, len(self.named_params), self.device,
                               self.group)
        buckets, where = self.make_buckets(order)
        if self.gradient_as_bucket_view:  # keep accumulated gradients, now in the new buckets
            for bucket in buckets:
                for k, p in enumerate(bucket.params):
                    if p.grad is not None:
                        bucket.attach_grad(k)
        return buckets, where

    # -- forward -----------------------------------------------------------------
    def pre_forward(self) -> bool:
        """The collectives before a forward, in torch DDP's order: join flag, buffers, sync flag.

        Returns:
            Whether the backward of this forward synchronises: ``no_sync()`` is read
            here, at forward time, as torch does. A no-grad forward (evaluation)
            leaves the previous answer, and any pending work, alone.
        """
        w = self._wrapper
        guards.check_forward(w)
        self._join_work = Join.notify_join_context(w)   # no-op outside Join
        self._join_divisor = None
        buffers = list(w.module.buffers())
        if self.broadcast_buffers_next and self.broadcast_buffers and buffers:
            src = 0   # rank 0 may have joined with stale buffers: then one still training
            if w._join_config.enable:
                src = find_common_rank(self.group, self.device, True)
            with torch.no_grad():
                for b in buffers:
                    dist.broadcast(b, src=group_src(self.group, src), group=self.group)
        if w._join_config.enable:  # tell joined ranks whether this backward reduces
            flag = torch.tensor([1.0 if w.require_backward_grad_sync else 0.0],
                                device=self.device)
            dist.all_reduce(flag, group=self.group)
        if not torch.is_grad_enabled():
            self.broadcast_buffers_next = False
            return w._sync_this_backward
        self.broadcast_buffers_next = w.require_backward_grad_sync
        self.unused.before_forward()
        w._forward_pending = w.require_backward_grad_sync  # see guards.check_backward_start
        return w.require_backward_grad_sync

    def post_forward(self, output: Any, syncs: bool) -> Any:
        """Find the parameters the forward did not use (only when asked to, as torch); return ``output``."""
        if torch.is_grad_enabled():
            self.unused.after_forward(output, syncs)
        return output

    # -- backward ------------------------------------------------------------------
    @property
    def unused_at_forward(self) -> list[int]:
        """Parameters the last forward did not use: their (zero) slots are ready at once."""
        return sorted(self.unused.at_forward)

    def note_used(self, index: int) -> None:
        """Parameter ``index`` got a gradient (inside ``no_sync`` too)."""
        self.unused.used.add(index)

    def note_ready(self, index: int) -> None:
        """Parameter ``index`` is ready in a synchronised backward: record the order, once."""
        if self.rebuild_pending:
            self.arrival.append(index)

    def divisor(self) -> int:
        """What the summed gradients are divided by: the world size, or the ranks with data."""
        if self._join_work is not None and not self.divide_by_initial_world_size:
            work, self._join_work = self._join_work, None
            # Its result: how many ranks announced that they still have data.
            self._join_divisor = int(work.get_future().wait()[0].item())
        return self._join_divisor or self.world_size

    def reduce_hook(self):
        """What ``Bucket.launch`` calls instead of dividing and all-reducing, if anything."""
        return None if self.comm_hook is None else self._hand_to_comm_hook

    def _hand_to_comm_hook(self, bucket: Bucket) -> HookWork | None:
        work = launch_comm_hook(self.comm_hook, self.comm_hook_state, bucket.index,
                                bucket.buffer, bucket.views, bucket.params,
                                bucket.index == self._last_bucket_index())
        # A hook may issue more collectives from its future's callbacks (PowerSGD does).
        # NCCL runs those callbacks at once on this thread; gloo runs them later on its
        # own thread, where they could interleave with the next bucket's collectives in a
        # different order on each rank. There, finish each bucket before the next.
        if dist.get_backend(self.group) != "nccl":
            work.wait()
            return None
        return work

    def _last_bucket_index(self) -> int:
        buckets = getattr(self._wrapper, "buckets", None)
        return len(buckets if buckets is not None else self.named_params) - 1

    # -- synchronisation -----------------------------------------------------------
    @contextlib.contextmanager
    def synchronizing(self) -> Iterator[bool]:
        """Bracket one synchronisation of the wrapper's ``_unsynced`` gradients.

        Before: the (zero) slots of parameters this rank did not use join the
        gradients to reduce (``find_unused_parameters``, ``static_graph``: maybe used
        elsewhere), and every trainable parameter must have a gradient
        (:func:`~dpcourse.ddp.guards.check_all_gradients`). After: gradients no rank
        used get their ``None`` back, and ``_unsynced`` is emptied, also when the
        reduction raised.

        Yields:
            Whether there is anything to synchronise (False: nothing arrived since the
            last synchronisation, and the body must do nothing).
        """
        unsynced = self._wrapper._unsynced
        if not unsynced:
            yield False
            return
        if self.unused.searched:
            unsynced.update(range(len(self.named_params)))
        try:
            guards.check_all_gradients(self._wrapper)
        except RuntimeError:
            unsynced.clear()
            raise
        reduced = False
        try:
            yield True
            reduced = True
        finally:
            unsynced.clear()
            try:
                if reduced and self.unused.searched:
                    self.unused.forget_globally_unused(self.device, self.group)
            finally:
                self.unused.clear()

    def register_comm_hook(self, state: Any, hook) -> None:
        """See :meth:`dpcourse.ddp.DataParallelOverlapped.register_comm_hook`."""
        if self.comm_hook is not None:
            raise RuntimeError("a communication hook is already registered on this wrapper; "
                               "it can be registered only once (as in torch DDP). Wrap the "
                               "module in a new wrapper to use another hook.")
        check_comm_hook(hook)
        self.comm_hook, self.comm_hook_state = hook, state

    # -- Join ----------------------------------------------------------------------
    @property
    def device(self) -> torch.device:
        """Device of the wrapper's gradients (where the flags' tensors live)."""
        return self.named_params[0][1].device

    def join_hook(self, **kwargs) -> JoinHook:
        """The hook ``Join`` calls once this rank has run out of data (see :mod:`~dpcourse.ddp.join`)."""
        return WrapperJoinHook(self, kwargs.get("divide_by_initial_world_size", True))

    @torch.no_grad()
    def shadow_reduce(self) -> None:
        """Issue the gradient collectives of one synchronised backward, on zeros."""
        buckets = getattr(self._wrapper, "buckets", None)
        if buckets is None:   # one all-reduce per parameter, as DataParallelNaive
            params = [p for _, p in self.named_params]
            flat = [torch.zeros(p.numel(), dtype=p.dtype, device=p.device) for p in params]
            buckets = [Bucket(i, [i], [""], [p], f, [f.view(p.shape)])
                       for i, (p, f) in enumerate(zip(params, flat))]
        works = []
        for bucket in buckets:
            zeros = torch.zeros_like(bucket.buffer)
            if self.comm_hook is None:
                works.append(self.all_reduce(zeros, async_op=True))
            else:
                works.append(self._hand_to_comm_hook(
                    replace(bucket, buffer=zeros, views=views_into(zeros, bucket.params))))
        for work in works:
            if work is not None:
                work.wait()
