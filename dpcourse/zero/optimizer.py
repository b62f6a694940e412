"""ShardedOptimizer: each rank keeps optimizer state for 1/N of the parameters (ZeRO-1 and ZeRO-2).

Data parallelism gives every rank the same averaged gradient, and then every
rank runs the same optimizer step on the same full parameters: N copies of
identical work and of identical state (AdamW: two fp32 moments, 8 bytes per
parameter). ZeRO stage 1 (Rajbhandari et al., 2020) lets rank ``r`` keep state
for and step only its shard of each parameter (:mod:`dpcourse.zero.layout`),
then all-gathers the updated shards so every rank holds the full new weights.

Where this rank's averaged gradient shard comes from is the ``gradients=``
argument: ``"averaged"`` (behind a DDP wrapper), ``"reduce_scatter"`` (ZeRO-1) or
``"sharded"`` (ZeRO-2, reduce-scattered during backward), made by
:class:`~dpcourse.zero.gradients.GradientShards`.

Checkpoints (the state gathered on one rank as a plain optimizer's, loaded on
any number of ranks) are made by :mod:`dpcourse.zero.checkpoint`.

In the two modes without a wrapper, rank 0's parameters are broadcast at
construction so all replicas start equal (buffers are not seen by an
optimizer: models with buffers, e.g. BatchNorm, need a wrapper).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.optim import Optimizer

from dpcourse.comm.sharding import shard_range
from dpcourse.ddp.bucket_assignment import check_bucket_cap
from dpcourse.ddp.guards import check_same_model
from dpcourse.zero import checkpoint
from dpcourse.zero.collectives import all_gather
from dpcourse.zero.gradients import GRADIENT_MODES, GradientShards
from dpcourse.zero.layout import ShardBucket, make_shard_buckets

__all__ = ["ShardedOptimizer"]


def _check_setup(optimizer_cls, gradients: str) -> None:
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            "ShardedOptimizer needs a process group: run this code inside dpcourse.run(fn), "
            "or call torch.distributed.init_process_group(backend) first.")
    if not (isinstance(optimizer_cls, type) and issubclass(optimizer_cls, Optimizer)):
        raise TypeError(f"optimizer_cls must be a torch.optim.Optimizer class such as "
                        f"torch.optim.AdamW (the class, not an instance), got {optimizer_cls!r}.")
    if gradients not in GRADIENT_MODES:
        raise ValueError(f"gradients must be one of {GRADIENT_MODES}, got {gradients!r}: "
                         "'averaged' behind a DDP wrapper, 'reduce_scatter' (ZeRO-1) or "
                         "'sharded' (ZeRO-2) on an unwrapped model.")


class ShardedOptimizer(Optimizer):
    """Wrap ``optimizer_cls`` so that each rank holds and steps only its shard of the parameters.

    Args:
        params: parameters or parameter groups (dicts), as for any torch optimizer.
            Frozen parameters (``requires_grad=False``) are kept out of sharding.
        optimizer_cls: an element-wise torch optimizer class (SGD, Adam, AdamW).
        group: process group (``None``: the default group).
        gradients: ``"averaged"``, ``"reduce_scatter"`` or ``"sharded"``
            (:mod:`dpcourse.zero.gradients`).
        bucket_cap_mb: gradient MiB per reduce-scatter / all-gather (0: one per parameter).
        **defaults: the optimizer's hyperparameters (``lr=...``, ``momentum=...``).

    Attributes:
        optim: the inner ``optimizer_cls`` over this rank's shards (its ``state`` is all
            the optimizer state this rank holds).
        shards: this rank's shard of each trainable parameter: a 1-D view into it.
        buckets: the :class:`~dpcourse.zero.layout.ShardBucket` list.
        grad_shards: the :class:`~dpcourse.zero.gradients.GradientShards` that give
            ``shards`` their gradients.
    """

    def __init__(self, params, optimizer_cls, *, group=None, gradients: str = "averaged",
                 bucket_cap_mb: float = 25.0, **defaults: Any):
        _check_setup(optimizer_cls, gradients)
        cap = check_bucket_cap(bucket_cap_mb)
        super().__init__(params, defaults)
        self.process_group, self.gradients = group, gradients
        self.world_size, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self._params = self._trainable()
        if gradients != "averaged":
            # Before any collective that depends on the shapes: ranks with different models
            # would hang, crash in the backend, or shard a (4, 2) weight like a (2, 4).
            # ("averaged": the wrapper that averages the gradients made this check, and
            # construction stays local.)
            check_same_model(self._named(), group, self._params[0].device)
            src = 0 if group is None else dist.get_global_rank(group, 0)
            for p in self._params:  # replicas must start equal: no wrapper did it
                dist.broadcast(p.detach(), src=src, group=group)
        index = {id(p): i for i, p in enumerate(self._params)}
        self.shards = []
        for p in self._params:
            lo, hi = shard_range(p.numel(), self.world_size, self.rank)
            self.shards.append(p.detach().view(-1)[lo:hi])  # a view: the step updates p in place
        self.buckets: list[ShardBucket] = make_shard_buckets(self._params, self.world_size, cap)
        inner_groups = [{**{k: v for k, v in g.items() if k != "params"},
                         "params": [self.shards[index[id(p)]] for p in g["params"]
                                    if id(p) in index]} for g in self.param_groups]
        self.optim = optimizer_cls(inner_groups)
        for outer, inner in zip(self.param_groups, self.optim.param_groups):
            for k, v in inner.items():  # the inner class's defaults, visible to schedulers
                if k != "params":
                    outer.setdefault(k, v)
        self.grad_shards = GradientShards(self._params, self.shards, self.buckets, gradients,
                                          group)  # "sharded": its backward hooks from here on
        self._steps = 0
        self._consolidated: checkpoint.Consolidated | None = None

    def _trainable(self) -> list[torch.Tensor]:
        params, seen = [], set()
        for g in self.param_groups:
            for p in g["params"]:
                if p.requires_grad and id(p) not in seen:
                    if not p.is_contiguous():
                        raise ValueError("ShardedOptimizer shards flat views of parameters: "
                                         "make every parameter contiguous first.")
                    seen.add(id(p))
                    params.append(p)
        if not params:
            raise ValueError("ShardedOptimizer got no trainable parameters (requires_grad=True).")
        return params

    def _named(self) -> list[tuple[str, torch.Tensor]]:
        """``(name, parameter)`` for :attr:`_params`: the names given to the optimizer, if any.

        ``ShardedOptimizer(model.named_parameters(), ...)`` keeps the names (as torch
        optimizers do, in ``param_groups[g]["param_names"]``); otherwise a parameter is
        named by where it sits in ``param_groups``.
        """
        names, seen = [], set()
        for g, group in enumerate(self.param_groups):
            given = group.get("param_names")
            for i, p in enumerate(group["params"]):
                if p.requires_grad and id(p) not in seen:
                    seen.add(id(p))
                    names.append(given[i] if given else f"param_groups[{g}]['params'][{i}]")
        return list(zip(names, self._params))

    # -- the step ---------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure=None):  # type: ignore[override]
        """Step this rank's shards with the inner optimizer, then all-gather the new parameters.

        Args:
            closure: not supported (it would re-run the model on every rank for a shard).

        Returns:
            ``None``.
        """
        if closure is not None:
            raise ValueError("ShardedOptimizer.step() takes no closure.")
        self._sync_groups(to_inner=True)
        self.grad_shards.point_shard_grads()
        self.optim.step()
        self.grad_shards.release()
        self._gather_params()
        self._steps += 1
        return None

    def _sync_groups(self, to_inner: bool) -> None:
        """Copy hyperparameters between the outer groups (schedulers write there) and the inner."""
        for outer, inner in zip(self.param_groups, self.optim.param_groups):
            src, dst = (outer, inner) if to_inner else (inner, outer)
            for k, v in src.items():
                if k != "params":
                    dst[k] = v

    @torch.no_grad()
    def _gather_params(self) -> None:
        works = []
        for bucket in self.buckets:
            mine = bucket.new_matrix(1)  # this rank's row: its shard of each parameter, padded
            bucket.pack(mine, [self.shards[i] for i in bucket.indices])
            full = bucket.new_matrix(self.world_size)
            works.append((bucket, full, all_gather(full.view(-1), mine.view(-1),
                                                   group=self.process_group, async_op=True)))
        for bucket, full, work in works:
            work.wait()
            bucket.unpack(full)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the full gradients and this rank's accumulated gradient shards."""
        super().zero_grad(set_to_none=set_to_none)
        self.grad_shards.clear()

    # -- checkpoints (the work is in dpcourse.zero.checkpoint) ------------------
    def consolidate_state_dict(self, to: int = 0) -> None:
        """Gather every rank's shard of the optimizer state on rank ``to`` (a collective).

        Every rank must call it; afterwards :meth:`state_dict` on rank ``to`` returns
        the whole state. As torch's ``ZeroRedundancyOptimizer.consolidate_state_dict``.

        Args:
            to: rank of the group that receives the state (default 0).
        """
        self._consolidated = checkpoint.consolidate_on(self, to)

    def state_dict(self) -> dict[str, Any]:  # type: ignore[override]
        """Return the consolidated state, as a plain ``optimizer_cls`` over the same groups has it.

        Only on the rank that :meth:`consolidate_state_dict` sent the state to, and
        only if no step ran since (how to checkpoint: :mod:`dpcourse.zero.checkpoint`).
        The dict holds whole tensors, so it loads on any number of ranks, or into a
        single-process optimizer.

        Returns:
            ``{"state": {index: {name: tensor}}, "param_groups": [...]}`` with ``index``
            counting the parameters of ``param_groups`` in order, frozen ones included.
        """
        return checkpoint.consolidated(self, self._consolidated)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:  # type: ignore[override]
        """Load a consolidated state dict (from :meth:`state_dict`); every rank keeps its shard.

        Call it on every rank with the whole dict (e.g. ``torch.load(path)["optim"]``),
        after loading the model's weights. No communication: the world size may differ
        from the one that saved it.

        Args:
            state_dict: the dict :meth:`state_dict` returned (possibly saved and loaded).
        """
        checkpoint.load_state(self, state_dict)
        self._consolidated = None

    def remove_hooks(self) -> None:
        """Remove the backward hooks of ``gradients="sharded"`` (e.g. before re-wrapping)."""
        self.grad_shards.remove_hooks()
