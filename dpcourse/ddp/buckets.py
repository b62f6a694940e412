"""A bucket: one flat gradient buffer, reduced with one all-reduce instead of one per parameter.

Every collective pays a fixed start-up cost (latency) on top of the time to
move its bytes, so reducing 100 small gradients one by one costs ~100
latencies. Packing them into a few flat buffers of about ``bucket_cap_mb``
MiB each pays only a few, while buckets small enough to be ready early still
let communication overlap with the rest of backward.

A :class:`Bucket` holds one flat buffer (one dtype, one device) with a slot per
gradient, a view shaped like its parameter; with ``gradient_as_bucket_view``
that view is ``param.grad`` itself. :meth:`Bucket.launch` averages the whole
buffer with one all-reduce; gradients kept apart from their slots are copied in
before it and back out when its handle is waited for. Which gradients share a
bucket is :mod:`dpcourse.ddp.bucket_assignment`'s question; :func:`buckets_in_order`
and :func:`rebuild_buckets` build a wrapper's buckets from its answer.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from dpcourse.comm.averaging import divide_before_sum
from dpcourse.ddp.bucket_assignment import agree_on_order, assign_buckets
from dpcourse.formatting import MiB

Where = dict[int, tuple[int, int]]  # parameter index -> (bucket, slot in it)


@dataclass(eq=False)
class Bucket:
    """One flat gradient buffer and the parameters whose gradients are views into it.

    Every wrapper reduces a bucket through :meth:`launch`, a communication hook
    included; when the bucket is launched during backward is
    :class:`~dpcourse.ddp.rounds.BucketRound`'s question (lesson 06).

    Attributes:
        index: position in the reduction order.
        indices: positions of its parameters in the wrapper's trainable-parameter list.
        names: parameter names, in the order their gradients arrive.
        params: the parameters themselves.
        buffer: the flat 1-D gradient storage (one dtype, one device).
        views: ``views[k]`` is ``buffer``'s slice shaped like ``params[k]``.
        grads_are_views: each ``params[k].grad`` is ``views[k]`` (torch's
            ``gradient_as_bucket_view=True``); False: separate gradients, copied into
            the buffer at :meth:`launch` and back out when its handle is waited for.
        placed: slots already put into the buffer, divided, by :meth:`place_grad`
            since the last :meth:`launch`.
    """

    index: int
    indices: list[int]
    names: list[str]
    params: list[nn.Parameter]
    buffer: torch.Tensor
    views: list[torch.Tensor] = field(repr=False)
    grads_are_views: bool = field(default=True, repr=False)
    placed: set[int] = field(default_factory=set, repr=False)

    @property
    def numel(self) -> int:
        """Number of gradient elements in the bucket."""
        return self.buffer.numel()

    @property
    def nbytes(self) -> int:
        """Size of the bucket in bytes (what one all-reduce of it moves per rank)."""
        return self.buffer.numel() * self.buffer.element_size()

    def __repr__(self) -> str:
        return f"Bucket({self.index}, {self.nbytes / MiB:.3f} MiB, {self.names})"

    @torch.no_grad()
    def attach_grad(self, k: int) -> None:
        """Make ``params[k].grad`` the bucket's view, copying a gradient that lives elsewhere in.

        After ``zero_grad(set_to_none=True)`` (the default) autograd hands the
        parameter a freshly allocated gradient; torch's reducer then copies it
        into the bucket and re-points ``param.grad``. Same here.
        """
        param, view = self.params[k], self.views[k]
        if param.grad is None:
            view.zero_()
        elif param.grad is not view:
            view.copy_(param.grad)
        param.grad = view

    def place_grad(self, k: int, divisor: int | None) -> None:
        """Put ``params[k].grad`` into its slot, dividing it by ``divisor`` (``None``: as is).

        The overlapped wrapper calls it from the gradient's hook, as torch's reducer
        does: dividing while copying reads and writes the gradient once, where copying
        at launch and then dividing the whole bucket would read and write it twice.
        A gradient that already is the slot (``gradient_as_bucket_view``) is divided
        in place. ``divisor=None`` is for a communication hook, which divides itself.
        """
        if torch.is_grad_enabled():
            # Autograd runs a backward, hooks included, in grad mode only under
            # backward(create_graph=True); only then is no_grad needed, to keep the copy
            # out of the graph. (A @torch.no_grad() decorator would enter it for every
            # gradient: about a microsecond of host time each.)
            with torch.no_grad():
                return self.place_grad(k, divisor)
        param, view = self.params[k], self.views[k]
        grad = param.grad
        if grad is None:
            view.zero_()  # no gradient this step: the slot contributes zeros
        elif grad is view:
            if divisor is not None:
                view.div_(divisor)
        elif divisor is not None:
            torch.mul(grad, 1.0 / divisor, out=view)  # torch's reducer multiplies by 1/N here
        else:
            view.copy_(grad)
        if self.grads_are_views and grad is not view:
            param.grad = view
        self.placed.add(k)

    @torch.no_grad()
    def launch(self, all_reduce: Callable[..., Any], divisor: int, async_op: bool,
               comm_hook: Callable[[Bucket], Any] | None = None) -> Any:
        """Average the bucket in place: divide by ``divisor``, then ``all_reduce`` the buffer.

        Slots :meth:`place_grad` already filled (divided) are left as they are; the
        others are filled and divided here.

        Args:
            all_reduce: ``fn(tensor, async_op=...)`` summing over the ranks in place.
            divisor: what the sum is divided by: the number of ranks averaged over
                (the world size; under ``Join``, optionally the ranks still training).
            async_op: return the work handle instead of blocking.
            comm_hook: ``fn(bucket) -> work or None`` that replaces both steps: a
                registered communication hook owns the whole reduction, so nothing is
                divided first (see :mod:`dpcourse.ddp.comm_hooks`).

        Returns:
            What to ``wait()`` for before the averaged gradients may be read (on GPU:
            it orders the current stream after the collective; with separate gradients
            it also copies the result into each ``param.grad``), or ``None``.
        """
        divided = bool(self.placed)  # the hook put (and divided) some slots: the rest now
        if divided:
            for k in range(len(self.params)):
                if k not in self.placed:
                    self.place_grad(k, None if comm_hook is not None else divisor)
            self.placed.clear()
        else:
            self.gather_grads()
        if comm_hook is not None:
            work = comm_hook(self)
        else:
            if not divided:  # before the sum, as torch DDP does (why: dpcourse.comm.averaging)
                divide_before_sum(self.buffer, divisor)
            work = all_reduce(self.buffer, async_op=async_op)
        return work if self.grads_are_views else _CopyOut(work, self)

    def gather_grads(self) -> None:
        """Make the buffer hold every ``param.grad`` of the bucket before it is reduced."""
        if self.grads_are_views:
            for k, (p, view) in enumerate(zip(self.params, self.views)):
                if p.grad is not view:
                    self.attach_grad(k)  # param.grad was replaced after backward
            return
        grads = [p.grad for p in self.params]  # separate gradients: copy them in
        if all(g is not None for g in grads):
            torch._foreach_copy_(self.views, grads)  # type: ignore[arg-type]  # one call per bucket
            return
        for g, view in zip(grads, self.views):
            view.copy_(g) if g is not None else view.zero_()  # zeros where unused


class _CopyOut:
    """Wait for a bucket's reduction, then copy the result into the separate ``param.grad``."""

    def __init__(self, work: Any, bucket: Bucket):
        self.work, self.bucket = work, bucket

    @torch.no_grad()
    def wait(self) -> None:
        if self.work is not None:  # None: a custom all_reduce= or a blocking call finished
            self.work.wait()
        params, views = self.bucket.params, self.bucket.views
        if all(p.grad is not None for p in params):
            torch._foreach_copy_([p.grad for p in params], views)  # type: ignore[misc]  # one call
            return
        for p, view in zip(params, views):
            if p.grad is None:
                p.grad = view.clone()
            else:
                p.grad.copy_(view)


