"""The largest GPT (by layer count) that trains per GPU: replicated (DDP) against sharded (FSDP).

Replicated, a rank holds 16 bytes per parameter with AdamW and bf16 autocast
(fp32 weights, fp32 gradients, two fp32 moments); fully sharded over ``N``
ranks, ``16 / N`` plus one gathered unit. The layer count is what grows.

* DDP: on one GPU (a 1-rank process group), the largest layer count whose
  training step succeeds, found by bisection on out-of-memory errors (safe on
  one rank: no other rank waits in a collective).
* FSDP on all ranks: peak memory is measured at two small layer counts, the
  per-layer slope extrapolated to ``fill`` of the device, and that layer count
  is then trained for real. (Bisection by out-of-memory would leave the other
  ranks waiting inside a collective.) The GPT is built on the meta device and
  materialised by FSDP one unit at a time (rank 0 initialises each unit and
  sends the shards), so that construction never needs the whole model on one
  GPU; the peak of construction and that of training are recorded apart, and
  the extrapolation uses the larger of the two.
"""

from __future__ import annotations

import gc

import torch
import torch.distributed as dist

from dpcourse.bench.sharded import build_variant, count_parameters
from dpcourse.bench.workload import make_step
from dpcourse.device import rank_device


def _cfg(n_layer: int, width: int, seq_len: int):
    from dpcourse.models import GPTConfig

    return GPTConfig(block_size=seq_len, n_layer=n_layer, n_head=width // 128, n_embd=width)


def _train_peak(variant: str, n_layer: int, width: int, seq_len: int, device, group,
                steps: int = 2) -> dict:
    """Build, then train ``steps`` steps (raises torch.OutOfMemoryError).

    Returns:
        ``{"build": peak bytes allocated while building, "train": peak bytes allocated
        while training}`` (both absolute: what was held counts).
    """
    from dpcourse.models import random_tokens

    cfg = _cfg(n_layer, width, seq_len)
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    idx, targets = (t.to(device) for t in random_tokens(1, cfg, seed=0))
    model, opt, amp, _ = build_variant(variant, cfg, device, group=group,
                                       from_meta=variant == "fsdp")
    torch.cuda.synchronize(device)
    build = torch.cuda.max_memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    step = make_step(model, opt, idx, targets, amp)
    for _ in range(steps):
        step()
    torch.cuda.synchronize(device)
    peak = {"build": build, "train": torch.cuda.max_memory_allocated(device)}
    del model, opt, step
    return peak


def _fits(n_layer: int, width: int, seq_len: int, device, group) -> bool:
    ok = True
    try:
        _train_peak("torch_ddp", n_layer, width, seq_len, device, group)
    except torch.OutOfMemoryError:
        ok = False
    gc.collect()  # outside the except block: the traceback no longer pins the tensors
    torch.cuda.empty_cache()
    return ok


def largest_ddp_layers(width: int, seq_len: int, device, group, start: int = 8) -> int:
    """Bisect the largest layer count that trains under torch DDP on this (single) rank."""
    lo, hi = 0, start
    while _fits(hi, width, seq_len, device, group):
        lo, hi = hi, hi * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if _fits(mid, width, seq_len, device, group) else (lo, mid)
    return lo


def model_capacity(*, width: int = 2048, seq_len: int = 256, fill: float = 0.95) -> dict:
    """Measure the largest GPT trained per GPU with DDP (1 GPU) and our FSDP (all ranks).

    Call on every rank of a NCCL group (e.g. ``dpcourse.run(model_capacity, timeout=600)``).

    Args:
        width: model width (heads of 128); vocabulary 50257, sequence ``seq_len``, batch 1.
        seq_len: tokens per sequence.
        fill: fraction of the device's memory the FSDP extrapolation aims at.

    Returns:
        ``{"ddp_layers", "ddp_params", "fsdp_layers", "fsdp_params", "fsdp_peak_bytes"
        (the larger of construction and training), "fsdp_build_peak_bytes",
        "fsdp_train_peak_bytes", "fsdp_fit": {layers: peak}, "fsdp_fit_phases":
        {layers: {"build", "train"}}, "device_bytes", "world_size"}``.
    """
    device = rank_device()
    torch.cuda.set_device(device)
    rank, world = dist.get_rank(), dist.get_world_size()
    solo = dist.new_group([0])  # every rank must take part in creating it
    out: dict = {"world_size": world, "width": width, "seq_len": seq_len,
                 "device_bytes": torch.cuda.get_device_properties(device).total_memory}
    # FSDP first: the bisection's failed attempts can leave the allocator fragmented.
    phases = {n: _train_peak("fsdp", n, width, seq_len, device, None) for n in (4, 12)}
    fit = {n: max(p.values()) for n, p in phases.items()}  # both phases must fit
    slope = (fit[12] - fit[4]) / 8
    target = int((fill * out["device_bytes"] - fit[4]) / slope) + 4
    t = torch.tensor([target], device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)  # every rank trains the same model
    target = int(t.item())
    peak = _train_peak("fsdp", target, width, seq_len, device, None)
    out.update(fsdp_layers=target, fsdp_params=count_parameters(_cfg(target, width, seq_len)),
               fsdp_peak_bytes=max(peak.values()), fsdp_build_peak_bytes=peak["build"],
               fsdp_train_peak_bytes=peak["train"], fsdp_fit=fit, fsdp_fit_phases=phases)
    gc.collect()
    torch.cuda.empty_cache()
    dist.barrier()
    if rank == 0:
        layers = largest_ddp_layers(width, seq_len, device, solo, start=32)
        out.update(ddp_layers=layers, ddp_params=count_parameters(_cfg(layers, width, seq_len)))
    dist.barrier()
    return out
