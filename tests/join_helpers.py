"""Rank functions for the uneven-input tests (module level, so dpcourse.run can pickle them)."""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from torch.distributed.algorithms import Join

from ddp_helpers import loss_of, make_model, make_wrapper, state_of


def batches_of(name: str, rank: int, count: int, size: int = 4) -> list:
    """This rank's own ``count`` batches (different on every rank)."""
    g = torch.Generator().manual_seed(50 + rank)
    if name == "tied":
        return [tuple(torch.randint(0, 16, (2, size), generator=g)) for _ in range(count)]
    return [(torch.randn(size, 8, generator=g), torch.randn(size, 1, generator=g))
            for _ in range(count)]


def train_under_join(model, name: str, batches, divide: bool, no_sync_every: int = 0) -> dict:
    """Run this rank's batches inside ``Join``; return the final state and the step count."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    with Join([model], divide_by_initial_world_size=divide):
        for i, (x, y) in enumerate(batches):
            if no_sync_every and i % no_sync_every == 0:
                with model.no_sync():
                    loss_of(name, model, x, y).backward()
                continue
            loss_of(name, model, x, y).backward()
            opt.step()
            opt.zero_grad()
    return state_of(model)


def join_against_torch(counts: list[int], cases: dict) -> dict:
    """Final states of ours and of torch DDP under Join, per case.

    Each case is ``(kind, model, divide_by_initial_world_size, wrapper kwargs, hook, no_sync_every)``.
    """
    from hook_helpers import hook_and_state

    rank = dist.get_rank()
    out = {}
    for key, (kind, name, divide, kwargs, hook, no_sync_every) in cases.items():
        batches = batches_of(name, rank, counts[rank])
        base = make_model(name)
        ours = make_wrapper(kind, copy.deepcopy(base), **kwargs)
        cap = {"bucket_cap_mb": kwargs["bucket_cap_mb"]} if "bucket_cap_mb" in kwargs else {}
        ref = torch.nn.parallel.DistributedDataParallel(copy.deepcopy(base), **cap)
        if hook:
            ours.register_comm_hook(*hook_and_state(hook))
            ref.register_comm_hook(*hook_and_state(hook, for_torch=True))
        out[key] = {"ours": train_under_join(ours, name, batches, divide, no_sync_every),
                    "ddp": train_under_join(ref, name, batches, divide, no_sync_every)}
    return out
