"""DataParallelOverlapped: start each bucket's all-reduce while backward is still running.

Backward computes gradients from the last layer to the first. As soon as the
last gradient of a bucket has been accumulated, its post-accumulate-grad hook
launches that bucket's all-reduce asynchronously (``async_op=True``) and
returns, so autograd goes on computing earlier layers' gradients while the
bytes move. When backward ends, a callback queued on the autograd engine waits
for the outstanding work handles. A step then costs about
``max(compute, communication)`` instead of their sum, apart from the last
bucket, which can only start when backward is done.

Buckets are launched strictly in index order, even if a later one is complete
first: collectives are matched across ranks by the order they are issued, so
every rank must issue them in the same order (torch's reducer does the same).
"""

from __future__ import annotations

from torch import nn

from dpcourse.ddp.bucketed import DataParallelBucketed


class DataParallelOverlapped(DataParallelBucketed):
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

    Attributes:
        buckets: list of :class:`~dpcourse.ddp.buckets.Bucket` in launch order.
        trace: optionally a :class:`dpcourse.comm.CommTrace`; the wrapper marks
            ``"backward_end"`` on it when autograd has computed every gradient
            (before waiting), so a lesson can see which all-reduces started earlier.
    """

    def __init__(self, module: nn.Module, *, bucket_cap_mb: float = 25.0, group=None,
                 all_reduce=None):
        super().__init__(module, bucket_cap_mb=bucket_cap_mb, group=group, all_reduce=all_reduce)
        self._reset_round()

    def _reset_round(self) -> None:
        """Forget the previous synchronisation: nothing launched, every bucket waiting."""
        self._pending = [len(b.params) for b in self.buckets]
        self._next_bucket = 0  # the next bucket to launch; launches happen in index order
        self._works = []

    def _start_backward(self) -> None:
        self._reset_round()

    def _grad_ready(self, index: int, param: nn.Parameter) -> None:
        b, _ = self._where[index]
        if b < self._next_bucket:
            name = self._named_params[index][0]
            raise RuntimeError(
                f"the gradient of {name} arrived after its bucket had already been all-reduced "
                "in this backward. This happens when one forward's graph is backpropagated "
                "twice; add the losses and call backward once, or run the first backward "
                "inside no_sync()."
            )
        self._pending[b] -= 1
        self._launch_ready_buckets()

    def _launch_ready_buckets(self) -> None:
        while self._next_bucket < len(self.buckets) and self._pending[self._next_bucket] == 0:
            work = self._launch(self.buckets[self._next_bucket], async_op=True)
            if work is not None:
                self._works.append(work)
            self._next_bucket += 1

    def _reduce(self) -> None:
        # Every parameter has a gradient (checked by the caller): buckets still waiting
        # got theirs in a no_sync backward, or this is an explicit call. Launch them now.
        for b in range(self._next_bucket, len(self.buckets)):
            self._pending[b] = 0
        self._launch_ready_buckets()
        works, self._works = self._works, []
        try:
            for work in works:
                work.wait()  # on GPU: makes the current stream wait for the collective
        finally:
            self._reset_round()

    def _abort(self) -> None:
        self._reset_round()