def views_into(buffer: torch.Tensor, params: list[nn.Parameter]) -> list[torch.Tensor]:
    """Slice the flat ``buffer`` into one view per parameter, shaped like it, in order."""
    views, offset = [], 0
    for p in params:
        views.append(buffer[offset:offset + p.numel()].view(p.shape))
        offset += p.numel()
    return views


def buckets_in_order(named_params, bucket_cap_mb: float, order: list[int] | None = None, *,
                     first_bucket_mb: float | None = None,
                     gradient_as_bucket_view: bool = True) -> tuple[list[Bucket], Where]:
    """Build a wrapper's buckets: in reverse registration order, or in ``order`` (a rebuild).

    Which parameters share a bucket is
    :func:`~dpcourse.ddp.bucket_assignment.assign_buckets`'s answer; here each
    bucket gets its flat buffer and a view into it per parameter.

    Args:
        named_params: the trainable ``(name, parameter)`` pairs, registration order.
        bucket_cap_mb: the cap of the buckets, the first one's too unless ``first_bucket_mb``
            is given.
        order: parameter indices in the order their gradients arrived; ``None``:
            reverse registration order, the guess before any backward ran.
        first_bucket_mb: the cap of the first bucket; ``None``: ``bucket_cap_mb``.
        gradient_as_bucket_view: ``param.grad`` is a view into its bucket
            (see :class:`Bucket`).

    Returns:
        ``(buckets, where)``: the buckets in reduction order, and for each parameter
        index ``(bucket index, position inside the bucket)``.
    """
    assignment = assign_buckets([p for _, p in named_params], bucket_cap_mb, order=order,
                                first_bucket_mb=first_bucket_mb)
    buckets, where = [], {}
    for b, indices in enumerate(assignment):
        params = [named_params[i][1] for i in indices]
        buffer = torch.zeros(sum(p.numel() for p in params), dtype=params[0].dtype,
                             device=params[0].device)
        for k, i in enumerate(indices):
            where[i] = (b, k)
        names = [named_params[i][0] for i in indices]
        buckets.append(Bucket(b, indices, names, params, buffer, views_into(buffer, params),
                              gradient_as_bucket_view))
    return buckets, where


