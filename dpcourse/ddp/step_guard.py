"""Refuse an optimizer step on gradients that were never averaged across ranks.

With ``no_sync()`` or a hand-driven loop, a learner can call ``optimizer.step()``
while some gradients are still this rank's alone. Every rank would then step
with a different gradient and the replicas would silently drift apart (torch
DDP does not catch this). A global optimizer pre-step hook catches it at the
step, while the mistake is still one line away.
"""

from __future__ import annotations

import weakref

from torch.optim.optimizer import register_optimizer_step_pre_hook


def install_step_guard(wrapper) -> None:
    """Make any optimizer step on ``wrapper``'s parameters raise while their gradients are unsynchronised.

    The hook holds the wrapper weakly and is removed when the wrapper is
    garbage-collected or its hooks are removed (``wrapper._remove_hooks``).

    Args:
        wrapper: a :class:`~dpcourse.ddp.base.DataParallelBase`; reads its
            ``_named_params`` and ``_unsynced`` (indices of gradients not yet averaged).
    """
    me = weakref.ref(wrapper)
    index_of = {id(p): i for i, (_, p) in enumerate(wrapper._named_params)}

    def before_step(optimizer, args, kwargs):
        w = me()
        if w is None or not w._unsynced:
            return
        stepped = {index_of[id(p)] for g in optimizer.param_groups for p in g["params"]
                   if id(p) in index_of}
        pending = sorted(stepped & w._unsynced)
        if pending:
            names = ", ".join(w._named_params[i][0] for i in pending[:5])
            more = f" and {len(pending) - 5} more" if len(pending) > 5 else ""
            raise RuntimeError(
                f"optimizer.step() was called before the gradients of {names}{more} were "
                f"averaged across ranks: each rank would step with its own gradient and the "
                f"replicas would drift apart. Run the last micro-step's backward outside "
                f"no_sync(), or call model.finish_gradient_synchronization() before "
                f"optimizer.step()."
            )

    handle = register_optimizer_step_pre_hook(before_step)
    wrapper._step_guard = handle
    weakref.finalize(wrapper, handle.remove)
