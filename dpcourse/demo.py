"""Terminal demo: train one model with dpcourse's wrappers and with torch DDP, side by side.

Every rank trains identical copies of a small MLP on its shard of a regression
dataset: one copy per dpcourse wrapper and one under
``torch.nn.parallel.DistributedDataParallel``. Rank 0 prints the global loss of
each copy and the largest parameter difference from torch DDP after each step:
the differences stay at rounding level because data parallelism is exact.

Run it with ``dpcourse demo --world-size 2 --steps 20``, or under torchrun::

    dpcourse launch -m dpcourse.demo --steps 20
    torchrun --nproc-per-node 2 -m dpcourse.demo --backend gloo
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
import traceback

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.data import DataLoader

from dpcourse.device import rank_device
from dpcourse.launch import resolve_backend
from dpcourse.launch.teardown import destroy_and_exit

WRAPPERS = ("DataParallelNaive", "DataParallelBucketed", "DataParallelOverlapped")


def train(steps: int = 20, batch_size: int = 16, lr: float = 0.05) -> list[dict]:
    """Train every wrapper and torch DDP for ``steps`` steps on this rank; return one row per step.

    Args:
        steps: optimizer steps.
        batch_size: per-rank batch size (global batch = batch_size * world_size).
        lr: SGD learning rate.

    Returns:
        Rows ``{"step", "loss": {name: global mean loss},
        "max_diff": {name: max |param - DDP's param|}}``.
    """
    from dpcourse import ddp as dp
    from dpcourse.data import ShardedSampler, make_regression
    from dpcourse.models import MLP

    device, world = rank_device(), dist.get_world_size()
    base = MLP(in_features=8, hidden=64, out_features=1, depth=4, seed=0).to(device)
    # bucket_cap_mb small enough that this tiny MLP gets several buckets.
    kwargs = {"DataParallelBucketed": {"bucket_cap_mb": 0.01},
              "DataParallelOverlapped": {"bucket_cap_mb": 0.01}}
    models = {name: getattr(dp, name)(copy.deepcopy(base), **kwargs.get(name, {}))
              for name in WRAPPERS}
    models["torch DDP"] = torch.nn.parallel.DistributedDataParallel(copy.deepcopy(base))
    opts = {name: torch.optim.SGD(m.parameters(), lr=lr) for name, m in models.items()}
    data = make_regression(n=batch_size * world * steps, in_features=8, seed=0)
    sampler = ShardedSampler(data, shuffle=True, seed=0)
    loader = DataLoader(data, batch_size=batch_size, sampler=sampler)
    rows = []
    for step, (x, y) in zip(range(steps), loader):
        x, y = x.to(device), y.to(device)
        losses = torch.zeros(len(models), device=device)
        for i, (name, model) in enumerate(models.items()):
            loss = F.mse_loss(model(x), y)
            loss.backward()  # the wrappers average gradients inside backward, like torch DDP
            opts[name].step()
            opts[name].zero_grad()
            losses[i] = loss.detach()
        dist.all_reduce(losses)  # only for printing the global mean loss
        ref = list(models["torch DDP"].parameters())
        rows.append({
            "step": step,
            "loss": {n: v / world for n, v in zip(models, losses.tolist())},
            "max_diff": {n: max((p - q).abs().max().item() for p, q in zip(m.parameters(), ref))
                         for n, m in models.items() if n != "torch DDP"},
        })
    return rows


def format_rows(rows: list[dict], world_size: int, backend: str) -> str:
    """Lay out the per-step rows as a table.

    Args:
        rows: what :func:`train` returned on rank 0.
        world_size: number of ranks (for the header).
        backend: process-group backend (for the header).

    Returns:
        The table as one string.
    """
    names = list(rows[0]["loss"]) if rows else []
    short = {n: n.replace("DataParallel", "") for n in names}
    head = f"{'step':>4}  " + "  ".join(f"{'loss ' + short[n]:>16}" for n in names)
    head += "  " + "  ".join(f"{'max|Δ| ' + short[n]:>16}" for n in names if n != "torch DDP")
    lines = [f"data-parallel demo: world_size={world_size}, backend={backend}; "
             "loss = global mean, max|Δ| = largest parameter difference from torch DDP", head]
    for r in rows:
        line = f"{r['step']:>4}  " + "  ".join(f"{r['loss'][n]:>16.6f}" for n in names)
        line += "  " + "  ".join(f"{r['max_diff'][n]:>16.2e}" for n in names if n != "torch DDP")
        lines.append(line)
    return "\n".join(lines)


def _run_rank(steps: int) -> str:
    rows = train(steps)
    return format_rows(rows, dist.get_world_size(), dist.get_backend())


def cli(args: argparse.Namespace) -> int:
    """Run the demo on fresh local ranks (``dpcourse demo``); print rank 0's table.

    Args:
        args: ``world_size`` (None: one per GPU, else 2), ``backend`` and ``steps``.

    Returns:
        Process exit status.
    """
    import dpcourse
    from dpcourse.argtypes import UsageError

    if args.steps < 1:
        raise UsageError(f"--steps must be at least 1, got {args.steps}")
    try:
        dpcourse.resolve_backend(args.backend, args.world_size)
    except ValueError as exc:
        raise UsageError(f"--backend/--world-size: {exc}") from None
    tables = dpcourse.run(_run_rank, args.steps, world_size=args.world_size, backend=args.backend)
    print(tables[0])
    return 0


def main(argv: list[str] | None = None) -> int:
    """Run the demo in a process started by torchrun (RANK, WORLD_SIZE, ... in the environment).

    Without RANK in the environment it starts local ranks itself and returns the exit
    status. Under torchrun, when it created the process group, it destroys it and ends
    the process with ``os._exit`` rather than returning: status 0, or 1 after printing
    the traceback of what the rank raised (:func:`dpcourse.launch.teardown.destroy_and_exit`).
    """
    parser = argparse.ArgumentParser(prog="python -m dpcourse.demo",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--backend", default="auto", choices=["auto", "gloo", "nccl"])
    args = parser.parse_args(argv)
    if "RANK" not in os.environ:
        # Not under torchrun: start local ranks ourselves.
        return cli(argparse.Namespace(world_size=None, backend=args.backend, steps=args.steps))
    backend = args.backend
    if backend == "auto":
        backend = resolve_backend("auto", int(os.environ.get("LOCAL_WORLD_SIZE", 1)))[0]
    owns_group = not dist.is_initialized()
    if owns_group:
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group(backend)
    try:
        table = _run_rank(args.steps)
        if dist.get_rank() == 0:
            print(table, flush=True)
    except BaseException:  # noqa: BLE001 - shown here, reported to torchrun as status 1
        if not owns_group:
            raise
        traceback.print_exc()
        destroy_and_exit(1)
    if owns_group:
        destroy_and_exit(0)  # skip interpreter finalization: see dpcourse.launch.teardown
    return 0


if __name__ == "__main__":
    sys.exit(main())
