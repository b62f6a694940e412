"""The training runs that DDP checks compare: torch DDP, one process, and the learner's wrapper.

Every rank builds the same small MLP from a *different* seed (so a missing
start-up broadcast shows), trains it for a few SGD steps on its shard of a
global batch, and records gradients and parameters after every step. The same
loop runs with ``torch.nn.parallel.DistributedDataParallel`` and on one
process with the whole batch, which gives the expected values.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch import nn

IN, HIDDEN, MID, OUT = 8, 16, 12, 4
BATCH = 4     # samples per rank and micro-batch
STEPS = 3
LR = 0.05


def make_model(seed: int, device) -> nn.Sequential:
    """Return the check's MLP (six parameters of distinct sizes) built from ``seed``."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(IN, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, MID), nn.ReLU(),
                         nn.Linear(MID, OUT)).to(device)


def micro_batches(step: int, rank: int, world_size: int, accumulation: int, device) -> list:
    """Return this rank's ``accumulation`` micro-batches ``(x, y)`` of ``step``'s global batch."""
    g = torch.Generator().manual_seed(500 + step)
    n = world_size * accumulation * BATCH
    x, y = torch.randn(n, IN, generator=g), torch.randn(n, OUT, generator=g)
    rows = slice(rank * accumulation * BATCH, (rank + 1) * accumulation * BATCH)
    xs, ys = x[rows].to(device).split(BATCH), y[rows].to(device).split(BATCH)
    return list(zip(xs, ys))


def loss_fn(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Mean squared error (a mean, so the global loss is the mean of the ranks' losses)."""
    return nn.functional.mse_loss(out, y)


def default_train_step(model, optimizer, batches, loss) -> None:
    """Accumulate over ``batches`` (all but the last inside ``no_sync`` when there are several)."""
    optimizer.zero_grad(set_to_none=True)
    k = len(batches)
    ctx = model.no_sync() if k > 1 else contextlib.nullcontext()
    with ctx:
        for x, y in batches[:-1]:
            (loss(model(x), y) / k).backward()
    x, y = batches[-1]
    (loss(model(x), y) / k).backward()
    finish = getattr(model, "finish_gradient_synchronization", None)
    if callable(finish):
        finish()
    optimizer.step()


def snapshot(params) -> list[torch.Tensor]:
    """Return CPU copies of ``params`` (the parameters, or their gradients if given grads)."""
    return [None if p is None else p.detach().cpu().clone() for p in params]


def train(model: nn.Module, wrapped, accumulation: int = 1, train_step=None, trace=None,
          device="cpu", single: bool = False) -> dict:
    """Train ``wrapped`` (which wraps ``model``) for :data:`STEPS` steps; record grads and params.

    Args:
        model: the plain module (its parameters are what the optimizer updates).
        wrapped: what the loop calls: torch DDP, the learner's wrapper, or ``model`` itself.
        accumulation: micro-batches per step.
        train_step: ``fn(model, optimizer, batches, loss_fn)``; default :func:`default_train_step`.
        trace: a :class:`~dpcourse.comm.CommTrace` to mark step boundaries on, or None.
        device: where the data goes.
        single: train on the whole global batch in this one process (the reference).

    Returns:
        ``{"grads": [per step], "params": [per step], "steps": [(start, backward_end, end)]}``.
    """
    params = list(model.parameters())
    optimizer = torch.optim.SGD(params, lr=LR)
    ws = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    step_fn = train_step or default_train_step
    out = {"grads": [], "params": [], "steps": []}
    for step in range(STEPS):
        if single:  # one process takes the whole global batch in one go
            shards = [b for r in range(ws)
                      for b in micro_batches(step, r, ws, accumulation, device)]
            batches = [(torch.cat([x for x, _ in shards]), torch.cat([y for _, y in shards]))]
        else:
            batches = micro_batches(step, rank, ws, accumulation, device)
        start = trace.mark(f"step{step}_start") if trace else 0.0
        step_fn(wrapped, optimizer, batches, loss_fn)
        end = trace.mark(f"step{step}_end") if trace else 0.0
        out["grads"].append(snapshot(p.grad for p in params))
        out["params"].append(snapshot(params))
        out["steps"].append((start, end))
    return out


def references(accumulation: int = 1, bucket_cap_mb: float = 25.0) -> dict:
    """Run torch DDP and single-process training on this rank; return what the checks compare to.

    Args:
        accumulation: micro-batches per step.
        bucket_cap_mb: passed to torch DDP (does not change the numbers).

    Returns:
        ``{"ddp": train() output, "single": train() output}``.
    """
    from dpcourse.device import rank_device

    device, rank = rank_device(), dist.get_rank()
    model = make_model(100 + rank, device)
    ddp = nn.parallel.DistributedDataParallel(
        model, device_ids=[device.index] if device.type == "cuda" else None,
        bucket_cap_mb=bucket_cap_mb)
    ddp_run = train(model, ddp, accumulation, device=device)
    one = make_model(100, device)
    single_run = train(one, one, accumulation, device=device, single=True)
    return {"ddp": ddp_run, "single": single_run}
