"""Predict a data-parallel training step: buckets, overlap and scaling efficiency."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from dpcourse.costmodel.alphabeta import AlphaBeta
from dpcourse.formatting import MiB



def bucket_sizes(grad_bytes, bucket_cap_mb: float = 25.0) -> np.ndarray:
    """Split gradients into all-reduce buckets the way DDP fills them.

    Args:
        grad_bytes: total gradient bytes (split into equal buckets of the cap, the last
            one smaller), or a list of per-parameter gradient bytes in the order the
            backward pass produces them (filled greedily: a bucket closes once it
            reaches the cap).
        bucket_cap_mb: bucket capacity in MiB; 0 means one bucket per parameter.

    Returns:
        Bucket sizes in bytes (float array), in the order they become ready.
    """
    if bucket_cap_mb < 0:
        raise ValueError(f"bucket_cap_mb must be >= 0, got {bucket_cap_mb!r}.")
    cap = bucket_cap_mb * MiB
    if np.ndim(grad_bytes) == 0:
        total = float(grad_bytes)
        if total < 0:
            raise ValueError(f"grad_bytes must be >= 0, got {grad_bytes!r}.")
        if cap == 0:
            raise ValueError("bucket_cap_mb=0 (one bucket per parameter) needs per-parameter "
                             "sizes: pass grad_bytes as a list.")
        full, rest = divmod(total, cap)
        return np.concatenate([np.full(int(full), cap), [rest] if rest > 0 else []])
    from dpcourse.ddp.bucket_assignment import assign_buckets  # the one bucket rule (imports torch)

    sizes = [float(b) for b in grad_bytes]
    # assign_buckets takes sizes in registration order, the reverse of backward's.
    registered = [max(0, round(b)) for b in reversed(sizes)]
    order = assign_buckets(registered, bucket_cap_mb)
    return np.array([sum(sizes[len(sizes) - 1 - i] for i in bucket) for bucket in order],
                    dtype=float)


@dataclass(frozen=True)
class StepPrediction:
    """Predicted time of one data-parallel training step.

    Attributes:
        compute_s: forward + backward time (what one rank alone would take).
        comm_s: sum of every bucket's all-reduce time.
        step_s: predicted step time.
        n_buckets: number of all-reduces per step.
        last_bucket_s: all-reduce time of the last bucket, which no compute can hide.
        overlap: whether communication overlapped the backward pass.
    """

    compute_s: float
    comm_s: float
    step_s: float
    n_buckets: int
    last_bucket_s: float
    overlap: bool

    @property
    def exposed_comm_s(self) -> float:
        """Communication time not hidden behind compute (``step - compute``)."""
        return self.step_s - self.compute_s

    @property
    def comm_share(self) -> float:
        """Fraction of the step spent waiting for communication."""
        return self.exposed_comm_s / self.step_s if self.step_s > 0 else 0.0

    @property
    def efficiency(self) -> float:
        """Scaling efficiency at fixed per-rank batch: ``compute / step``.

        Equals ``throughput(N) / (N * throughput(1))`` when one rank's step is ``compute``.
        """
        return self.compute_s / self.step_s if self.step_s > 0 else 1.0


def predict_step_time(grad_bytes, compute_s: float, model: AlphaBeta, world_size: int,
                      bucket_cap_mb: float = 25.0, overlap: bool = True,
                      backward_fraction: float = 2 / 3) -> StepPrediction:
    """Predict one DDP step from the compute time and the all-reduce model.

    Without overlap, ``step = compute + sum(bucket all-reduces)``. With overlap, each
    bucket's all-reduce starts when its last gradient exists (gradients appear at a
    steady rate in bytes through the backward pass) and the buckets go out one after
    another on one link, so ``step = end of the last all-reduce``. This is at least
    ``max(compute, comm)`` and at least ``compute + last bucket``: the last bucket is
    ready only when backward ends, so its all-reduce is always exposed.

    Args:
        grad_bytes: total gradient bytes, or per-parameter bytes in backward order.
        compute_s: forward + backward seconds of one step on one rank.
        model: the fitted :class:`AlphaBeta`.
        world_size: number of ranks.
        bucket_cap_mb: bucket capacity in MiB (0: one bucket per parameter).
        overlap: all-reduce buckets during backward (True) or after it (False).
        backward_fraction: share of ``compute_s`` spent in backward (about 2/3:
            backward costs about twice the forward's FLOPs).

    Returns:
        A :class:`StepPrediction`.
    """
    if compute_s < 0 or not 0 < backward_fraction <= 1:
        raise ValueError("compute_s must be >= 0 and backward_fraction in (0, 1].")
    buckets = bucket_sizes(grad_bytes, bucket_cap_mb)
    times = np.asarray(model.allreduce_time(buckets, world_size), dtype=float).reshape(-1)
    comm = float(times.sum())
    last = float(times[-1]) if len(times) else 0.0
    if not overlap or not len(buckets):
        step = compute_s + comm
    else:
        forward = compute_s * (1 - backward_fraction)
        backward = compute_s * backward_fraction
        total = buckets.sum()
        done = np.cumsum(buckets) / total if total > 0 else np.ones(len(buckets))
        ready = forward + backward * done
        # Buckets go out one at a time on one link: end_i = max(ready_i, end_{i-1}) + t_i.
        # Unrolled, the last one ends at max_i(ready_i + t_i + ... + t_last).
        tail = np.cumsum(times[::-1])[::-1]
        step = max(compute_s, float(np.max(ready + tail)))
    return StepPrediction(compute_s, comm, step, len(buckets), last, overlap)


def scaling_curve(world_sizes, grad_bytes, compute_s: float, model: AlphaBeta,
                  bucket_cap_mb: float = 25.0, overlap: bool = True) -> list[StepPrediction]:
    """Predict the step for each world size (fixed per-rank batch) with one :class:`AlphaBeta`."""
    return [predict_step_time(grad_bytes, compute_s, model, int(n), bucket_cap_mb, overlap)
            for n in world_sizes]
