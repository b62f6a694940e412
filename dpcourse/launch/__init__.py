"""Launch a function on several ranks: ``dpcourse.run`` and the runtime behind it.

* :mod:`~dpcourse.launch.launcher`: :func:`run`, the API;
* :mod:`~dpcourse.launch.ranks`: how many ranks, on which backend and why (:func:`plan_ranks`);
* :mod:`~dpcourse.launch.procs`: the processes of one launch (start, watch, collect, stop);
* :mod:`~dpcourse.launch.worker`: the entry point of one rank;
* :mod:`~dpcourse.launch.guard`: ends the ranks' process groups, also when the launcher was killed;
* :mod:`~dpcourse.launch.reaper`: kills and reaps a process tree (the grader's kernels, ranks);
* :mod:`~dpcourse.launch.relay`: what the ranks print, relayed with a ``[rank r]`` prefix;
* :mod:`~dpcourse.launch.errors`: the errors a learner sees (a rank raised, died or hung);
* :mod:`~dpcourse.launch.stacks`: where a hung rank was, read from its stack dump;
* :mod:`~dpcourse.launch.env`: the ranks' environment and the slow-link switch.
"""

from dpcourse.launch.errors import RankDiedError, RankError, RankTimeoutError
from dpcourse.launch.launcher import DEFAULT_TIMEOUT, run
from dpcourse.launch.ranks import RankPlan, plan_ranks, resolve_backend

__all__ = ["run", "plan_ranks", "RankPlan", "resolve_backend", "DEFAULT_TIMEOUT", "RankError", "RankDiedError",
           "RankTimeoutError"]
