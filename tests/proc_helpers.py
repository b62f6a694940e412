"""Process helpers for tests that start ranks: who is still running, waiting for exits."""

from __future__ import annotations

import time

import psutil


def live_children(proc: psutil.Process | None = None) -> list[psutil.Process]:
    """Descendants of ``proc`` (default: this process) that are running (not zombies)."""
    proc = proc or psutil.Process()
    alive = []
    for child in proc.children(recursive=True):
        try:
            if child.status() != psutil.STATUS_ZOMBIE:
                alive.append(child)
        except psutil.NoSuchProcess:
            pass
    return alive


def wait_gone(pids, timeout: float = 10.0) -> list[int]:
    """Wait until none of ``pids`` runs any more; return those still running."""
    deadline = time.monotonic() + timeout
    while True:
        left = []
        for pid in pids:
            try:
                if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                    left.append(pid)
            except psutil.NoSuchProcess:
                pass
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.05)


def describe(procs) -> str:
    out = []
    for p in procs:
        try:
            out.append(f"{p.pid}: {' '.join(p.cmdline())[:200]}")
        except psutil.Error:
            out.append(str(p.pid))
    return "\n".join(out)
