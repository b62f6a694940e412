"""Own every process a block of code starts, and stop them all (the grader's kernels and ranks).

Each child runs in its own session (process group). While :func:`subreaper` is
active this process is a child subreaper (Linux): a grandchild that detaches
(``setsid`` + double fork) is re-parented here instead of to init, so it is still
found, and killed, as a descendant; every sweep also reaps what has exited, so
adopted orphans never pile up as zombies.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys
import time

import psutil

from dpcourse.launch.guard import signal_group

_PR_SET_CHILD_SUBREAPER = 36


def _set_subreaper(on: bool) -> bool:
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(_PR_SET_CHILD_SUBREAPER, int(on), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


@contextlib.contextmanager
def subreaper():
    """Adopt orphaned descendants while the block runs (Linux); kill and reap them at the end."""
    before = {p.pid for p in psutil.Process().children()}
    on = _set_subreaper(True)
    try:
        yield
    finally:
        kill_new_children(before)
        if on:
            _set_subreaper(False)


def reap(keep=()) -> int:
    """Collect the exit status of every ended child but ``keep``; return how many.

    ``keep``: children whose status their owner still waits for (a caller's ``Popen``).
    """
    count = 0
    while True:
        try:  # look first (WNOWAIT): the next ended child may be one of ``keep``
            info = os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        except ChildProcessError:
            return count
        if info is None:
            return count
        if info.si_pid in keep:
            break
        with contextlib.suppress(ChildProcessError):
            os.waitpid(info.si_pid, os.WNOHANG)
            count += 1
    for proc in psutil.Process().children():  # one of ``keep`` ended: the others one by one
        if proc.pid not in keep:
            with contextlib.suppress(ChildProcessError):
                count += os.waitpid(proc.pid, os.WNOHANG)[0] != 0
    return count


def descendants(pids) -> list[psutil.Process]:
    """Return the live processes below (and including) ``pids``."""
    # One table of parents for the whole sweep, not one read of every process per process.
    below: dict[int, list[int]] = {}
    for proc in psutil.process_iter(["ppid"]):
        below.setdefault(proc.info["ppid"], []).append(proc.pid)
    found, todo = {}, list(pids)
    while todo:
        pid = todo.pop()
        if pid not in found:
            with contextlib.suppress(psutil.Error):
                found[pid] = psutil.Process(pid)
                todo += below.get(pid, [])
    return list(found.values())


def find_below(pid: int, marker: str) -> int | None:
    """The pid of the process nearest below ``pid`` whose command line contains ``marker``.

    Searched level by level, so a fork of the found one is not taken for it; ``bwrap``
    (whose arguments hold the command it starts) is passed over.
    """
    level = [pid]
    while level:
        below = []
        for parent in level:
            with contextlib.suppress(psutil.Error):
                below += psutil.Process(parent).children()
        for proc in sorted(below, key=lambda p: p.pid):
            with contextlib.suppress(psutil.Error):
                cmd = proc.cmdline()
                if cmd and os.path.basename(cmd[0]) != "bwrap" and any(marker in c for c in cmd):
                    return proc.pid
        level = [p.pid for p in below]
    return None


def kill_tree(pids) -> None:
    """SIGKILL every process below ``pids`` and their process groups; wait for them to go."""
    procs = descendants(pids)
    groups = set()
    for proc in procs:
        with contextlib.suppress(psutil.Error, OSError):
            groups.add(os.getpgid(proc.pid))
    for pgid in groups - {os.getpgid(0)}:
        signal_group(pgid, signal.SIGKILL)
    for proc in procs:
        with contextlib.suppress(psutil.Error):
            proc.kill()
    psutil.wait_procs(procs, timeout=5)


def kill_new_children(before: set[int]) -> None:
    """Kill every descendant of this process whose top ancestor here is not in ``before``."""
    for _ in range(3):  # a dying parent may hand us new orphans
        reap(keep=before)
        mine = [p.pid for p in psutil.Process().children() if p.pid not in before]
        if not mine:
            break
        kill_tree(mine)
        time.sleep(0.05)
    reap(keep=before)
