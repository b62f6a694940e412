"""Helpers for lesson 16, where torch's own tools replace the ones the course built.

* :func:`trace_collectives` records the collectives torch's FSDP, DDP or DCP call
  through ``torch.distributed`` (op, the group's ranks, bytes, dtype);
* :func:`saved_tensor_bytes` counts what autograd keeps for backward, through
  ``torch.autograd.graph.saved_tensors_hooks``;
* :func:`train_resumable` and ``python -m dpcourse.torch_tools`` train a small model
  under torch DDP with a checkpoint after every few steps, resume from the last one
  after a restart, and can crash once on purpose: the worker of the lesson's
  ``torchrun --max-restarts`` run.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import traceback
from typing import NoReturn

import torch
import torch.distributed as dist

# torch.distributed's names for what FSDP calls (the gather and scatter have two names
# across torch versions), mapped to one op name each.
TRACED = {"all_gather_into_tensor": "all_gather", "all_gather_single": "all_gather",
          "reduce_scatter_tensor": "reduce_scatter", "reduce_scatter_single": "reduce_scatter",
          "all_reduce": "all_reduce", "broadcast": "broadcast"}


@contextlib.contextmanager
def trace_collectives(events: list | None = None):
    """Record each collective called through ``torch.distributed`` while the block runs.

    Wraps the functions named in :data:`TRACED`; a call made from inside another traced
    call (one name forwarding to the other) is recorded once.

    Args:
        events: the list to append to (default: a new one).

    Yields:
        The list of ``{"op", "ranks", "nbytes", "dtype"}`` dicts: ``ranks`` are the global
        ranks of the call's group, ``nbytes`` the size of its largest tensor (the full,
        N x chunk buffer of a gather or scatter).
    """
    events = [] if events is None else events
    inside = threading.local()
    saved = {name: getattr(dist, name) for name in TRACED if hasattr(dist, name)}

    def wrap(name, fn):
        def traced(*args, **kwargs):
            if getattr(inside, "depth", 0) == 0:
                tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
                big = max(tensors, key=lambda t: t.numel())
                group = kwargs.get("group")
                events.append(dict(op=TRACED[name], ranks=dist.get_process_group_ranks(group or dist.group.WORLD),
                                   nbytes=big.numel() * big.element_size(), dtype=str(big.dtype)))
            inside.depth = getattr(inside, "depth", 0) + 1
            try:
                return fn(*args, **kwargs)
            finally:
                inside.depth -= 1
        return traced

    for name, fn in saved.items():
        setattr(dist, name, wrap(name, fn))
    try:
        yield events
    finally:
        for name, fn in saved.items():
            setattr(dist, name, fn)


@contextlib.contextmanager
def saved_tensor_bytes():
    """Count the bytes autograd saves for backward while the block runs.

    Every tensor autograd packs passes through a ``saved_tensors_hooks`` pack hook;
    a storage saved twice (a weight used by two operations) counts once.

    Yields:
        A dict whose ``"bytes"`` and ``"tensors"`` fill in as the block runs.
    """
    seen, box = set(), {"bytes": 0, "tensors": 0}

    def pack(t):
        storage = t.untyped_storage()
        key = (storage.data_ptr(), storage.nbytes())
        if key not in seen:
            seen.add(key)
            box["bytes"] += storage.nbytes()
            box["tensors"] += 1
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        yield box


def _model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))


def _batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The same batch for (step, rank) in every run, restarted or not."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)


def train_resumable(steps: int, folder: str | None = None, save_every: int = 2,
                    crash_at: int = -1) -> dict:
    """Train with torch DDP for ``steps`` steps, resuming from ``folder``'s checkpoint if any.

    Call on every rank of an initialised process group. Rank 0 saves the model, the
    optimizer (its momentum) and the step number after every ``save_every`` steps,
    writing a new file and renaming it over the old one, so a crash never leaves half a
    checkpoint. With ``crash_at >= 0``, rank 1 of the first attempt (torchrun's
    ``TORCHELASTIC_RESTART_COUNT`` 0) exits with code 1 just before that step.

    Args:
        steps: optimizer steps in all.
        folder: where the checkpoint lives (``None``: no checkpoint, no resume).
        save_every: steps between checkpoints.
        crash_at: the step before which rank 1 dies once (-1: never).

    Returns:
        ``{"params": [tensors], "started_at": first step this attempt ran,
        "restart": the restart count}``.
    """
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = DDP(_model())
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    path = os.path.join(folder, "checkpoint.pt") if folder else None
    start = 0
    if path and os.path.exists(path):
        state = torch.load(path, weights_only=True)
        model.module.load_state_dict(state["model"])
        opt.load_state_dict(state["optim"])
        start = state["step"]
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    for step in range(start, steps):
        if step == crash_at and restart == 0 and dist.get_rank() == 1:
            os._exit(1)  # a worker dies mid-run: no clean-up, as after a real fault
        x, y = _batch(step, dist.get_rank())
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
        if path and (step + 1) % save_every == 0:
            if dist.get_rank() == 0:
                state = {"model": model.module.state_dict(), "optim": opt.state_dict(), "step": step + 1}
                torch.save(state, path + ".tmp")
                os.replace(path + ".tmp", path)
            dist.barrier()  # nobody runs ahead of a checkpoint that is not written yet
    return {"params": [p.detach().clone() for p in model.parameters()], "started_at": start,
            "restart": restart}


def init_attempt_process_group(backend: str = "gloo") -> None:
    """Join the process group of this torchrun attempt, under a store prefix of its own.

    torchrun's workers find each other through a key-value store that outlives a
    restart. Each attempt (``TORCHELASTIC_RESTART_COUNT``) writes and reads its keys
    under ``attempt-<n>/``, so a restarted worker never reads an address a worker of
    the failed attempt wrote.
    """
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    hosted = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"  # torchrun's agent holds it
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world,
                          is_master=not hosted and rank == 0)
    dist.init_process_group(backend, store=dist.PrefixStore(f"attempt-{restart}", store),
                            rank=rank, world_size=world)


def main(argv=None) -> NoReturn:
    """Run :func:`train_resumable` as a torchrun worker; rank 0 saves the result to ``--out``.

    A worker destroys its process group and ends with ``os._exit``: status 0 when it
    finished, 1 (after printing the traceback) when it raised. It skips interpreter
    finalization, where a gloo worker can abort with status -6
    (:mod:`dpcourse.launch.teardown`), which torchrun would take for a failed attempt.
    """
    import argparse

    from dpcourse.launch.teardown import destroy_and_exit

    parser = argparse.ArgumentParser(description="a torchrun worker that resumes from its checkpoint")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--folder", required=True)
    parser.add_argument("--save-every", type=int, default=2)
    parser.add_argument("--crash-at", type=int, default=-1)
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    init_attempt_process_group()
    try:
        result = train_resumable(args.steps, args.folder, args.save_every, args.crash_at)
        # One write per line: both workers print to one pipe, and print() writes the text
        # and its newline separately when the output is unbuffered (PYTHONUNBUFFERED).
        sys.stdout.write(f"rank {dist.get_rank()}: restart {result['restart']}, started at step "
                         f"{result['started_at']}, finished step {args.steps}\n")
        sys.stdout.flush()
        if dist.get_rank() == 0:
            torch.save(result, args.out)
    except BaseException:  # noqa: BLE001 - shown here, reported to torchrun as status 1
        traceback.print_exc()
        destroy_and_exit(1)
    destroy_and_exit(0)


if __name__ == "__main__":
    main()
