"""Communication hooks: replace how a wrapper reduces a bucket, with torch DDP's interface.

torch DDP lets a user swap the all-reduce of each gradient bucket for any
function ``hook(state, bucket) -> torch.futures.Future[torch.Tensor]``
(``DistributedDataParallel.register_comm_hook``). The bucket object offers
``buffer()`` (the flat gradients), ``gradients()`` (per-parameter views into
it), ``parameters()``, ``index()``, ``is_last()`` and ``set_buffer()``; the
future's value is the reduced flat tensor, which the reducer copies back into
the gradients. torch's own hooks (``default_hooks.allreduce_hook``,
``fp16_compress_hook``, ``bf16_compress_hook``, ``powerSGD_hook.powerSGD_hook``)
use only that interface, so they run unchanged on :class:`GradBucket` here.

With a hook registered the wrapper does NOT divide by the world size before
calling it: the hook owns the whole reduction, as in torch's reducer
(``torch/csrc/distributed/c10d/reducer.cpp``, ``run_comm_hook``). A wrapper
hands each of its buckets over with :func:`hand_to_hook`.

Reference: https://pytorch.org/docs/stable/ddp_comm_hooks.html
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
import torch.distributed as dist

from dpcourse.comm.averaging import divide_before_sum
from dpcourse.ddp.buckets import Bucket


class GradBucket:
    """One bucket of gradients as a communication hook sees it (torch's ``dist.GradBucket``).

    Args:
        index: position of the bucket in the reduction order (0 is reduced first).
        buffer: the flat 1-D gradient tensor of the bucket.
        gradients: per-parameter views into ``buffer``, in bucket order.
        parameters: the parameters whose gradients these are, same order.
        is_last: whether this is the last bucket reduced in the step.
    """

    def __init__(self, index: int, buffer: torch.Tensor, gradients: list[torch.Tensor],
                 parameters: list, is_last: bool):
        self._index, self._buffer, self._is_last = index, buffer, is_last
        self._gradients, self._parameters = list(gradients), list(parameters)

    def index(self) -> int:
        """Position of the bucket in the reduction order."""
        return self._index

    def buffer(self) -> torch.Tensor:
        """The flat gradient tensor (the hook may reduce it in place)."""
        return self._buffer

    def gradients(self) -> list[torch.Tensor]:
        """Per-parameter gradients, as views into :meth:`buffer`."""
        return self._gradients

    def parameters(self) -> list:
        """The parameters of the bucket, in the order of :meth:`gradients`."""
        return self._parameters

    def is_last(self) -> bool:
        """Whether this bucket is the last one reduced in this step."""
        return self._is_last

    def set_buffer(self, buffer: torch.Tensor) -> None:
        """Replace the flat tensor that :meth:`buffer` returns."""
        self._buffer = buffer


def check_comm_hook(hook) -> None:
    """Raise a clear error unless ``hook`` can be called as ``hook(state, bucket)``.

    Args:
        hook: the communication hook to validate.
    """
    if not callable(hook):
        raise TypeError(f"a communication hook must be callable as hook(state, bucket), "
                        f"got {type(hook).__name__}.")
    try:
        inspect.signature(hook).bind(None, None)
    except TypeError as exc:
        raise TypeError(
            f"a communication hook is called as hook(state, bucket) and must return a "
            f"torch.futures.Future holding the reduced flat tensor; {hook!r} does not take "
            f"two arguments ({exc})."
        ) from None
    except ValueError:  # builtins without a signature: let the first call decide
        pass


def run_comm_hook(hook, state, bucket: GradBucket) -> torch._C.Future:
    """Call ``hook(state, bucket)`` and check that it returned a future.

    Args:
        hook: the registered hook.
        state: the hook's state (e.g. a process group, a ``PowerSGDState``, or ``None``).
        bucket: the bucket to reduce.

    Returns:
        The future of the reduced flat tensor.
    """
    fut = hook(state, bucket)
    if not isinstance(fut, torch._C.Future):  # torch.futures.Future and the C++ futures of collectives
        raise TypeError(
            f"the communication hook {getattr(hook, '__name__', hook)!r} returned "
            f"{type(fut).__name__}; it must return a torch.futures.Future whose value is the "
            "reduced flat tensor, e.g. dist.all_reduce(t, async_op=True).get_future()"
            ".then(lambda fut: fut.value()[0])."
        )
    return fut


@torch.no_grad()
def finish_comm_hook(fut: torch._C.Future, bucket: GradBucket,
                     buffer: torch.Tensor) -> None:
    """Wait for a hook's future and write its result into the bucket's own ``buffer``.

    The reducer copies the hook's result back into the bucket storage, which the
    parameters' ``.grad`` views share; a hook that reduced in place returns
    that storage itself and nothing is copied.

    Args:
        fut: what the hook returned.
        bucket: the :class:`GradBucket` passed to the hook.
        buffer: the wrapper's flat gradient storage for this bucket.
    """
    result = fut.wait()
    if isinstance(result, (list, tuple)):  # a hook returning the raw work result
        result = result[0]
    if not isinstance(result, torch.Tensor) or result.numel() != buffer.numel():
        raise RuntimeError(
            f"the communication hook's future for bucket {bucket.index()} holds "
            f"{type(result).__name__} of {getattr(result, 'numel', lambda: '?')()} elements; "
            f"it must hold the reduced flat tensor of {buffer.numel()} elements."
        )
    if result.data_ptr() != buffer.data_ptr():
        buffer.copy_(result.view_as(buffer))


def mean_allreduce_hook(process_group, bucket: GradBucket) -> torch.futures.Future:
    """Average the bucket over the group with one asynchronous all-reduce (torch's ``allreduce_hook``).

    Args:
        process_group: group to average over (``None``: the default group).
        bucket: the bucket.

    Returns:
        Future of the averaged flat tensor (the bucket's buffer, reduced in place).
    """
    tensor = bucket.buffer()
    # Divide before summing, as torch DDP does (why: dpcourse.comm.averaging).
    divide_before_sum(tensor, dist.get_world_size(process_group))
    work = dist.all_reduce(tensor, group=process_group, async_op=True)
    return work.get_future().then(lambda fut: fut.value()[0])


class HookWork:
    """A hook's pending reduction of one bucket, waited on like a collective's work handle.

    Args:
        fut: the future the hook returned.
        bucket: the :class:`GradBucket` it was given.
        buffer: the wrapper's flat gradient storage the result is copied into.
    """

    def __init__(self, fut: torch._C.Future, bucket: GradBucket, buffer: torch.Tensor):
        self.fut, self.bucket, self.buffer = fut, bucket, buffer

    def wait(self) -> None:
        """Wait for the hook's result and copy it into the gradient storage."""
        finish_comm_hook(self.fut, self.bucket, self.buffer)


def launch_comm_hook(hook, state, index: int, buffer: torch.Tensor, gradients, parameters,
                     is_last: bool) -> HookWork:
    """Hand one bucket to ``hook``; return the pending work (call ``.wait()`` to finish it).

    Args:
        hook: the registered hook, called as ``hook(state, bucket)``.
        state: the hook's state.
        index: the bucket's position in the reduction order.
        buffer: flat gradient storage of the bucket.
        gradients: per-parameter views into ``buffer``.
        parameters: the matching parameters.
        is_last: whether this is the step's last bucket.

    Returns:
        A :class:`HookWork`.
    """
    bucket = GradBucket(index, buffer, gradients, parameters, is_last)
    return HookWork(run_comm_hook(hook, state, bucket), bucket, buffer)


def hand_to_hook(hook, state, bucket: Bucket, is_last: bool,
                 group: dist.ProcessGroup | None) -> HookWork | None:
    """Hand one of a wrapper's buckets to its registered hook, in place of divide and all-reduce.

    Args:
        hook: the registered hook, called as ``hook(state, bucket)``.
        state: the hook's state.
        bucket: the wrapper's :class:`~dpcourse.ddp.buckets.Bucket` (its buffer, views, params).
        is_last: whether this is the last bucket reduced in the step.
        group: the wrapper's process group (its backend decides when the work is finished).

    Returns:
        The pending :class:`HookWork`, or ``None`` when the bucket is already finished (gloo).
    """
    work = launch_comm_hook(hook, state, bucket.index, bucket.buffer, bucket.views,
                            bucket.params, is_last)
    # A hook may issue more collectives from its future's callbacks (PowerSGD does).
    # NCCL runs those callbacks at once on this thread; gloo runs them later on its
    # own thread, where they could interleave with the next bucket's collectives in a
    # different order on each rank. There, finish each bucket before the next.
    if dist.get_backend(group) != "nccl":
        work.wait()
        return None
    return work
