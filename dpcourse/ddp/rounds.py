"""BucketRound: one backward's collectives, launched bucket by bucket as the gradients arrive.

The schedule of lesson 06, written once for every wrapper that overlaps
communication with backward:

1. :meth:`BucketRound.start` (the first gradient of a backward) queues a callback
   on the autograd engine, which runs once the whole backward is done;
2. :meth:`BucketRound.ready` counts one more gradient of a bucket; each bucket
   whose gradients are all there is launched (``launch(b)``, asynchronously),
   strictly in bucket order: ranks match collectives by the order they are
   issued, so every rank must issue them in the same order (torch's reducer does
   the same);
3. :meth:`BucketRound.finish` (from that callback) launches the buckets still
   waiting (parameters without a gradient count as zeros) and waits for every
   launched collective, oldest first (``finish(b, handle)``).

What a launch does is the caller's: :class:`~dpcourse.ddp.DataParallelOverlapped`
divides and all-reduces a bucket, :class:`~dpcourse.zero.ShardedOptimizer`
(``gradients="sharded"``, ZeRO-2) divides and reduce-scatters it, and
:class:`~dpcourse.fsdp.FullyShardedDataParallel` reduce-scatters each unit's
gradient as autograd completes it (:meth:`BucketRound.launched`).
"""

from __future__ import annotations

import inspect
import weakref
from collections.abc import Callable, Sequence
from typing import Any

from torch.autograd import Variable


def _weakly(fn: Callable) -> Callable[[], Callable]:
    """A callable returning ``fn``; a bound method is referenced weakly."""
    if inspect.ismethod(fn):
        ref = weakref.WeakMethod(fn)
        return lambda: ref() or _gone
    return lambda: fn


def _gone(*args: Any) -> None:
    """What a callback whose owner was garbage-collected does: nothing."""


class BucketRound:
    """Count gradients per bucket, launch buckets in order as they fill, finish all after backward.

    Args:
        sizes: for each bucket, in launch order, the number of gradients it waits for.
        launch: ``launch(b) -> handle``: start bucket ``b``'s collective (``None``:
            the caller starts every collective itself and records it with :meth:`launched`).
        on_backward_end: what autograd calls once the backward :meth:`start` saw is
            done (usually the caller's ``finish_gradient_synchronization``).
        finish: ``finish(b, handle)``: wait for bucket ``b``'s collective and put its
            result in place.

    Attributes:
        in_backward: a backward has started and its end callback is queued.
        next: the next bucket to launch.
        pending: for each bucket, the gradients still missing in this round.
    """

    def __init__(self, sizes: Sequence[int], launch: Callable[[int], Any] | None,
                 on_backward_end: Callable[[], None], finish: Callable[[Any, Any], None]):
        self.sizes = list(sizes)
        # Held weakly: the round must not keep its owner (a wrapper) alive.
        self._launch, self._finish = _weakly(launch or _gone), _weakly(finish)
        self._on_backward_end = _weakly(on_backward_end)
        self.reset()

    def reset(self) -> None:
        """Forget the round: every bucket waits for all its gradients again."""
        self.pending = list(self.sizes)
        self.next = 0
        self.in_backward = False
        self.inflight: list[tuple[Any, Any]] = []  # (bucket, handle), in launch order

    def start(self) -> None:
        """Have ``on_backward_end`` run once the running backward is done (once per backward)."""
        if not self.in_backward:
            self.in_backward = True
            Variable._execution_engine.queue_callback(self._backward_end)

    def _backward_end(self) -> None:
        self.in_backward = False
        self._on_backward_end()()

    def ready(self, b: int) -> None:
        """Count one more gradient of bucket ``b``; launch the complete buckets, in order.

        Raises:
            RuntimeError: bucket ``b`` was already launched in this round (its gradient
                came from a second backward through the same graph).
        """
        if b < self.next:
            raise RuntimeError(
                f"a gradient of bucket {b} arrived after the bucket had already been "
                "reduced in this backward. This happens when one forward's graph is "
                "backpropagated twice; add the losses and call backward once, or run the "
                "first backward inside no_sync().")
        self.pending[b] -= 1
        if self.pending[b] == 0:
            self._launch_complete()

    def _launch_complete(self) -> None:
        while self.next < len(self.pending) and self.pending[self.next] == 0:
            self.inflight.append((self.next, self._launch()(self.next)))
            self.next += 1

    def launched(self, b: Any, handle: Any) -> None:
        """Record a collective the caller started itself (FSDP: one per unit, as autograd completes it)."""
        self.inflight.append((b, handle))

    def wait(self, keep: int = 0) -> None:
        """Finish every launched collective but the ``keep`` newest, oldest first."""
        done = self.inflight[:max(0, len(self.inflight) - keep)]
        self.inflight = self.inflight[len(done):]
        for b, handle in done:
            self._finish()(b, handle)

    def finish(self) -> None:
        """Launch the buckets still waiting (missing gradients count as zeros), then wait for all."""
        try:
            self.pending = [0] * len(self.sizes)
            self._launch_complete()
            self.wait()
        finally:
            self.reset()
