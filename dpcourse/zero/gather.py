"""After a sharded step: all-gather the new shards, now or just before the next forward needs them.

:meth:`ShardedOptimizer.step` updates only this rank's shard of each parameter.
:class:`ParamGather` then all-gathers the shards, one collective per bucket
(row ``r`` of the ``(N, row)`` matrix comes from rank ``r``,
:class:`~dpcourse.zero.layout.ShardBucket`), and copies the result into the
parameters.

Nothing overlaps that all-gather if the step waits for it: the backward is
over, and the next forward cannot start without the weights. But the next
forward does not need every weight at once. Given the model, :class:`ParamGather`
only launches the gathers at the step, and each module waits, in a forward
pre-hook, for the buckets that hold its own parameters: the last layers' weights
travel while the first layers compute, as FSDP prefetches its units (lesson 14).
The gathers are launched first-layer-first (the reverse of the buckets' backward
order), so that the first module's wait does not queue behind the last layer's weights.

Until a bucket is waited for, its parameters hold this rank's new shard and
everyone else's old one. Whatever else reads or writes them must wait first:
the model's ``state_dict()`` and ``load_state_dict()`` do (pre-hooks), the
optimizer does at its next step and checkpoint calls, and any other code calls
:meth:`ParamGather.wait`.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from dpcourse.zero.collectives import all_gather
from dpcourse.zero.layout import ShardBucket

__all__ = ["ParamGather"]


class ParamGather:
    """All-gather each bucket's updated shards into the full parameters.

    Args:
        buckets: the optimizer's buckets, in backward order.
        shards: this rank's 1-D shard of each parameter (indexed as ``bucket.indices``).
        group: process group (``None``: the default group).
        module: the model that holds the parameters, or ``None``. Given, :meth:`start`
            returns at once and each of its modules waits for its own parameters' buckets
            just before its forward; ``None``: :meth:`start` waits for every bucket.

    Raises:
        ValueError: ``module`` does not hold every parameter of ``buckets``.
    """

    def __init__(self, buckets: list[ShardBucket], shards: list[torch.Tensor],
                 group: dist.ProcessGroup | None, module: nn.Module | None = None):
        self.buckets, self.shards, self.group = buckets, shards, group
        self.world_size = dist.get_world_size(group)
        self.deferred = module is not None
        # bucket index -> (work, gathered matrix, this rank's row): launched, not yet copied
        self._pending: dict[int, tuple] = {}
        self._hooks: list = []
        if module is not None:
            self._hooks = self._attach(module)

    def _attach(self, model: nn.Module) -> list:
        bucket_of = {id(p): b for b, bucket in enumerate(self.buckets) for p in bucket.params}
        held = {id(p) for p in model.parameters()}
        if not bucket_of.keys() <= held:
            raise ValueError("gather_in_forward must be the model whose parameters the "
                             "optimizer steps (or a module holding all of them): some "
                             "parameters are not in it.")
        hooks = []
        for m in model.modules():
            mine = sorted({bucket_of[id(p)] for p in m.parameters(recurse=False)
                           if id(p) in bucket_of})
            if mine:
                hooks.append(m.register_forward_pre_hook(self._waiter(mine)))
        hooks.append(model.register_state_dict_pre_hook(lambda *args: self.wait()))
        hooks.append(model.register_load_state_dict_pre_hook(lambda *args: self.wait()))
        return hooks

    def _waiter(self, buckets: list[int]):
        def pre_forward(module, args):
            self.wait(buckets)
        return pre_forward

    @torch.no_grad()
    def start(self) -> None:
        """Launch every bucket's all-gather (first layers first); wait unless deferred."""
        self.wait()  # a gather still in flight would overwrite the shards just stepped
        for b in reversed(range(len(self.buckets))):
            bucket = self.buckets[b]
            mine = bucket.new_matrix(1)  # this rank's row: its shard of each parameter
            bucket.pack(mine, [self.shards[i] for i in bucket.indices])
            full = bucket.new_matrix(self.world_size)
            work = all_gather(full.view(-1), mine.view(-1), group=self.group, async_op=True)
            self._pending[b] = (work, full, mine)  # `mine` must live until the gather ends
        if not self.deferred:
            self.wait()

    @torch.no_grad()
    def wait(self, buckets: list[int] | None = None) -> None:
        """Wait for the gathers of ``buckets`` (``None``: all) and copy them into the parameters."""
        for b in sorted(self._pending) if buckets is None else buckets:
            if b in self._pending:
                work, full, _mine = self._pending.pop(b)
                work.wait()
                self.buckets[b].unpack(full)

    def remove_hooks(self) -> None:
        """Wait for what is in flight, then remove the model's hooks (gathers wait at the step)."""
        self.wait()
        for h in self._hooks:
            h.remove()
        self._hooks, self.deferred = [], False
