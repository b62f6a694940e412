"""Rank functions comparing the reducer options of the wrappers with torch DDP's (picklable)."""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from dpcourse.comm import CommTrace
from dpcourse.data import shard_batch
from fixture_models import UnusedLayerMLP
from ddp_helpers import GLOBAL_BATCH, global_batch, loss_of, make_model, make_wrapper, state_of
from hook_helpers import hook_and_state


class RankBranchMLP(nn.Module):
    """An MLP whose ``extra`` layer only rank 0 uses: used somewhere, unused elsewhere."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.fc1, self.extra, self.fc2 = nn.Linear(8, 16), nn.Linear(16, 16), nn.Linear(16, 1)

    def forward(self, x):
        h = torch.tanh(self.fc1(x))
        if dist.get_rank() == 0:
            h = h + self.extra(h)
        return self.fc2(h)


def build(name: str) -> nn.Module:
    """The named model: ``unused`` and ``rank_branch`` here, the others from ddp_helpers."""
    if name == "unused":
        return UnusedLayerMLP(seed=0)
    if name == "rank_branch":
        return RankBranchMLP()
    return make_model(name)


def train_against_torch(kind: str, name: str, ours: dict, theirs: dict, hook: str | None = None,
                        steps: int = 4) -> dict:
    """Train ours and torch DDP side by side; states, ``.grad is None`` flags and comm per step."""
    rank, world = dist.get_rank(), dist.get_world_size()
    base = build(name)
    model = make_wrapper(kind, copy.deepcopy(base), **ours)
    ref = torch.nn.parallel.DistributedDataParallel(copy.deepcopy(base), **theirs)
    if hook is not None:
        model.register_comm_hook(*hook_and_state(hook))
        ref.register_comm_hook(*hook_and_state(hook, for_torch=True))
    opts = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (model, ref)]
    out = {"ours": [], "ddp": [], "none_ours": [], "none_ddp": [], "comm": []}
    data = "mlp" if name in ("unused", "rank_branch") else name
    for step in range(steps):
        xs, ys = global_batch(data, step)
        x, y = shard_batch(xs, rank, world), shard_batch(ys, rank, world)
        with CommTrace() as trace:
            loss_of(data, model, x, y).backward()
        out["comm"].append((trace.count("all_reduce"), trace.count("broadcast")))
        loss_of(data, ref, x, y).backward()
        out["none_ours"].append([n for n, p in model.module.named_parameters() if p.grad is None])
        out["none_ddp"].append([n for n, p in ref.module.named_parameters() if p.grad is None])
        if hasattr(model, "buckets"):  # does each .grad live inside a bucket's buffer?
            out["grads_are_views"] = [
                p.grad is not None and any(p.grad.data_ptr() == v.data_ptr()
                                           for b in model.buckets for v in b.views)
                for p in model.module.parameters()]
        for opt in opts:
            opt.step()
            opt.zero_grad()
        out["ours"].append(state_of(model))
        out["ddp"].append(state_of(ref))
    out["buckets"] = [list(b.names) for b in getattr(model, "buckets", [])]
    return out


def arrival_order_seen(kind: str, name: str, kwargs: dict) -> list[int]:
    """The order in which post-accumulate-grad hooks fire in one backward of the named model."""
    model = build(name)
    order = []
    params = [p for p in model.parameters() if p.requires_grad]
    handles = [p.register_post_accumulate_grad_hook(lambda p, i=i: order.append(i))
               for i, p in enumerate(params)]
    x, y = global_batch(name, 0)
    loss_of(name, model, x, y).backward()
    for h in handles:
        h.remove()
    return order
