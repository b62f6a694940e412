"""Rank functions shared by the ZeRO and FSDP tests (module level, so dpcourse.run can pickle them)."""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist

from dpcourse.data import shard_batch
from ddp_helpers import global_batch, loss_of

OPTIMIZERS = {
    "adamw": (torch.optim.AdamW, {"lr": 1e-2, "weight_decay": 0.1}),
    "sgd": (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}),
}


def param_state(model) -> dict:
    """Parameters of a (possibly wrapped) model by name, cloned."""
    inner = getattr(model, "module", model)
    return {n: p.detach().clone() for n, p in inner.named_parameters()}


def local_backward(name: str, model, step: int, micro: int = 1) -> None:
    """Backward this rank's slice of the step's global batch, in ``micro`` micro-batches."""
    rank, world = dist.get_rank(), dist.get_world_size()
    xs, ys = global_batch(name, step)
    x, y = shard_batch(xs, rank, world), shard_batch(ys, rank, world)
    per = x.shape[0] // micro
    for m in range(micro):
        sl = slice(m * per, (m + 1) * per)
        (loss_of(name, model, x[sl], y[sl]) / micro).backward()


def single_process_run(name: str, base, opt_name: str, steps: int, groups=None) -> list[dict]:
    """Train a plain copy on the whole global batch; parameters after each step."""
    solo = copy.deepcopy(base)
    cls, kw = OPTIMIZERS[opt_name]
    opt = cls(groups(solo) if groups else solo.parameters(), **kw)
    out = []
    for step in range(steps):
        xs, ys = global_batch(name, step)
        loss_of(name, solo, xs, ys).backward()
        opt.step()
        opt.zero_grad()
        out.append(param_state(solo))
    return out


def max_diff(a: list[dict], b: list[dict]) -> float:
    """Largest absolute difference between two per-step state lists (inf if keys differ)."""
    worst = 0.0
    for sa, sb in zip(a, b, strict=True):
        if sa.keys() != sb.keys():
            return float("inf")
        for k in sa:
            worst = max(worst, (sa[k] - sb[k]).abs().max().item() if sa[k].numel() else 0.0)
    return worst


class on_device:
    """Within the block, ``make_model`` and ``global_batch`` in ``modules`` build on ``device``.

    Lets the gloo checks run unchanged over NCCL (GPU-marked tests).
    """

    def __init__(self, device: torch.device, *modules):
        import ddp_helpers

        self.device, self.modules = device, modules
        self.make_model, self.global_batch = ddp_helpers.make_model, ddp_helpers.global_batch

    def __enter__(self):
        dev, build, batch = self.device, self.make_model, self.global_batch
        for m in self.modules:
            if hasattr(m, "make_model"):
                m.make_model = lambda name, seed=0: build(name, seed).to(dev)
            if hasattr(m, "global_batch"):
                m.global_batch = lambda n, s, size=12: tuple(t.to(dev) for t in batch(n, s, size))
        return self

    def __exit__(self, *exc):
        for m in self.modules:
            if hasattr(m, "make_model"):
                m.make_model = self.make_model
            if hasattr(m, "global_batch"):
                m.global_batch = self.global_batch
