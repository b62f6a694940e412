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
    grad_shards = getattr(optimizer, "grad_shards", None)  # a ShardedOptimizer's
    return full + tensor_bytes(grad_shards.rows if grad_shards is not None else [])


def zero_bytes_per_rank(n_params: float, world_size: int, stage: int, *,
                        optimizer: str = "adamw", mixed_precision: bool = False) -> dict[str, float]:
    """Return the predicted bytes per rank of weights, gradients and optimizer state under ZeRO.

    The model of Rajbhandari et al. (2020), "ZeRO: Memory Optimizations Toward Training
    Trillion Parameter Models", section 5. Per parameter a rank holds its weight, its gradient
    and ``K`` bytes of optimizer state:

    * fp32 training: 4 + 4 + K, with K the optimizer's fp32 state (8 for Adam/AdamW: two
      moments), 16 bytes in all for AdamW;
    * mixed precision (``mixed_precision=True``): 16-bit weights and gradients, 2 + 2 + K,
      where K also holds the fp32 master copy of the weights the optimizer steps: K = 4 + 8 = 12
      for Adam/AdamW, the paper's 16 bytes.

    Stage 0 is plain data parallelism (everything replicated); stage 1 divides the optimizer
    state (master copy included) by ``N``; stage 2 the gradients too; stage 3 the weights too.
    Padding (< N elements per tensor) is ignored.

    Args:
        n_params: trainable parameters.
        world_size: ranks ``N``.
        stage: 0, 1, 2 or 3.
        optimizer: a key of :data:`~dpcourse.costmodel.limits.OPTIMIZER_STATE_BYTES`.
        mixed_precision: 16-bit weights and gradients plus an fp32 master copy (default:
            fp32 weights and gradients, no copy).

    Returns:
        ``{"params", "grads", "optimizer", "total"}`` in bytes; ``"optimizer"`` includes the
        master copy under mixed precision.
    """
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"stage must be 0, 1, 2 or 3, got {stage!r}.")
    if optimizer not in OPTIMIZER_STATE_BYTES:
        raise ValueError(f"optimizer must be one of {sorted(OPTIMIZER_STATE_BYTES)}, got {optimizer!r}.")
    weight_bytes = 2 if mixed_precision else 4
    k = OPTIMIZER_STATE_BYTES[optimizer] + (4 if mixed_precision else 0)  # + fp32 master copy
    out = {"params": n_params * weight_bytes / (world_size if stage >= 3 else 1),
           "grads": n_params * weight_bytes / (world_size if stage >= 2 else 1),
           "optimizer": n_params * k / (world_size if stage >= 1 else 1)}
    out["total"] = out["params"] + out["grads"] + out["optimizer"]
    return out
