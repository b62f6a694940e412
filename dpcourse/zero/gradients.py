"""Where a ShardedOptimizer's gradient shards come from: the three ``gradients=`` modes (lesson 13).

Rank ``r`` steps only its shard of each parameter, so it needs the averaged
gradient of that shard only. :class:`GradientShards` gives each shard its
``.grad`` before the step, in one of three ways:

* ``"averaged"`` (ZeRO-1 over DDP): a data-parallel wrapper (ours or torch's)
  has already all-reduced ``param.grad``; the shard's gradient is a slice of it.
  Per step: an all-reduce plus the step's all-gather, 1.5x DDP's bytes.
* ``"reduce_scatter"`` (ZeRO-1): the model is NOT wrapped; ``param.grad`` holds
  this rank's local gradient, and at the step each bucket is reduce-scattered,
  so each rank receives the sum of only its shard. A reduce-scatter plus an
  all-gather is exactly what an all-reduce is made of: the same bytes as DDP.
  Full-size gradients stay in memory (free gradient accumulation).
* ``"sharded"`` (ZeRO-2): as ``"reduce_scatter"``, but each bucket is
  reduce-scattered from a backward hook as soon as its gradients are complete
  (overlapping backward: lesson 06's :class:`~dpcourse.ddp.rounds.BucketRound`
  with a reduce-scatter in place of the all-reduce), its full gradients are
  freed (``param.grad = None``), and only this rank's gradient shard is kept and
  accumulated. Gradient memory per rank falls to ~1/N; same bytes as DDP.

A bucket is reduce-scattered as one ``(N, row)`` matrix
(:class:`~dpcourse.zero.layout.ShardBucket`): rank ``r`` receives row ``r``, its
chunk of every parameter of the bucket side by side.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from dpcourse.comm.averaging import divide_before_sum
from dpcourse.comm.sharding import shard_range
from dpcourse.ddp.rounds import BucketRound
from dpcourse.zero.collectives import reduce_scatter
from dpcourse.zero.layout import ShardBucket

GRADIENT_MODES = ("averaged", "reduce_scatter", "sharded")

__all__ = ["GRADIENT_MODES", "GradientShards"]


class GradientShards:
    """This rank's shard of every averaged gradient, made by one of the ``gradients=`` modes.

    Args:
        params: the trainable parameters, full size (as the model holds them).
        shards: this rank's 1-D view of each of ``params`` (what the inner optimizer steps).
        buckets: the :class:`~dpcourse.zero.layout.ShardBucket` list, one collective each.
        mode: one of :data:`GRADIENT_MODES` (module docstring).
        group: process group (``None``: the default group).

    Attributes:
        rows: per bucket, this rank's row of averaged gradients (``None``: none yet).
            ``"sharded"`` accumulates into it over backwards until :meth:`clear`;
            ``"reduce_scatter"`` fills it at each step.
    """

    def __init__(self, params: list[torch.Tensor], shards: list[torch.Tensor],
                 buckets: list[ShardBucket], mode: str, group: dist.ProcessGroup | None):
        self.params, self.shards, self.buckets = params, shards, buckets
        self.mode, self.group = mode, group
        self.world_size, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.rows: list[torch.Tensor | None] = [None] * len(buckets)
        self._ranges = [shard_range(p.numel(), self.world_size, self.rank) for p in params]
        self._hooks: list = []
        if mode == "sharded":
            self._round = BucketRound([len(b.params) for b in buckets], self._launch_async,
                                      on_backward_end=self._backward_end,
                                      finish=self._finish_bucket)
            bucket_of = {i: b for b, bucket in enumerate(buckets) for i in bucket.indices}
            self._hooks = [p.register_post_accumulate_grad_hook(self._hook_for(bucket_of[i]))
                           for i, p in enumerate(params)]

    # -- one bucket's reduce-scatter ----------------------------------------------
    def _reduce_scatter(self, b: int, async_op: bool) -> tuple[Any, torch.Tensor, torch.Tensor]:
        """Reduce-scatter bucket ``b``'s full gradients; return ``(work, out, matrix)``."""
        bucket = self.buckets[b]
        matrix = bucket.new_matrix(self.world_size)
        bucket.pack(matrix, [p.grad for p in bucket.params])
        if self.mode == "sharded":
            for p in bucket.params:
                p.grad = None  # ZeRO-2: the full gradient is not kept
        # Divide before summing, as DDP does (why: dpcourse.comm.averaging).
        divide_before_sum(matrix, self.world_size)
        out = torch.empty(bucket.row, dtype=matrix.dtype, device=matrix.device)
        work = reduce_scatter(out, matrix.view(-1), group=self.group, async_op=async_op)
        return work, out, matrix

    def _accumulate(self, b: int, out: torch.Tensor) -> None:
        acc = self.rows[b]
        self.rows[b] = out if acc is None else acc.add_(out)

    # -- ZeRO-2: lesson 06's round of buckets, a reduce-scatter in place of the all-reduce
    def _hook_for(self, b: int):
        def hook(param):
            self._round.start()   # the first gradient of a backward: _backward_end at its end
            self._round.ready(b)  # bucket b's last gradient: reduce-scatter it, in bucket order
        return hook

    def _launch_async(self, b: int):
        return self._reduce_scatter(b, async_op=True)

    @torch.no_grad()
    def _finish_bucket(self, b: int, handle) -> None:
        work, out, _matrix = handle
        work.wait()  # bucket b's reduce_scatter, launched with async_op=True
        self._accumulate(b, out)  # the full-size matrix is released here

    @torch.no_grad()
    def _backward_end(self) -> None:
        """After backward: reduce what is still missing (unused parameters count as zero), wait."""
        self._round.finish()

    # -- before and after the step --------------------------------------------------
    @torch.no_grad()
    def point_shard_grads(self) -> None:
        """Give every shard its ``.grad``: this rank's slice of the averaged gradient (a view)."""
        if self.mode == "averaged":
            for p, s, (lo, hi) in zip(self.params, self.shards, self._ranges):
                s.grad = None if p.grad is None else p.grad.view(-1)[lo:hi]
            return
        if self.mode == "reduce_scatter":
            self.rows = [None] * len(self.buckets)
            for b in range(len(self.buckets)):
                _, out, _ = self._reduce_scatter(b, async_op=False)
                self._accumulate(b, out)
        for b, bucket in enumerate(self.buckets):
            row = self.rows[b]
            for i, off in zip(bucket.indices, bucket.offsets):
                n = self.shards[i].numel()
                self.shards[i].grad = None if row is None else row[off:off + n]

    def release(self) -> None:
        """After the step: drop the shards' ``.grad`` views, so they keep no gradient alive."""
        for s in self.shards:
            s.grad = None  # views into full gradients must not keep them alive
        if self.mode == "reduce_scatter":
            self.rows = [None] * len(self.buckets)  # rebuilt from param.grad at each step

    def clear(self) -> None:
        """Forget the accumulated gradient shards (``zero_grad``)."""
        self.rows = [None] * len(self.buckets)

    def remove_hooks(self) -> None:
        """Remove the backward hooks of ``"sharded"``."""
        for h in self._hooks:
            h.remove()
        self._hooks = []
