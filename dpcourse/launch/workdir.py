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
# The longest path an AF_UNIX socket may have: sockaddr_un.sun_path holds 108 bytes on
# Linux and 104 on macOS, the final NUL included. DataLoader workers hand tensors to the
# rank through such sockets, made in multiprocessing's temporary directory, which each
# rank sets to WORKDIR/mp<rank> (dpcourse.launch.worker).
SOCKET_PATH_MAX = 103
# What a socket path adds to the work directory: "/mp<rank>/listener-<8 random characters>".
SOCKET_SUFFIX = len("/mp9999/listener-12345678")
# Where the work directory goes when the temporary directory's own path is too long.
SHORT_TEMP_DIR = "/tmp"


def _temp_dirs() -> list[str]:
    """The directories work directories are made in: the temporary directory, then /tmp."""
    return list(dict.fromkeys([tempfile.gettempdir(), SHORT_TEMP_DIR]))


def make_workdir(label: str = "") -> str:
    """Create a launch's work directory; return its path.

    First it removes the directories of launchers that no longer exist
    (:func:`clean_stale_workdirs`). The new one goes in the temporary directory
    (``TMPDIR``) unless the socket paths inside it would be too long for an AF_UNIX
    address: a DataLoader worker then cannot hand over its batch, and the rank waits
    for it forever. Then it goes in /tmp.

    Args:
        label: a word put in the name after the launching process's pid (the grader
            names the check), so that :func:`clean_stale_workdirs` still recognises it.

    Raises:
        RuntimeError: neither directory gives socket paths that fit; says what to set.
    """
    clean_stale_workdirs()
    prefix = f"{WORKDIR_PREFIX}{os.getpid()}-" + (f"{label}-" if label else "")
    for tmp in _temp_dirs():
        # mkdtemp adds 8 random characters to the prefix.
        if len(os.path.join(os.path.abspath(tmp), prefix)) + 8 + SOCKET_SUFFIX <= SOCKET_PATH_MAX \
                and os.path.isdir(tmp) and os.access(tmp, os.W_OK | os.X_OK):
            return tempfile.mkdtemp(prefix=prefix, dir=tmp)
    raise RuntimeError(
        f"the temporary directory {tempfile.gettempdir()} has too long a path for the sockets "
        f"DataLoader workers use (at most {SOCKET_PATH_MAX} characters in all), and "
        f"{SHORT_TEMP_DIR} cannot be used instead. Set TMPDIR to a short writable directory "
        "before starting Python, e.g. TMPDIR=/tmp.")


def clean_stale_workdirs() -> list[str]:
    """Remove the work directories of launchers that no longer exist; return their paths.

    A launcher removes its own directory when it stops; one killed outright
    cannot, and its directory (with the pickled function) would stay behind.
    Only directories of this user whose launcher process is gone are removed,
    from every directory :func:`make_workdir` uses.
    """
    removed = []
    for tmp in _temp_dirs():
        removed += _clean_stale_workdirs_in(tmp)
    return removed


def _clean_stale_workdirs_in(tmp: str) -> list[str]:
    removed: list[str] = []
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
