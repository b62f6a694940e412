"""A launch's private work directory: what the ranks find in it, and clean-up after dead launchers.

The launcher writes a :class:`LaunchSpec` to ``WORKDIR/payload.pkl``; each rank
(:mod:`dpcourse.launch.worker`) reads it and writes its result, its stacks and a
``joined`` marker next to it (:class:`dpcourse.launch.procs.Launch` reads those).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import dataclass, field

# Work directories are named after the launching process, so that one left behind
# by a launcher that was killed (SIGKILL, a kernel restart) can be recognised.
WORKDIR_PREFIX = "dpcourse-"


def clean_stale_workdirs(tmp: str | None = None) -> list[str]:
    """Remove the work directories of launchers that no longer exist; return their paths.

    A launcher removes its own directory when it stops; one killed outright
    cannot, and its directory (with the pickled function) would stay behind.
    Only directories of this user whose launcher process is gone are removed.

    Args:
        tmp: the temporary directory to look in (default: ``tempfile.gettempdir()``).
    """
    tmp = tmp or tempfile.gettempdir()
    removed = []
    try:
        names = os.listdir(tmp)
    except OSError:
        return removed
    for name in names:
        pid_text = name[len(WORKDIR_PREFIX):].split("-", 1)[0]
        if not name.startswith(WORKDIR_PREFIX) or not pid_text.isdigit():
            continue
        path = os.path.join(tmp, name)
        try:
            if os.stat(path).st_uid != os.getuid() or _alive(int(pid_text)):
                continue
        except OSError:
            continue
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


@dataclass(frozen=True)
class LaunchSpec:
    """What every rank of one launch needs, written to ``WORKDIR/payload.pkl``.

    Attributes:
        call: ``cloudpickle.dumps((fn, args, kwargs))``.
        world_size: number of ranks.
        backend: ``"gloo"`` or ``"nccl"``.
        host, port: the rendezvous store (loopback).
        timeout: seconds ``fn`` may run once every rank has joined.
        pg_timeout: the process group's own timeout (longer, so the launcher reports a hang).
        sys_path: the launching process's ``sys.path`` (where ``fn``'s module is found).
        prefix: key prefix inside the store.
        hide_gpus: start the ranks with ``CUDA_VISIBLE_DEVICES`` empty (``run(device="cpu")``).
    """

    call: bytes
    world_size: int
    backend: str
    host: str
    port: int
    timeout: float
    pg_timeout: float
    sys_path: list[str] = field(default_factory=list)
    prefix: str = "dpcourse"
    hide_gpus: bool = False
