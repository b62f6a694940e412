"""DataParallelOverlapped: start each bucket's all-reduce while backward is still running.

Backward computes gradients from the last layer to the first. As soon as the
last gradient of a bucket has been accumulated, its post-accumulate-grad hook
launches that bucket's all-reduce asynchronously (``async_op=True``) and
returns, so autograd goes on computing earlier layers' gradients while the
bytes move. When backward ends, a callback queued on the autograd engine waits
for the outstanding work handles. A step then costs about
``max(compute, communication)`` instead of their sum, apart from the last
bucket, which can only start when backward is done.

Per backward: :meth:`DataParallelOverlapped._reset_round` when it starts. One
gradient's path: the hook -> :meth:`DataParallelOverlapped._grad_ready`
-> ``Bucket.mark_ready`` -> :meth:`DataParallelOverlapped._launch_ready_buckets`
-> ``Bucket.launch`` -> the all-reduce. At the end of backward,
:meth:`DataParallelOverlapped._reduce` launches what is left and waits.

Buckets are launched strictly in index order, even if a later one is complete
first: collectives are matched across ranks by the order they are issued, so
every rank must issue them in the same order (torch's reducer does the same).
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist
from torch import nn

from dpcourse.comm.p2p import AllReduce
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
        **options: torch DDP's options, see :class:`~dpcourse.ddp.DataParallelBucketed`
            (``broadcast_buffers``, ``find_unused_parameters``, ``static_graph``,
            ``first_bucket_mb``, ``rebuild_buckets``, ``gradient_as_bucket_view``).

    Attributes:
        buckets: list of :class:`~dpcourse.ddp.buckets.Bucket` in launch order.
        trace: optionally a :class:`dpcourse.comm.CommTrace`; the wrapper marks
            ``"backward_end"`` on it when autograd has computed every gradient
            (before waiting), so a lesson can see which all-reduces started earlier.
    """

    def __init__(self, module: nn.Module, *, bucket_cap_mb: float = 25.0,
                 group: dist.ProcessGroup | None = None, all_reduce: AllReduce | None = None,
                 **options: Any):
        super().__init__(module, bucket_cap_mb=bucket_cap_mb, group=group, all_reduce=all_reduce,
                         **options)
        self._reset_round()

    def _buckets_rebuilt(self) -> None:
        self._reset_round()

    def _reset_round(self) -> None:
        """Forget the previous synchronisation: every bucket waits for all its gradients again."""
        for bucket in self.buckets:
            bucket.reset()  # pending = its number of parameters, counting down; nothing launched
        self._next_bucket = 0  # the next bucket to launch; launches happen in index order

    def _start_backward(self) -> None:
        self._reset_round()

    def _grad_ready(self, index: int, param: nn.Parameter) -> None:
        super()._grad_ready(index, param)  # notes the arrival order for a rebuild
        b, k = self._where[index]
        if self.buckets[b].mark_ready(k):
            self._launch_ready_buckets()

    def _launch_ready_buckets(self) -> None:
        while self._next_bucket < len(self.buckets) and self.buckets[self._next_bucket].pending == 0:
            self.buckets[self._next_bucket].launch(self.all_reduce, self._gradient_divisor(),
                                                   async_op=True, comm_hook=self._bucket_hook())
            self._next_bucket += 1

    def _reduce(self) -> None:
        """End of backward: launch what is left, wait for every bucket, start a new round."""
        try:
            # 1. Buckets still waiting got their gradients in a no_sync backward, or this
            #    is an explicit call (every parameter has a gradient: checked by the caller).
            for bucket in self.buckets[self._next_bucket:]:
                bucket.pending = 0
            self._launch_ready_buckets()
            # 2. Wait, in launch order (on GPU: the current stream waits for each collective).
            for bucket in self.buckets:
                bucket.wait()
        finally:
            # 3. Forget this round: every bucket waits for its gradients again.
            self._reset_round()

    def _abort(self) -> None:
        self._reset_round()
