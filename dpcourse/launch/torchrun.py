"""``dpcourse launch``: run a script on several processes through torchrun, as many as ``run``."""

from __future__ import annotations

import argparse
import sys

from dpcourse.argtypes import UsageError


def _has_any(argv: list[str], *flags: str) -> bool:
    return any(a == f or a.startswith(f + "=") for a in argv for f in flags)


def _check_nproc(argv: list[str]) -> None:
    """Refuse a ``--nproc-per-node`` torchrun would reject only after creating its temp dirs."""
    for i, a in enumerate(argv):
        for flag in ("--nproc-per-node", "--nproc_per_node"):
            if a == flag or a.startswith(flag + "="):
                following = argv[i + 1] if i + 1 < len(argv) else ""
                value = a.split("=", 1)[1] if "=" in a else following
                whole = value.isdigit() and int(value) >= 1
                if value not in ("auto", "cpu", "gpu", "xpu") and not whole:
                    raise UsageError(f"launch: {flag} must be a whole number >= 1, or auto, cpu "
                                     f"or gpu, got {value!r}")
            if a == "--":
                return


def torchrun_command(argv: list[str]) -> list[str]:
    """Build the torchrun command for ``dpcourse launch``: torchrun's own arguments pass through.

    When nothing says how many processes or where to meet, start as many as
    :func:`dpcourse.run` would (one per GPU on a machine with 2 or more, else 2:
    see :func:`dpcourse.launch.ranks.plan_ranks`) and meet through a standalone
    rendezvous on this host.
    """
    from dpcourse.launch.ranks import plan_ranks

    cmd = [sys.executable, "-m", "torch.distributed.run"]
    if not _has_any(argv, "--nproc-per-node", "--nproc_per_node"):
        cmd.append(f"--nproc-per-node={plan_ranks().world_size}")
    multi_node = _has_any(argv, "--nnodes", "--rdzv-endpoint", "--rdzv_endpoint",
                          "--master-addr", "--master_addr", "--standalone")
    if not multi_node:
        cmd.append("--standalone")
    return cmd + argv


def launch(args: argparse.Namespace) -> int:
    """Run torchrun with the arguments of ``dpcourse launch``; return its exit status.

    torchrun runs inside this process (the command printed is its equivalent):
    torch is imported once for the agent instead of once here and once more in
    a torchrun process. Note that torchrun's rendezvous stores listen on every
    network interface, also with ``--standalone``; ``dpcourse.run`` keeps its
    store on loopback.
    """
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun_main

    _check_nproc(args.torchrun_args)
    cmd = torchrun_command(args.torchrun_args)
    print("+ " + " ".join(cmd), file=sys.stderr)
    try:
        torchrun_main(cmd[3:])  # after "python -m torch.distributed.run"
    except ChildFailedError:
        return 1  # torchrun has already printed which rank failed and why
    return 0
