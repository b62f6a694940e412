"""Cost model of data-parallel training, fitted from measurements on your machine.

* :mod:`~dpcourse.costmodel.alphabeta`: ``time(n) = k alpha + 2 (N-1)/N n beta`` for one
  all-reduce, and its least-squares fit to a measured sweep;
* :mod:`~dpcourse.costmodel.step`: a DDP step from compute time, buckets and overlap;
* :mod:`~dpcourse.costmodel.limits`: memory per rank, gradient traffic, and when data
  parallelism alone stops being enough.
"""

from dpcourse.costmodel.alphabeta import (
    AlphaBeta,
    bus_factor,
    dtype_bytes,
    fit_alpha_beta,
    latency_terms,
    prediction_errors,
    ring_bytes_per_rank,
    sweep_arrays,
)
from dpcourse.costmodel.limits import (
    DataParallelVerdict,
    allreduce_traffic,
    data_parallel_limits,
    memory_per_rank,
)
from dpcourse.costmodel.step import StepPrediction, bucket_sizes, predict_step_time, scaling_curve

__all__ = [
    "AlphaBeta", "fit_alpha_beta", "prediction_errors", "sweep_arrays", "dtype_bytes",
    "latency_terms", "bus_factor", "ring_bytes_per_rank", "StepPrediction", "bucket_sizes",
    "predict_step_time", "scaling_curve", "memory_per_rank", "allreduce_traffic",
    "DataParallelVerdict", "data_parallel_limits",
]
