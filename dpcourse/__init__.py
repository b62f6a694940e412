"""dpcourse: learn data-parallel training by building DistributedDataParallel.

The package is the reference for every algorithm the lessons build:

* ``dpcourse.run`` launches ranks (``dpcourse.plan_ranks`` says how many, and where);
* ``dpcourse.comm``: hand-built collectives (naive, ring, NVLink kernels), ``CommTrace``, and
  the one sharding layout (``shard_range``, as ``reduce_scatter_tensor``'s) that the ring,
  ZeRO, FSDP and the kernels share;
* ``dpcourse.ddp``: the data-parallel wrappers in learning order, and torch DDP's
  reducer features (Join, communication hooks, unused parameters, static graph);
* ``dpcourse.zero``: ``ShardedOptimizer``, ZeRO-1 and ZeRO-2;
* ``dpcourse.fsdp``: ``FullyShardedDataParallel``, ZeRO-3;
* ``dpcourse.costmodel``: the alpha-beta model of all-reduce and of a DDP step;
* ``dpcourse.bench``, ``dpcourse.grading``: measurements, and the checks behind the exercises;
* the ``dpcourse`` command (``dpcourse.cli``): ``doctor``, ``launch``, ``demo``, ``bench``,
  ``grade``.
"""

from dpcourse.launch import (RankDiedError, RankError, RankPlan, RankTimeoutError, plan_ranks,
                             resolve_backend, run)

__version__ = "0.1.0"
__all__ = ["run", "plan_ranks", "RankPlan", "resolve_backend", "RankError", "RankDiedError", "RankTimeoutError"]
