"""torch DDP's methods that every wrapper has alike, written once and bound by name in each class.

``no_sync()``, ``register_comm_hook()`` and the three things ``Join`` asks of
the object it is given (``join_hook()``, ``join_device``, ``join_process_group``)
behave the same in :class:`~dpcourse.ddp.DataParallelNaive`,
:class:`~dpcourse.ddp.DataParallelBucketed` and
:class:`~dpcourse.ddp.DataParallelOverlapped`; the work behind the last four is
the wrapper's :class:`~dpcourse.ddp.reducer.Reducer` (lessons 10 and 11). Each
wrapper class binds them as its own (``no_sync = torch_interface.no_sync``), so
that ``model.no_sync()`` and ``Join([model])`` work as with torch DDP, without a
base class.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch.distributed as dist
from torch.distributed.algorithms.join import JoinHook


@contextlib.contextmanager
def no_sync(wrapper: Any) -> Iterator[None]:
    """Skip gradient communication for forward/backward passes run inside this context.

    Gradients accumulate locally in ``param.grad``; the first backward after
    leaving the context averages the accumulated sum. As in torch DDP, the
    decision is taken at forward time: run the forward inside the context too.
    """
    old = wrapper.require_backward_grad_sync
    wrapper.require_backward_grad_sync = False
    try:
        yield
    finally:
        wrapper.require_backward_grad_sync = old


def register_comm_hook(wrapper: Any, state: Any, hook) -> None:
    """Let ``hook(state, bucket) -> Future[Tensor]`` reduce each bucket (torch DDP's API).

    The wrapper then does not divide by the world size first: the hook owns the
    reduction (see :mod:`dpcourse.ddp.comm_hooks`). ``DataParallelNaive`` hands it
    each parameter as a bucket of its own.
    """
    wrapper.reducer.register_comm_hook(state, hook)


def join_hook(wrapper: Any, **kwargs) -> JoinHook:
    """Return the hook ``Join`` calls once this rank has run out of data (see :mod:`dpcourse.ddp.join`)."""
    return wrapper.reducer.join_hook(**kwargs)


join_device = property(lambda wrapper: wrapper.reducer.device,
                       doc="Device of the gradients (where Join's flags live).")
join_process_group = property(
    lambda wrapper: wrapper.reducer.group if wrapper.reducer.group is not None else dist.group.WORLD,
    doc="The group the wrapper averages over.")
JOINABLE = (join_hook, join_device, join_process_group)  # what torch's Join asks of a Joinable


def finish_after_backward(wrapper: Any) -> None:
    """What a wrapper does once autograd has computed every gradient: synchronise them.

    Marks ``"backward_end"`` before and ``"sync_end"`` after on ``wrapper.trace``
    (a :class:`dpcourse.comm.CommTrace`), if one is set.
    """
    if wrapper.trace is not None:
        wrapper.trace.mark("backward_end")
    wrapper.finish_gradient_synchronization()
    if wrapper.trace is not None:
        wrapper.trace.mark("sync_end")


def remove_hooks(wrapper: Any) -> None:
    """Stop ``wrapper``: remove its gradient hooks and its optimizer-step guard."""
    for handle in wrapper._hook_handles:
        handle.remove()
    wrapper._hook_handles = []
    wrapper._step_guard.remove()
    wrapper._replaced = True


__all__ = ["no_sync", "register_comm_hook", "join_hook", "join_device", "join_process_group",
           "JOINABLE", "finish_after_backward", "remove_hooks"]
