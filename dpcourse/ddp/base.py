"""What every data-parallel wrapper shares: the start-up broadcast, the backward hooks, no_sync.

A wrapper must be a drop-in for ``torch.nn.parallel.DistributedDataParallel``:
the training loop calls ``loss.backward()`` and ``optimizer.step()`` and nothing
else, yet the gradients are averaged across ranks in between. The mechanism,
the same one torch's reducer relies on:

1. at construction, a *post-accumulate-grad hook* is registered on every
   trainable parameter (:mod:`~dpcourse.ddp.grad_hooks`); autograd calls it once per backward, right after the
   parameter's gradient has been added into ``param.grad`` (a weight used twice,
   e.g. tied embeddings, still gets ONE call: autograd sums both contributions
   before accumulating);
2. the first hook of a backward pass queues a callback on the autograd engine
   (``Variable._execution_engine.queue_callback``); the engine runs it once the
   whole backward graph has been executed, before ``loss.backward()`` returns;
3. that callback calls :meth:`finish_gradient_synchronization`, which checks
   that every parameter got a gradient and averages the gradients. Subclasses
   decide how (:meth:`DataParallelBase._reduce`): one tensor at a time, in
   buckets, or waiting for communication already started from the hooks.

The checks (wrong model, backward without forward, missing gradients, a step on
unsynchronised gradients) live in :mod:`dpcourse.ddp.guards`. What torch DDP adds
on top, with torch's option names, lives in its own modules: uneven inputs under
``Join`` (:mod:`~dpcourse.ddp.join`), communication hooks
(:mod:`~dpcourse.ddp.comm_hooks`), unused parameters and static graphs
(:mod:`~dpcourse.ddp.unused`).

Reference: ``torch/nn/parallel/distributed.py`` and the "DDP internal design"
notes (https://pytorch.org/docs/stable/notes/ddp.html).
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.autograd import Variable
from torch.utils.hooks import RemovableHandle

from dpcourse.comm.p2p import AllReduce
from dpcourse.ddp import guards
from dpcourse.ddp.broadcast import broadcast_module_state
from dpcourse.ddp.comm_hooks import CommHookWrapper
from dpcourse.ddp.grad_hooks import register_grad_hooks, take_over
from dpcourse.ddp.join import JoinableWrapper
from dpcourse.ddp.unused import UnusedParameters

__all__ = ["DataParallelBase", "broadcast_module_state"]


class DataParallelBase(nn.Module, JoinableWrapper, CommHookWrapper):
    """Shared machinery of the wrappers; subclasses implement how gradients are reduced.

    Subclasses override :meth:`_reduce` (average every gradient; once per
    synchronisation) and may override :meth:`_start_backward` (a synchronised
    backward begins), :meth:`_grad_accumulated` (every gradient, also inside
    ``no_sync``), :meth:`_grad_ready` (every gradient of a synchronised backward)
    and :meth:`_abort` (drop the state of a backward that did not complete).

    Attributes:
        module: the wrapped model.
        group: the process group (``None``: the default group).
        world_size: number of ranks in ``group``.
        require_backward_grad_sync: False inside :meth:`no_sync`.
        broadcast_buffers: copy the authoritative rank's buffers to every rank before
            each forward (torch DDP's default; under ``Join``, a rank still training).
        find_unused_parameters: after each forward, find the parameters it did not use
            (an autograd-graph walk) and reduce zeros for them.
        static_graph: the same parameters are used every step: find the unused ones in
            the first step only.
        trace: optionally a :class:`dpcourse.comm.CommTrace`; when set, the wrapper
            marks ``"backward_end"`` (every gradient computed, before waiting for
            communication) and ``"sync_end"`` on it at each synchronisation.
    """

    _hook_handles: list[RemovableHandle]
    _step_guard: RemovableHandle

    def __init__(self, module: nn.Module, *, group: dist.ProcessGroup | None = None,
                 all_reduce: AllReduce | None = None, broadcast_buffers: bool = True,
                 find_unused_parameters: bool = False, static_graph: bool = False):
        nn.Module.__init__(self)
        params = guards.check_wrappable(module, group, all_reduce)
        guards.check_same_model(module, group, params[0][1].device)
        self._init_join()
        self.broadcast_buffers = bool(broadcast_buffers)
        self._unused = UnusedParameters([p for _, p in params], find_unused_parameters,
                                        static_graph)
        self.module = module
        self.group = group
        self.world_size = dist.get_world_size(group)
        self._custom_all_reduce = all_reduce
        self._named_params = params
        self.require_backward_grad_sync = True
        self.trace: Any = None
        # Where this rank is in the step (torch DDP decides at forward time whether
        # the next backward synchronises).
        self._sync_this_backward = True   # the last forward was outside no_sync
        self._forward_pending = False     # a forward whose backward has not synchronised yet
        self._broadcast_buffers_next = True
        self._in_backward = False         # a synchronised backward is running
        self._unsynced: set[int] = set()  # params with a gradient not yet averaged
        self._replaced = False            # True once a newer wrapper took this module over
        broadcast_module_state(module, group)
        self._install_hooks()

    # -- hooks -------------------------------------------------------------
    def _install_hooks(self) -> None:
        take_over(self.module, self)  # wrapping a module again unhooks the older wrapper
        self._hook_handles = register_grad_hooks([p for _, p in self._named_params], self)
        guards.install_step_guard(self)

    def _remove_hooks(self) -> None:
        for h in self._hook_handles:
            h.remove()
        self._hook_handles = []
        self._step_guard.remove()
        self._replaced = True

    def _on_grad_accumulated(self, index: int, param: nn.Parameter) -> None:
        """The hook: ``param.grad`` now holds this backward's gradient of parameter ``index``."""
        if self._sync_this_backward and not self._in_backward:
            # The first gradient of a synchronised backward: sync once autograd is done.
            guards.check_backward_start(self)
            self._forward_pending = False
            self._in_backward = True
            self._start_backward()
            Variable._execution_engine.queue_callback(self._backward_end)
            # Parameters the forward did not use get no gradient: their slots (zeros)
            # are ready now, so their buckets need not wait (torch's reducer does the same).
            for i in sorted(self._unused.at_forward - self._unsynced):
                self._unsynced.add(i)
                self._grad_ready(i, self._named_params[i][1])
        self._unsynced.add(index)
        self._unused.used.add(index)
        self._grad_accumulated(index, param)
        if self._sync_this_backward:  # inside no_sync the gradient stays local
            self._grad_ready(index, param)

    def _backward_end(self) -> None:
        """Runs inside the autograd engine once backward has computed every gradient."""
        self._in_backward = False
        if self.trace is not None:
            self.trace.mark("backward_end")
        self.finish_gradient_synchronization()
        if self.trace is not None:
            self.trace.mark("sync_end")

    # -- what subclasses fill in -------------------------------------------
    def _start_backward(self) -> None:
        """Reset per-backward state (first gradient of a synchronised backward)."""

    def _grad_accumulated(self, index: int, param: nn.Parameter) -> None:
        """A gradient was accumulated into ``param.grad`` (with or without sync)."""

    def _grad_ready(self, index: int, param: nn.Parameter) -> None:
        """A gradient is final for this synchronised backward."""

    def _reduce(self) -> None:
        raise NotImplementedError

    def _shadow_reduce(self) -> None:
        """Issue this wrapper's gradient collectives on zeros (a joined rank's share)."""
        raise NotImplementedError

    def _prepare_grads(self) -> None:
        """Get gradients ready before a forward with grad enabled (buckets: point at views)."""

    def _abort(self) -> None:
        """Drop in-flight state after a backward that did not complete."""

    # -- public API ----------------------------------------------------------
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

    def finish_gradient_synchronization(self) -> None:
        """Average, across ranks, every gradient accumulated since the last synchronisation.

        Called automatically at the end of each ``loss.backward()`` outside
        :meth:`no_sync`; calling it again does nothing. Calling it after a backward
        inside ``no_sync`` averages the accumulated gradients right away.
        """
        if not self._unsynced:
            return
        if self._unused.searched:
            # Unused here, maybe used elsewhere: reduce their (zero) slots like the rest.
            self._unsynced.update(range(len(self._named_params)))
        try:
            guards.check_all_gradients(self)
        except RuntimeError:
            self._unsynced.clear()
            self._abort()
            raise
        try:
            self._reduce()
            if self._unused.searched:
                self._unused.forget_globally_unused(self.join_device, self.group)
        finally:
            self._unsynced.clear()
            self._unused.clear()

    @property
    def find_unused_parameters(self) -> bool:
        """Whether every forward's graph is searched for unused parameters (torch's option)."""
        return self._unused.find_unused_parameters

    @property
    def static_graph(self) -> bool:
        """Whether the unused parameters are found in the first step only (torch's option)."""
        return self._unused.static_graph

    @contextlib.contextmanager
    def no_sync(self):
        """Skip gradient communication for forward/backward passes run inside this context.

        Gradients accumulate locally in ``param.grad``; the first backward after
        leaving the context averages the accumulated sum. As in torch DDP, the
        decision is taken at forward time: run the forward inside the context too.

        Gradient accumulation: A micro-steps of ``b`` examples on K ranks equal one
        step on ``b * K * A`` examples when the first A-1 run inside ``no_sync`` and
        every micro-step's loss is divided by A. Each loss is a mean over ``b``
        examples, so the accumulated gradient is A times one micro-batch's mean
        unless scaled; the all-reduce then averages over the K ranks::

            for micro, (x, y) in enumerate(micro_batches):
                ctx = model.no_sync() if micro < A - 1 else contextlib.nullcontext()
                with ctx:
                    (loss_fn(model(x), y) / A).backward()
            optimizer.step()
            optimizer.zero_grad()
        """
        old = self.require_backward_grad_sync
        self.require_backward_grad_sync = False
        try:
            yield
        finally:
            self.require_backward_grad_sync = old

    @torch.no_grad()
    def _broadcast_buffers(self) -> None:
        buffers = list(self.module.buffers())
        if not (self.broadcast_buffers and buffers):
            return
        src = self._buffer_src()
        for b in buffers:
            dist.broadcast(b, src=src, group=self.group)

    def forward(self, *args, **kwargs):
        """Run the wrapped module; broadcast rank 0's buffers first, as torch DDP does.

        The collectives of a forward, in torch DDP's order (a rank that joined under
        ``Join`` issues the same ones, see :mod:`dpcourse.ddp.join`): the "not joined"
        flag, the buffer broadcast, the "will sync gradients" flag.
        """
        guards.check_forward(self)
        if self._in_backward:  # the previous backward raised before finishing
            self._in_backward = False
            self._abort()
        self._join_pre_forward()
        # torch DDP's rule (broadcast_buffers=True): buffers follow rank 0 before a
        # forward, unless the previous forward was inside no_sync or without grad.
        if self._broadcast_buffers_next:
            self._broadcast_buffers()
        self._join_announce_sync()
        if torch.is_grad_enabled():  # a no-grad forward (evaluation) leaves pending work alone
            self._sync_this_backward = self.require_backward_grad_sync
            self._forward_pending = self._sync_this_backward
            self._unused.before_forward()
            self._prepare_grads()
        self._broadcast_buffers_next = torch.is_grad_enabled() and self.require_backward_grad_sync
        output = self.module(*args, **kwargs)
        if torch.is_grad_enabled():
            self._unused.after_forward(output, self._sync_this_backward)
        return output
