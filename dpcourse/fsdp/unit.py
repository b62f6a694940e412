"""FSDPUnit: the hooks that gather a unit's parameters before it computes and free them after.

Forward: a pre-forward hook waits for the unit's all-gather (usually already
started by the previous unit: *prefetch*), points the module at the gathered
views, and starts the next unit's all-gather; a post-forward hook frees the
weights (``reshard after forward``) and registers a hook on the output.

Backward: that output hook runs when the gradient of the unit's output is
known, i.e. just before the unit's own backward: it gathers the weights again
and prefetches the unit whose backward comes next. Once autograd has the
gradient of the whole gathered vector (the link from shard to full vector is
:func:`~dpcourse.fsdp.flat_params.gathered`, the same one the exercise uses),
the unit launches its reduce-scatter (each rank receives the sum of its
shard's gradient) and frees the weights again.
"""

from __future__ import annotations

import torch
from torch.utils._pytree import tree_flatten

from dpcourse.comm.averaging import divide_before_sum
from dpcourse.fsdp.flat_params import FlatParams, gathered
from dpcourse.zero.collectives import reduce_scatter


class FSDPUnit:
    """One unit (e.g. a transformer block): its flat shards and its hooks.

    Args:
        module: the submodule (``None`` for the root unit, driven by the wrapper).
        flats: its :class:`~dpcourse.fsdp.flat_params.FlatParams` (trainable and/or frozen).
        owner: the :class:`~dpcourse.fsdp.FullyShardedDataParallel`.
        index: position in the wrapper's unit list.
    """

    def __init__(self, module, flats: list[FlatParams], owner, index: int):
        self.module, self.flats, self.owner, self.index = module, flats, owner, index
        self.backward_started = False
        self.forwarded = False
        self.handles = []
        if module is not None:
            self.handles = [module.register_forward_pre_hook(self._pre_forward),
                            module.register_forward_hook(self._post_forward)]

    # -- unshard / reshard -----------------------------------------------------------
    def unshard(self) -> None:
        """Launch the all-gathers of this unit's weights (a prefetch)."""
        for f in self.flats:
            f.unshard()

    def wait_for_unshard(self) -> None:
        """Make this unit's weights valid (wait for, or do, the all-gathers)."""
        for f in self.flats:
            f.wait_for_unshard()

    def reshard(self) -> None:
        """Release this unit's gathered weights."""
        for f in self.flats:
            f.reshard()

    def to_unsharded(self) -> None:
        """Point the module at the gathered weights, through :func:`gathered` when trainable."""
        for f in self.flats:
            if f.shard.requires_grad and torch.is_grad_enabled():
                f.to_unsharded(gathered(f, self.reduce_gradient))
            else:
                f.to_unsharded(f.full.detach())

    # -- hooks ------------------------------------------------------------------------
    def _pre_forward(self, module, args):
        if self.forwarded and torch.is_grad_enabled():
            raise RuntimeError(
                f"FSDP unit {type(module).__name__} #{self.index} ran twice in one forward: "
                "its gradient would be reduced twice. Make it a unit of its own per use, or "
                "leave it to the root unit (pass units= without it).")
        self.forwarded = torch.is_grad_enabled()
        self.wait_for_unshard()
        self.to_unsharded()
        self.owner._prefetch_after(self, backward=False)
        return self.owner._cast_inputs(args)

    def _post_forward(self, module, args, output):
        self.reshard()
        if torch.is_grad_enabled():
            self.backward_started = False
            for t in tree_flatten(output)[0]:
                if isinstance(t, torch.Tensor) and t.requires_grad:
                    t.register_hook(self._pre_backward)
        return output

    def _pre_backward(self, grad):
        if not self.backward_started:
            self.backward_started = True
            self.owner._round.start()  # the owner finishes the reductions when backward ends
            with torch.no_grad():
                self.wait_for_unshard()
            self.owner._prefetch_after(self, backward=True)
        return grad

    # -- gradients --------------------------------------------------------------------
    @torch.no_grad()
    def reduce_gradient(self, flat: FlatParams, grad_full: torch.Tensor) -> None:
        """Launch the reduce-scatter of a flat's full gradient; free the weights."""
        owner = self.owner
        grad = grad_full.to(owner.reduce_dtype or grad_full.dtype)
        # Divide first only where the sum can overflow (fp16; dpcourse.comm.averaging).
        # Otherwise sum, then divide only this rank's shard: N times fewer divisions.
        # grad_full is autograd's fresh buffer: ours to modify.
        divide_first = divide_before_sum(grad, owner.world_size, only_if_sum_can_overflow=True)
        out = torch.empty(flat.chunk, dtype=grad.dtype, device=grad.device)
        work = reduce_scatter(out, grad, group=owner.group, async_op=True)
        owner._round.launched(flat, (work, out, grad, not divide_first))
        # Keep one reduce-scatter in flight: finishing the previous one releases its
        # full-size gradient. Holding them all until the end of backward would keep a
        # whole unsharded gradient per rank, what sharding is meant to avoid.
        owner._round.wait(keep=1)
        # Every use of these weights has had its backward. (A frozen flat of the same
        # unit may still be needed for an input gradient: it is freed when backward ends.)
        flat.reshard()
