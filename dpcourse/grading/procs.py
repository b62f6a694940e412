"""Own every process a graded notebook or rank starts, and stop them all.

Each child is started in its own session (its own process group). While
grading, this process is a child subreaper (Linux), so a grandchild that
detaches (``setsid`` + double fork) is re-parented here instead of to init and
is still found, and killed, as a descendant.
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


def descendants(pids) -> list[psutil.Process]:
    """Return the live processes below (and including) ``pids``."""
    found = {}
    for pid in pids:
        try:
            proc = psutil.Process(pid)
            found[proc.pid] = proc
            for child in proc.children(recursive=True):
                found[child.pid] = child
        except psutil.Error:
            continue
    return list(found.values())


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
        mine = [p for p in psutil.Process().children() if p.pid not in before]
        if not mine:
            return
        kill_tree([p.pid for p in mine])
        time.sleep(0.05)
