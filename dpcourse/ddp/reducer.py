"""What torch's reducer adds to the wrappers of lessons 03-06, with torch's option names.

Lessons 03-06 build data parallelism itself: broadcast at construction, a hook per
parameter, buckets, all-reduces started during backward. torch's
``DistributedDataParallel`` adds options that lessons 10 and 11 take apart; each
wrapper holds one :class:`Reducer` for them (composition: the wrapper asks it at
four moments, and with its defaults every answer is the plain one):

* **forward** (:meth:`Reducer.pre_forward`, :meth:`Reducer.post_forward`): under
  ``Join`` tell the joined ranks this rank still trains; copy the buffers from one
  rank (``broadcast_buffers``; both in :mod:`~dpcourse.ddp.pre_forward`); search
  the graph for unused parameters (``find_unused_parameters``, ``static_graph``:
  :mod:`~dpcourse.ddp.unused`); rebuild the buckets once in the order gradients
  arrived (``rebuild_buckets``: :mod:`~dpcourse.ddp.bucket_assignment`);
* **a gradient arrives** (:meth:`Reducer.note_used`, :meth:`Reducer.note_ready`):
  note it as used, and its arrival order;
* **a bucket is reduced** (:meth:`Reducer.reduce_hook`, :meth:`Reducer.divisor`): a
  registered communication hook owns the reduction (``register_comm_hook``:
  :mod:`~dpcourse.ddp.comm_hooks`); under ``Join`` the sum may be divided by the
  ranks that still have data (:class:`~dpcourse.ddp.join.JoinDivisor`);
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
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.join import JoinHook, _JoinConfig

from dpcourse.comm.collective import AllReduce, sum_over_ranks
from dpcourse.ddp import buckets, guards
from dpcourse.ddp.bucket_assignment import check_bucket_cap
from dpcourse.ddp.buckets import Bucket, Where
from dpcourse.ddp.comm_hooks import HookWork, check_comm_hook, hand_to_hook
from dpcourse.ddp.join import JoinDivisor, WrapperJoinHook, find_common_rank
from dpcourse.ddp.pre_forward import all_reduce_sync_flag, sync_buffers
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
        bucket_cap_mb: the bucketed wrappers' cap
            (see :func:`~dpcourse.ddp.bucket_assignment.assign_buckets`).
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
            broadcast), as torch's reducer does (see :mod:`dpcourse.ddp.bucket_assignment`).
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
        self.join_divisor = JoinDivisor(self.world_size)

    @property
    def _wrapper(self) -> Any:
        return self._ref()

    # -- buckets ---------------------------------------------------------------
    def make_buckets(self, order: list[int] | None = None) -> tuple[list[Bucket], Where]:
        """Build the wrapper's buckets: reverse registration order, or ``order`` (a rebuild)."""
        assert self.bucket_cap_mb is not None, "a bucketed wrapper passes bucket_cap_mb"
        return buckets.buckets_in_order(self.named_params, self.bucket_cap_mb, order,
                                        first_bucket_mb=self.first_bucket_mb,
                                        gradient_as_bucket_view=self.gradient_as_bucket_view)

    def rebuild(self) -> tuple[list[Bucket], Where]:
        """New buckets in rank 0's arrival order of the first synchronised backward."""
        assert self.bucket_cap_mb is not None, "a bucketed wrapper passes bucket_cap_mb"
        self.rebuild_pending = False
        return buckets.rebuild_buckets(self.named_params, self.arrival, self.device,
                                       self.group, self.bucket_cap_mb,
                                       first_bucket_mb=self.first_bucket_mb,
                                       gradient_as_bucket_view=self.gradient_as_bucket_view)

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
        self.join_divisor.notify(w)   # "I have not joined"; no-op outside Join
        if self.buffers_due():
            src = 0   # rank 0 may have joined with stale buffers: then one still training
            if w._join_config.enable:
                src = find_common_rank(self.group, self.device, True)
            sync_buffers(w.module, src, self.group)
        if w._join_config.enable:  # tell joined ranks whether this backward reduces
            all_reduce_sync_flag(w.require_backward_grad_sync, self.device, self.group)
        if not torch.is_grad_enabled():
            self.broadcast_buffers_next = False
            return w._sync_this_backward
        self.broadcast_buffers_next = w.require_backward_grad_sync
        self.unused.before_forward()
        w._forward_pending = w.require_backward_grad_sync  # see guards.check_backward_start
        return w.require_backward_grad_sync

    def buffers_due(self) -> bool:
        """Whether this step's forward copies the buffers of one rank to every rank."""
        return (self.broadcast_buffers_next and self.broadcast_buffers
                and any(True for _ in self._wrapper.module.buffers()))

    def post_forward(self, output: Any, syncs: bool) -> Any:
        """Find the parameters the forward did not use (only when asked to, as torch); return ``output``."""
        if torch.is_grad_enabled():
            self.unused.after_forward(output, syncs)
        return output

    # -- a gradient arrives --------------------------------------------------------
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

    # -- a bucket is reduced -------------------------------------------------------
    def divisor(self) -> int:
        """What the summed gradients are divided by: the world size, or the ranks with data."""
        return self.join_divisor()

    def reduce_hook(self):
        """What ``Bucket.launch`` calls instead of dividing and all-reducing, if anything."""
        return None if self.comm_hook is None else self._hand_to_comm_hook

    def _hand_to_comm_hook(self, bucket: Bucket) -> HookWork | None:
        held = getattr(self._wrapper, "buckets", None)  # DataParallelNaive: one per parameter
        last = len(held if held is not None else self.named_params) - 1
        return hand_to_hook(self.comm_hook, self.comm_hook_state, bucket, bucket.index == last,
                            self.group)

    def register_comm_hook(self, state: Any, hook) -> None:
        """See :meth:`dpcourse.ddp.DataParallelOverlapped.register_comm_hook`."""
        if self.comm_hook is not None:
            raise RuntimeError("a communication hook is already registered on this wrapper; "
                               "it can be registered only once (as in torch DDP). Wrap the "
                               "module in a new wrapper to use another hook.")
        check_comm_hook(hook)
        self.comm_hook, self.comm_hook_state = hook, state

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

    # -- Join ----------------------------------------------------------------------
    @property
    def device(self) -> torch.device:
        """Device of the wrapper's gradients (where the flags' tensors live)."""
        return self.named_params[0][1].device

    def join_hook(self, **kwargs) -> JoinHook:
        """The hook ``Join`` calls once this rank has run out of data (see :mod:`~dpcourse.ddp.join`)."""
        return WrapperJoinHook(self, kwargs.get("divide_by_initial_world_size", True))
