"""dpcourse: learn data-parallel training by building DistributedDataParallel.

The package is the reference for every algorithm the lessons build:
``dpcourse.run`` launches ranks, ``dpcourse.comm`` holds hand-built collectives
and ``CommTrace``, ``dpcourse.ddp`` the data-parallel wrappers in learning order.
"""

from dpcourse.launch import (RankDiedError, RankError, RankPlan, RankTimeoutError, plan_ranks,
                             resolve_backend, run)

__version__ = "0.1.0"
__all__ = ["run", "plan_ranks", "RankPlan", "resolve_backend", "RankError", "RankDiedError", "RankTimeoutError"]
