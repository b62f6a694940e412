"""Rank functions for exercise 11's tests: a learner's hook under torch DDP and our wrappers."""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel

from dpcourse.ddp import DataParallelBucketed, DataParallelOverlapped

STEPS = 4


def torch_bf16(state, bucket):
    """torch's bf16 hook under another name: torch DDP refuses the original without CUDA."""
    return default_hooks.bf16_compress_hook(state, bucket)


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(7, 13), nn.Tanh(), nn.Linear(13, 3))  # odd sizes


def _batch(step: int, rank: int):
    gen = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(5, 7, generator=gen), torch.randn(5, 3, generator=gen)


def hook_under_reducers(hook) -> dict:
    """Train with ``hook`` (state ``{}``) under torch DDP and our wrappers, and torch's own hook.

    Returns, per run, the gradients after each backward and the parameters after each step;
    also this rank's own gradients of the first batch (no communication) and the residuals the
    hook kept under torch DDP after each step.
    """
    rank, base = dist.get_rank(), _model()
    local = copy.deepcopy(base)
    x, y = _batch(0, rank)
    nn.functional.mse_loss(local(x), y).backward()
    out = {"local": [p.grad.clone() for p in local.parameters()], "residuals": []}
    runs = {"torch_hook": (DistributedDataParallel(copy.deepcopy(base)), None, torch_bf16),
            "ddp": (DistributedDataParallel(copy.deepcopy(base)), {}, hook),
            "overlapped": (DataParallelOverlapped(copy.deepcopy(base)), {}, hook),
            "bucketed": (DataParallelBucketed(copy.deepcopy(base)), {}, hook)}
    for name, (model, state, fn) in runs.items():
        model.register_comm_hook(state, fn)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        grads, params = [], []
        for step in range(STEPS):
            x, y = _batch(step, rank)
            nn.functional.mse_loss(model(x), y).backward()
            grads.append([p.grad.clone() for p in model.parameters()])
            opt.step()
            opt.zero_grad()
            params.append([p.detach().clone() for p in model.parameters()])
            if name == "ddp":
                out["residuals"].append({k: v.clone() for k, v in state.items()
                                         if isinstance(k, int)})
        out[name] = {"grads": grads, "params": params}
    return out
