"""Stop a launch's ranks and everything they started, even when the launching process was killed.

Every rank runs in its own process group (session), which also holds what the rank
starts: DataLoader workers, a subprocess, multiprocessing's resource tracker.
:func:`stop_groups` ends such groups; the launcher calls it when it stops a launch.

A launcher that is killed outright (SIGKILL, a Jupyter kernel restart) cannot call
anything. The kernel then kills each rank (``PR_SET_PDEATHSIG`` in
:mod:`dpcourse.launch.worker`), but not the rank's children, which would live on as
orphans. So every launch also starts this module as a small guard process
(``python -I -S guard.py WORKDIR``, standard library only, outside the ranks' groups):
the launcher writes each rank's pid on the guard's stdin, and ``done`` once it has
stopped the launch itself. End of input without ``done`` means the launcher died:
the guard stops the ranks' groups and removes the launch's work directory. The grader's
ranks (:class:`dpcourse.grading.world.World`) are watched by one the same way
(:class:`dpcourse.launch.procs.Guard`).
"""

from __future__ import annotations

import os
import shutil
import signal
import sys
import time

# How long a group may take to end after SIGTERM before it gets SIGKILL. multiprocessing's
# resource tracker ignores SIGTERM on purpose: it stays to unlink the named semaphores
# of the processes that died (/dev/shm/sem.mp-*), then exits once they are all gone.
TERM_GRACE = 3.0


def signal_group(pgid: int, sig: int) -> bool:
    """Send ``sig`` to process group ``pgid``; False once the group is empty."""
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        return False
    except PermissionError:  # a member that is not ours: the group is not empty
        return True
    return True


def stop_groups(pgids, grace: float = TERM_GRACE) -> None:
    """End the process groups ``pgids``: SIGTERM, then SIGKILL for what is left after ``grace``.

    Args:
        pgids: the groups, one per rank (a rank leads its own group, so it is the rank's pid).
            A rank still running is killed by this too; the launcher kills its ranks first
            and collects them (a zombie still counts as a member of its group).
        grace: seconds the members get after SIGTERM before SIGKILL.
    """
    live = [pgid for pgid in pgids if signal_group(pgid, signal.SIGTERM)]
    deadline = time.monotonic() + grace
    while live and time.monotonic() < deadline:
        time.sleep(0.02)
        live = [pgid for pgid in live if signal_group(pgid, 0)]
    for pgid in live:
        signal_group(pgid, signal.SIGKILL)


def main(workdir: str) -> int:
    """Read rank pids from stdin until ``done`` (exit quietly) or end of input (stop them)."""
    pids: list[int] = []
    for line in sys.stdin:
        line = line.strip()
        if line == "done":
            return 0
        if line.isdigit():
            pids.append(int(line))
    stop_groups(pids)
    shutil.rmtree(workdir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    # Our own session: Ctrl-C in a terminal reaches the launcher, never the guard.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    sys.exit(main(sys.argv[1]))
