"""Hand-built collectives and the tracer that makes them visible."""

from dpcourse.comm.naive import all_reduce_per_tensor, naive_all_reduce
from dpcourse.comm.ring import (chunk_bounds, ring_all_gather, ring_all_reduce,
                                ring_reduce_scatter, ring_step_chunks)
from dpcourse.comm.trace import CommEvent, CommTrace

__all__ = ["CommTrace", "CommEvent", "naive_all_reduce", "all_reduce_per_tensor",
           "chunk_bounds", "ring_step_chunks", "ring_reduce_scatter", "ring_all_gather",
           "ring_all_reduce"]
