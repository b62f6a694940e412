"""Rank functions shared by the data-parallel tests (module level, so dpcourse.run can pickle them).

Every comparison trains three copies of one model from the same weights:
the wrapper under test on this rank's shard, torch DDP on the same shard,
and a plain single-process model on the whole global batch. Exactness of data
parallelism says all three must agree after every optimizer step.
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
import torch.nn.functional as F

from dpcourse import ddp as dpddp
from dpcourse.data import shard_batch
from dpcourse.models import GPT, MLP, GPTConfig, random_tokens
from fixture_models import (BatchNormMLP, TiedEmbeddingModel, frozen_bias_mlp,
                            frozen_layer_mlp)

RTOL, ATOL = 1e-5, 1e-6  # fp32: only summation order differs between the three copies
GLOBAL_BATCH = 12        # divisible by world sizes 1, 2, 3, 4
TINY_GPT = GPTConfig(vocab_size=32, block_size=8, n_layer=2, n_head=2, n_embd=16)


def make_model(name: str, seed: int = 0) -> torch.nn.Module:
    """Build the named test model with the given initialisation seed."""
    builders = {
        "mlp": lambda: MLP(seed=seed),
        "deep_mlp": lambda: MLP(hidden=32, depth=6, seed=seed),
        "frozen_layer": lambda: frozen_layer_mlp(seed=seed),
        "frozen_bias": lambda: frozen_bias_mlp(seed=seed),
        "tied": lambda: TiedEmbeddingModel(seed=seed),
        "batchnorm": lambda: BatchNormMLP(seed=seed),
        "gpt": lambda: GPT(TINY_GPT, seed=seed),
    }
    return builders[name]()


def global_batch(name: str, step: int, size: int = GLOBAL_BATCH):
    """Return the step's global batch ``(x, y)`` for the named model, identical on every rank."""
    g = torch.Generator().manual_seed(1000 + step)
    if name == "tied":
        tokens = torch.randint(0, 16, (2, size), generator=g)
        return tokens[0], tokens[1]
    if name == "gpt":
        return random_tokens(size, TINY_GPT, seed=1000 + step)
    x = torch.randn(size, 8, generator=g)
    return x, torch.randn(size, 1, generator=g)


def loss_of(name: str, model, x, y) -> torch.Tensor:
    """Mean loss of the named model on a batch."""
    if name == "gpt":
        return model(x, y)[1]
    out = model(x)
    if name == "tied":
        return F.cross_entropy(out, y)
    return F.mse_loss(out, y)


def state_of(model) -> dict:
    """Parameters and buffers of a (possibly wrapped) model, by name, cloned."""
    inner = getattr(model, "module", model)
    sd = {n: p.detach().clone() for n, p in inner.named_parameters()}
    sd.update({n: b.detach().clone() for n, b in inner.named_buffers()})
    return sd


def make_wrapper(kind: str, module, **kwargs):
    """Wrap ``module`` in the named dpcourse wrapper (``naive``, ``bucketed``, ``overlapped``)."""
    cls = {"naive": "DataParallelNaive", "bucketed": "DataParallelBucketed",
           "overlapped": "DataParallelOverlapped"}[kind]
    return getattr(dpddp, cls)(module, **kwargs)


def train_three_ways(kind: str, name: str, steps: int = 5, wrapper_kwargs: dict | None = None,
                     single: bool = True, accumulation: int = 1) -> dict:
    """Train the wrapper, torch DDP and (optionally) single-process copies; record states per step.

    With ``accumulation`` A > 1 the wrapper and torch DDP run A micro-steps per
    optimizer step (the first A-1 inside ``no_sync``, each loss divided by A),
    while the single-process model takes one step on the A*K-times larger batch.

    Returns:
        ``{"ours": [...], "ddp": [...], "single": [...]}``: one state dict per step.
    """
    rank, world = dist.get_rank(), dist.get_world_size()
    base = make_model(name)
    ours = make_wrapper(kind, copy.deepcopy(base), **(wrapper_kwargs or {}))
    ref = torch.nn.parallel.DistributedDataParallel(copy.deepcopy(base))
    solo = copy.deepcopy(base)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (ours, ref, solo)]
    out = {"ours": [], "ddp": [], "single": []}
    for step in range(steps):
        xs, ys = global_batch(name, step, GLOBAL_BATCH * accumulation)
        for model in (ours, ref):
            for micro in range(accumulation):
                sl = slice(micro * GLOBAL_BATCH, (micro + 1) * GLOBAL_BATCH)
                x, y = shard_batch(xs[sl], rank, world), shard_batch(ys[sl], rank, world)
                if micro < accumulation - 1:
                    with model.no_sync():
                        (loss_of(name, model, x, y) / accumulation).backward()
                else:
                    (loss_of(name, model, x, y) / accumulation).backward()
        if single:
            loss_of(name, solo, xs, ys).backward()
        for opt in opts:
            opt.step()
            # Alternate both zero_grad flavours: set_to_none must not break bucket views.
            opt.zero_grad(set_to_none=step % 2 == 0)
        out["ours"].append(state_of(ours))
        out["ddp"].append(state_of(ref))
        if single:
            out["single"].append(state_of(solo))
    return out


def assert_three_ways_agree(results: list[dict], label: str = "") -> None:
    """Assert, after every step and on every rank, wrapper == torch DDP == single process."""
    for rank, res in enumerate(results):
        for step, ours in enumerate(res["ours"]):
            refs = [("torch DDP", res["ddp"][step])]
            if res["single"]:
                refs.append(("single process", res["single"][step]))
            for ref_name, ref in refs:
                assert ours.keys() == ref.keys()
                for key in ours:
                    torch.testing.assert_close(
                        ours[key], ref[key], rtol=RTOL, atol=ATOL,
                        msg=lambda m, k=key, s=step, r=rank, rn=ref_name:
                        f"{label}: rank {r}, step {s}, {k} differs from {rn}: {m}")
        for step, ours in enumerate(res["ours"]):  # all replicas stay identical
            for key in ours:
                if "running" not in key and "num_batches" not in key:
                    torch.testing.assert_close(ours[key], results[0]["ours"][step][key],
                                               rtol=0, atol=0)


def gather_sum_all_reduce(tensor, group=None):
    """A different all-reduce: gather every rank's tensor and add them up (counted by the test)."""
    parts = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, tensor.contiguous(), group=group)
    tensor.copy_(torch.stack(parts).sum(0))


def counting_all_reduce(calls: list):
    """Return an ``all_reduce=`` plug-in that appends each tensor's numel to ``calls``, then sums."""
    def counting(tensor, group=None):
        calls.append(tensor.numel())
        gather_sum_all_reduce(tensor, group=group)
    return counting
