"""Own every process a graded notebook or rank starts, and stop them all.

Each child is started in its own session (its own process group). While
grading, this process is a child subreaper (Linux), so a grandchild that
detaches (``setsid`` + double fork) is re-parented here instead of to init and
is still found, and killed, as a descendant; every sweep also reaps (``waitpid``)
whatever has exited, so adopted orphans never pile up as zombies.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys
import time

import psutil

_PR_SET_CHILD_SUBREAPER = 36


def _set_subreaper(on: bool) -> bool:
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(_PR_SET_CHILD_SUBREAPER, 1 if on else 0, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


@contextlib.contextmanager
def subreaper():
    """Adopt orphaned descendants while the block runs (Linux); reap them at the end."""
    before = {p.pid for p in psutil.Process().children()}
    on = _set_subreaper(True)
    try:
        yield
    finally:
        kill_new_children(before)
        if on:
            _set_subreaper(False)


def reap(keep=()) -> int:
    """Collect the exit status of every ended child of this process but ``keep``; return how many.

    A subreaper adopts every orphan below it, and an adopted process that exits stays
    a zombie until its parent waits for it: thousands of them would fill the process
    table and slow every sweep. ``keep``: children whose status their owner still
    waits for (a ``Popen`` of a caller).
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
    # One table of parents for the whole sweep: asking each process for its children
    # would read every process's status once per process.
    below: dict[int, list[int]] = {}
    for proc in psutil.process_iter(["ppid"]):
        below.setdefault(proc.info["ppid"], []).append(proc.pid)
    found, todo = {}, list(pids)
    while todo:
        pid = todo.pop()
        if pid in found:
            continue
        try:
            found[pid] = psutil.Process(pid)
        except psutil.Error:
            continue
        todo += below.get(pid, [])
    return list(found.values())


def find_below(pid: int, marker: str) -> int | None:
    """The pid of the process nearest below ``pid`` whose command line contains ``marker``.

    Levels are searched top down, so a process the found one forked (same command line)
    is not taken for it; a sandbox's own processes (``bwrap``, whose arguments hold the
    command it starts) are passed over.
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
                if cmd and os.path.basename(cmd[0]) != "bwrap" and \
                        any(marker in part for part in cmd):
                    return proc.pid
        level = [p.pid for p in below]
    return None


def kill_tree(pids, grace: float = 0.0) -> None:
    """SIGKILL every process below ``pids`` and their process groups; wait for them to go."""
    procs = descendants(pids)
    groups = set()
    for proc in procs:
        with contextlib.suppress(psutil.Error, OSError):
            groups.add(os.getpgid(proc.pid))
    for pgid in groups:
        if pgid not in (os.getpgid(0),):
            with contextlib.suppress(OSError):
                os.killpg(pgid, signal.SIGKILL)
    for proc in procs:
        with contextlib.suppress(psutil.Error):
            proc.kill()
    psutil.wait_procs(procs, timeout=5)


def kill_new_children(before: set[int]) -> None:
    """Kill every descendant of this process whose top ancestor here is not in ``before``."""
    for _ in range(3):  # a dying parent may hand us new orphans
        reap(keep=before)
        mine = [p for p in psutil.Process().children() if p.pid not in before]
        if not mine:
            return
        kill_tree([p.pid for p in mine])
        time.sleep(0.05)
    reap(keep=before)
