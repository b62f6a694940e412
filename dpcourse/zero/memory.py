"""Bytes per rank: counted on live objects, and predicted by the ZeRO formula."""

from __future__ import annotations

import torch
from torch.optim import Optimizer

from dpcourse.costmodel.limits import OPTIMIZER_STATE_BYTES


def tensor_bytes(tensors) -> int:
    """Sum of ``numel * element_size`` over tensors (``None`` entries skipped)."""
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def optimizer_state_bytes(optimizer: Optimizer) -> int:
    """Bytes of tensors in an optimizer's state on this rank (a ShardedOptimizer: its shard's).

    Scalar step counters (0-dim tensors) are counted too; they are a few bytes.
    """
    inner = getattr(optimizer, "optim", optimizer)
    return tensor_bytes(v for state in inner.state.values() for v in state.values()
                        if isinstance(v, torch.Tensor))


def gradient_bytes(params, optimizer: Optimizer | None = None) -> int:
    """Bytes of gradient storage this rank holds: full ``param.grad`` plus ZeRO-2 gradient shards.

    Args:
        params: the model's parameters.
        optimizer: a :class:`~dpcourse.zero.ShardedOptimizer` holding gradient shards, or None.
    """
    full = tensor_bytes(p.grad for p in params)
    rows = getattr(optimizer, "_grad_rows", None) or []
    return full + tensor_bytes(rows)


def zero_bytes_per_rank(n_params: float, world_size: int, stage: int, *,
                        grad_bytes: int = 4, optimizer: str = "adamw") -> dict[str, float]:
    """Return the predicted gradient and optimizer-state bytes per rank under ZeRO stage 0-2.

    Stage 0 is plain data parallelism (everything replicated); stage 1 divides the
    optimizer state by ``N``; stage 2 the gradients too. Padding (< N elements per
    tensor) is ignored.

    Args:
        n_params: trainable parameters.
        world_size: ranks ``N``.
        stage: 0, 1 or 2.
        grad_bytes: bytes per gradient element (4 for fp32).
        optimizer: a key of :data:`~dpcourse.costmodel.limits.OPTIMIZER_STATE_BYTES`.

    Returns:
        ``{"grads", "optimizer", "total"}`` in bytes.
    """
    if stage not in (0, 1, 2):
        raise ValueError(f"stage must be 0, 1 or 2 (3 shards the parameters: see dpcourse.fsdp), "
                         f"got {stage!r}.")
    opt = n_params * OPTIMIZER_STATE_BYTES[optimizer] / (world_size if stage >= 1 else 1)
    grads = n_params * grad_bytes / (world_size if stage >= 2 else 1)
    return {"grads": grads, "optimizer": opt, "total": grads + opt}