@torch.no_grad()
def rebuild_buckets(named_params, arrival: list[int], device, group, bucket_cap_mb: float, *,
                    first_bucket_mb: float | None = None,
                    gradient_as_bucket_view: bool = True) -> tuple[list[Bucket], Where]:
    """Build new buckets in rank 0's arrival order (one broadcast), keeping accumulated gradients.

    Args:
        named_params: the trainable ``(name, parameter)`` pairs, registration order.
        arrival: the order this rank saw gradients arrive in its first synchronised backward.
        device: device of the broadcast order (a GPU for NCCL).
        group: process group (``None``: the default group).
        bucket_cap_mb, first_bucket_mb, gradient_as_bucket_view: as :func:`buckets_in_order`.

    Returns:
        ``(buckets, where)``, as :func:`buckets_in_order`.
    """
    order = agree_on_order(arrival, len(named_params), device, group)
    buckets, where = buckets_in_order(named_params, bucket_cap_mb, order,
                                      first_bucket_mb=first_bucket_mb,
                                      gradient_as_bucket_view=gradient_as_bucket_view)
    if gradient_as_bucket_view:  # keep accumulated gradients, now in the new buckets
        for bucket in buckets:
            for k, p in enumerate(bucket.params):
                if p.grad is not None:
                    bucket.attach_grad(k)
    return buckets, where


@torch.no_grad()
def attach_grads_to_buckets(buckets: list[Bucket]) -> None:
    """Make every ``param.grad`` its bucket view before backward, so autograd adds in place.

    Optimizers' ``zero_grad()`` sets gradients to ``None`` by default. Left
    alone, autograd would then hand each parameter a freshly allocated
    gradient and the hook would copy it into the bucket: one copy kernel and
    one Python call per parameter, on the thread that runs backward. Zeroing
    the bucket once here (one kernel per bucket) and re-pointing the
    gradients lets autograd accumulate straight into the buckets.
    """
    for bucket in buckets:
        if all(p.grad is None for p in bucket.params):
            bucket.buffer.zero_()
            for p, view in zip(bucket.params, bucket.views):
                p.grad = view
            continue
        bucket.gather_grads()
