"""Environment of the ranks: what a worker starts with (GPUs hidden or not), and the slow-link switch.

Both are plain environment variables read by the processes a launch starts, so
they are set in the launching process before the ranks start.
"""

from __future__ import annotations

import contextlib
import os
import socket

# NCCL over sockets: no NVLink / PCIe peer access and no shared memory between GPUs,
# which makes communication as visible as on a cross-node Ethernet link.
SLOW_LINK_ENV = {"NCCL_P2P_DISABLE": "1", "NCCL_SHM_DISABLE": "1"}


def package_root() -> str:
    """The folder that holds the ``dpcourse`` package (the checkout, in a development install)."""
    return os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def worker_env(hide_gpus: bool = False, keep=None) -> dict:
    """Return the environment a rank starts with: ours, this package importable, gloo on loopback.

    Args:
        hide_gpus: make every GPU invisible to the rank (``CUDA_VISIBLE_DEVICES`` empty).
            CUDA reads the variable once, when the rank's torch first initialises it,
            which is after the process starts with this environment.
        keep: ``None`` (default): every variable of ours. Else only the variables named
            here; a name ending in ``_`` keeps every variable it begins (``"NCCL_"``). The
            grader's ranks start so, with nothing of the grader's environment they do not need.
    """
    if keep is None:
        env = dict(os.environ)
    else:
        names = tuple(keep)
        prefixes = tuple(k for k in names if k.endswith("_"))
        env = {k: v for k, v in os.environ.items() if k in names or k.startswith(prefixes)}
    env["PYTHONUNBUFFERED"] = "1"
    if hide_gpus:
        env["CUDA_VISIBLE_DEVICES"] = ""
    env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root(), env.get("PYTHONPATH")) if p)
    # gloo listens on the interface its host name resolves to (often the LAN):
    # all ranks live on this machine, so keep their traffic on loopback.
    names = [name for _, name in socket.if_nameindex()] if hasattr(socket, "if_nameindex") else []
    loopback = next((n for n in ("lo", "lo0") if n in names), None)
    if loopback and "GLOO_SOCKET_IFNAME" not in env:
        env["GLOO_SOCKET_IFNAME"] = loopback
    return env


@contextlib.contextmanager
def slow_link(enabled: bool):
    """Route NCCL through sockets (no NVLink / PCIe peer access, no shared memory) inside the block.

    The ranks are started inside the block and inherit the environment, so
    NCCL reads these variables when it starts; they are restored afterwards.

    Args:
        enabled: set the variables; ``False`` leaves the environment alone.
    """
    saved = {k: os.environ.get(k) for k in SLOW_LINK_ENV}
    if enabled:
        os.environ.update(SLOW_LINK_ENV)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
