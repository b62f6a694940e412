"""Hand-built collectives, the one sharding layout they share, and the tracer that makes them visible."""

from dpcourse.comm.collective import AllReduce, OnCommStream
from dpcourse.comm.naive import all_reduce_per_tensor, naive_all_reduce
from dpcourse.comm.ring import (ring_all_gather, ring_all_reduce, ring_reduce_scatter,
                                ring_step_chunks)
from dpcourse.comm.sharding import chunk_size, shard_range
from dpcourse.comm.trace import CommEvent, CommTrace

__all__ = ["AllReduce", "OnCommStream", "CommTrace", "CommEvent", "naive_all_reduce",
           "all_reduce_per_tensor", "chunk_size", "shard_range", "ring_step_chunks",
           "ring_reduce_scatter", "ring_all_gather", "ring_all_reduce"]
