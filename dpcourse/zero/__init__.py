"""ZeRO stages 1 and 2: shard the optimizer state (and the gradients) across data-parallel ranks.

``ShardedOptimizer(params, torch.optim.AdamW, lr=...)`` keeps optimizer state
for 1/N of every parameter on each rank; ``gradients="sharded"`` also keeps
only 1/N of the gradients (ZeRO-2). Stage 3 (parameters too) is
:mod:`dpcourse.fsdp`.
"""

from dpcourse.comm.sharding import chunk_size, shard_range
from dpcourse.zero.collectives import all_gather, reduce_scatter, trace_wire_bytes, wire_bytes
from dpcourse.zero.memory import (gradient_bytes, optimizer_state_bytes, tensor_bytes,
                                  zero_bytes_per_rank)
from dpcourse.zero.gradients import GRADIENT_MODES
from dpcourse.zero.optimizer import ShardedOptimizer

__all__ = ["ShardedOptimizer", "GRADIENT_MODES", "all_gather", "reduce_scatter", "wire_bytes",
           "trace_wire_bytes", "chunk_size", "shard_range", "optimizer_state_bytes",
           "gradient_bytes", "tensor_bytes", "zero_bytes_per_rank"]
