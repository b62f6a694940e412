"""Memory per rank, gradient traffic, and where data parallelism stops being enough."""

from __future__ import annotations

from dataclasses import dataclass

from dpcourse.costmodel.alphabeta import AlphaBeta, dtype_bytes, ring_bytes_per_rank
from dpcourse.costmodel.step import StepPrediction, predict_step_time

# Bytes of fp32 optimizer state per parameter: Adam keeps two moments, momentum SGD one.
OPTIMIZER_STATE_BYTES = {"adam": 8, "adamw": 8, "sgd_momentum": 4, "sgd": 0}


def memory_per_rank(n_params: float, dtype="bf16", optimizer: str = "adam",
                    master_weights: bool = True) -> dict[str, float]:
    """Return the bytes every data-parallel rank holds for weights, gradients and optimizer.

    Activations are left out: they depend on batch and sequence length, not on the
    number of ranks. Data parallelism keeps all of this on every rank.

    Args:
        n_params: number of parameters.
        dtype: dtype of weights and gradients (e.g. ``"bf16"``).
        optimizer: ``"adam"``/``"adamw"`` (two fp32 moments), ``"sgd_momentum"`` or ``"sgd"``.
        master_weights: mixed precision keeps an fp32 copy of low-precision weights.

    Returns:
        ``{"weights", "grads", "optimizer", "master_weights", "total"}`` in bytes.
    """
    if optimizer not in OPTIMIZER_STATE_BYTES:
        raise ValueError(f"optimizer must be one of {sorted(OPTIMIZER_STATE_BYTES)}, "
                         f"got {optimizer!r}.")
    b = dtype_bytes(dtype)
    out = {"weights": n_params * b, "grads": n_params * b,
           "optimizer": n_params * OPTIMIZER_STATE_BYTES[optimizer],
           "master_weights": n_params * 4 if master_weights and b < 4 else 0}
    out["total"] = sum(out.values())
    return out


def allreduce_traffic(n_params: float, dtype, world_size: int,
                      bandwidth: float) -> dict[str, float]:
    """Return the gradient bytes each rank sends per step and the time at ``bandwidth``.

    Args:
        n_params: number of parameters (one gradient each).
        dtype: gradient dtype, e.g. ``"bf16"``.
        world_size: number of ranks.
        bandwidth: bytes/s of one rank's link (e.g. ``50e9``).

    Returns:
        ``{"grad_bytes", "bytes_per_rank", "seconds"}`` (latency ignored: large messages).
    """
    grad = n_params * dtype_bytes(dtype)
    sent = ring_bytes_per_rank(grad, world_size)
    return {"grad_bytes": grad, "bytes_per_rank": sent, "seconds": sent / bandwidth}


@dataclass(frozen=True)
class DataParallelVerdict:
    """Whether plain data parallelism suits a configuration, and why not."""

    memory: dict
    device_memory: float
    step: StepPrediction
    reasons: tuple[str, ...]

    @property
    def enough(self) -> bool:
        """True when the replica fits and communication does not dominate."""
        return not self.reasons


def data_parallel_limits(n_params: float, world_size: int, device_memory: float, model: AlphaBeta,
                         compute_s: float, dtype="bf16", optimizer: str = "adam",
                         bucket_cap_mb: float = 25.0, overlap: bool = True,
                         max_comm_share: float = 0.3) -> DataParallelVerdict:
    """Decide whether data parallelism alone is enough, and say which limit is hit.

    Two limits: the replica (weights + grads + optimizer state) must fit in device
    memory, since every rank holds all of it; and waiting for the all-reduce must
    stay a minor part of the step (``max_comm_share``; 0.3 means efficiency >= 70%).

    Args:
        n_params: number of parameters.
        world_size: number of ranks.
        device_memory: bytes of memory per device (e.g. ``80e9``).
        model: the :class:`AlphaBeta` of the link.
        compute_s: forward + backward seconds per step on one rank.
        dtype, optimizer: as in :func:`memory_per_rank`.
        bucket_cap_mb, overlap: as in :func:`predict_step_time`.
        max_comm_share: the largest acceptable exposed-communication share of a step.

    Returns:
        A :class:`DataParallelVerdict`; ``reasons`` is empty when data parallelism is enough.
    """
    mem = memory_per_rank(n_params, dtype, optimizer)
    step = predict_step_time(n_params * dtype_bytes(dtype), compute_s, model, world_size,
                             bucket_cap_mb, overlap)
    reasons = []
    if mem["total"] > device_memory:
        reasons.append(f"memory: {mem['total'] / 1e9:.1f} GB per rank for weights, grads and "
                       f"optimizer state > {device_memory / 1e9:.0f} GB device; shard it "
                       "(ZeRO / FSDP) or split the model (tensor / pipeline parallelism)")
    if step.comm_share > max_comm_share:
        reasons.append(f"communication: {step.comm_share:.0%} of the step waits for the "
                       f"all-reduce (> {max_comm_share:.0%}); scaling efficiency "
                       f"{step.efficiency:.0%}: faster links, more compute per step "
                       "(larger batch, accumulation) or less traffic")
    return DataParallelVerdict(mem, float(device_memory), step, tuple(reasons))
