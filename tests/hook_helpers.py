"""Rank functions for the communication-hook tests (module level, so dpcourse.run can pickle them)."""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

from dpcourse.comm import CommTrace
from dpcourse.data import shard_batch
from ddp_helpers import GLOBAL_BATCH, global_batch, loss_of, make_model, make_wrapper, state_of


def sum_then_halve_hook(state, bucket):
    """A learner's hook: all-reduce the sum, then divide by the world size in a callback."""
    work = dist.all_reduce(bucket.buffer(), async_op=True)
    return work.get_future().then(lambda fut: fut.value()[0] / dist.get_world_size())


def bf16_on_any_device(state, bucket):
    """torch's bf16 hook under another name: torch DDP refuses the original without CUDA."""
    return default_hooks.bf16_compress_hook(state, bucket)


def hook_and_state(hook_name: str, for_torch: bool = False):
    """Torch's hook of that name and a fresh state for it."""
    if hook_name == "powersgd":
        state = powerSGD_hook.PowerSGDState(
            process_group=None, matrix_approximation_rank=1, start_powerSGD_iter=2,
            min_compression_rate=0.5, use_error_feedback=True, warm_start=True)
        return state, powerSGD_hook.powerSGD_hook
    hooks = {"allreduce": default_hooks.allreduce_hook,
             "fp16": default_hooks.fp16_compress_hook,
             "bf16": bf16_on_any_device if for_torch else default_hooks.bf16_compress_hook,
             "learner": sum_then_halve_hook}
    return None, hooks[hook_name]


def train_with_hook(kind: str, name: str, hook_name: str, steps: int = 4,
                    wrapper_kwargs: dict | None = None) -> dict:
    """Train ours and torch DDP with the same hook; states per step and bytes per step (ours)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    base = make_model(name)
    ours = make_wrapper(kind, copy.deepcopy(base), **(wrapper_kwargs or {}))
    ref = torch.nn.parallel.DistributedDataParallel(copy.deepcopy(base))
    ours.register_comm_hook(*hook_and_state(hook_name))
    ref.register_comm_hook(*hook_and_state(hook_name, for_torch=True))
    opts = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (ours, ref)]
    out = {"ours": [], "ddp": [], "bytes": []}
    for step in range(steps):
        xs, ys = global_batch(name, step)
        x, y = shard_batch(xs, rank, world), shard_batch(ys, rank, world)
        with CommTrace() as trace:
            loss_of(name, ours, x, y).backward()
        out["bytes"].append(sum(e.nbytes for e in trace.events if e.op == "all_reduce"))
        loss_of(name, ref, x, y).backward()
        for opt in opts:
            opt.step()
            opt.zero_grad()
        out["ours"].append(state_of(ours))
        out["ddp"].append(state_of(ref))
    return out
