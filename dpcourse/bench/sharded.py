"""Sharded data parallelism on GPT: step time and memory per rank of ZeRO-1/2 and FSDP.

Variants (each trains its own GPT, same seed, AdamW):

* ``torch_ddp``: torch DDP (``gradient_as_bucket_view=True``), bf16 autocast.
* ``zero1``: our :class:`~dpcourse.ddp.DataParallelOverlapped` + :class:`~dpcourse.zero.ShardedOptimizer`
  (``gradients="averaged"``), bf16 autocast.
* ``zero2``: ShardedOptimizer ``gradients="sharded"`` on the unwrapped GPT, bf16 autocast.
* ``fsdp``: our :class:`~dpcourse.fsdp.FullyShardedDataParallel`, ``compute_dtype=bf16``.
* ``torch_fsdp``: torch's ``fully_shard`` on every block and the root, bf16 parameters and
  gradient reduction (the same policy as ``fsdp``).
* ``torch_fsdp_tuned``: ``fully_shard`` as torchtitan configures it (:func:`tuned_fully_shard`).

Step times are interleaved (:func:`dpcourse.bench.timing.time_interleaved`); memory is
measured with each variant alone on the device (peak of ``torch.cuda.max_memory_allocated``
over a few steps, above what was allocated before it was built), and by counting the
bytes of this rank's optimizer state and gradients.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from dpcourse.bench.timing import device_name, summarize, time_interleaved
from dpcourse.bench.workload import (adamw, adamw_options, autocast_dtype, gpt_config,
                                     make_step)
from dpcourse.device import rank_device

SHARDED_VARIANTS = ("torch_ddp", "zero1", "zero2", "fsdp", "torch_fsdp", "torch_fsdp_tuned")


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t  # a DTensor's shard on this rank


def _bytes(tensors) -> int:
    return sum(_local(t).numel() * _local(t).element_size() for t in tensors if t is not None)


def build_variant(variant: str, cfg, device: torch.device, *, bucket_cap_mb: float = 25.0,
                  group=None, from_meta: bool = False):
    """Build one variant; return ``(model, optimizer, autocast_dtype_or_None, params)``.

    ``params`` are the tensors whose ``.grad`` holds this rank's gradient after backward.
    ``from_meta`` (``fsdp`` only): build the GPT on the meta device and let FSDP
    materialise it unit by unit, so that no rank ever holds the whole model. Rank 0
    initialises each unit with :meth:`GPT.init_fn` (the same distributions as the
    constructor, other numbers than ``GPT(cfg, seed=0)``).
    """
    from dpcourse.models import GPT

    if from_meta and variant != "fsdp":
        raise ValueError(f"from_meta=True builds only the 'fsdp' variant, not {variant!r}: "
                         "the others hold the whole model on every rank anyway.")
    wrapped: nn.Module
    if from_meta:
        from dpcourse.fsdp import FullyShardedDataParallel

        with torch.device("meta"):
            model = GPT(cfg, seed=None)  # shapes only: nothing is drawn or allocated
        gpus = [device.index if device.index is not None else 0] if device.type == "cuda" else []
        with torch.random.fork_rng(devices=gpus):  # seeded, the caller's random state untouched
            torch.manual_seed(0)
            wrapped = FullyShardedDataParallel(model, compute_dtype=autocast_dtype(device),
                                               group=group, param_init_fn=model.init_fn(),
                                               device=device)
        return wrapped, adamw(wrapped.parameters(), device), None, list(wrapped.parameters())
    with torch.device(device):  # initialise on the GPU: large models build in seconds
        model = GPT(cfg, seed=0)
    amp = autocast_dtype(device)
    if variant == "torch_ddp":
        from torch.nn.parallel import DistributedDataParallel

        ids = [device.index] if device.type == "cuda" else None
        wrapped = DistributedDataParallel(model, device_ids=ids, bucket_cap_mb=bucket_cap_mb,
                                          gradient_as_bucket_view=True, process_group=group)
        return wrapped, adamw(model.parameters(), device), amp, list(model.parameters())
    if variant in ("zero1", "zero2"):
        from dpcourse.ddp import DataParallelOverlapped
        from dpcourse.zero import ShardedOptimizer

        wrapped = (DataParallelOverlapped(model, bucket_cap_mb=bucket_cap_mb, group=group)
                   if variant == "zero1" else model)
        opt = ShardedOptimizer(model.parameters(), torch.optim.AdamW, group=group,
                               gradients="averaged" if variant == "zero1" else "sharded",
                               bucket_cap_mb=bucket_cap_mb, **adamw_options(device))
        return wrapped, opt, amp, list(model.parameters())
    low = autocast_dtype(device)  # FSDP's compute dtype instead of autocast
    if variant == "fsdp":
        from dpcourse.fsdp import FullyShardedDataParallel

        wrapped = FullyShardedDataParallel(model, compute_dtype=low, group=group)
        return wrapped, adamw(wrapped.parameters(), device), None, list(wrapped.parameters())
    if variant == "torch_fsdp":
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        mp = MixedPrecisionPolicy(param_dtype=low, reduce_dtype=low)
        for block in model.blocks:
            fully_shard(block, mp_policy=mp)
        fully_shard(model, mp_policy=mp)
        return model, adamw(model.parameters(), device), None, list(model.parameters())
    if variant == "torch_fsdp_tuned":
        return tuned_fully_shard(model, low), adamw(model.parameters(), device), None, \
            list(model.parameters())
    raise ValueError(f"unknown variant {variant!r}: choose from {SHARDED_VARIANTS}.")


def tuned_fully_shard(model, param_dtype: torch.dtype | None):
    """Apply torch's ``fully_shard`` to a GPT as torchtitan configures it; return the model.

    Each block is its own group and resharded after forward except the last (backward
    needs it at once); the root (embeddings, final norm, the tied head) is not resharded
    after forward; each block's forward prefetches the next block's all-gather and its
    backward the previous one's; weights in ``param_dtype``, gradients reduced in fp32
    (torchtitan's default ``mixed_precision_reduce``).
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    blocks = list(model.blocks)
    for i, block in enumerate(blocks):
        fully_shard(block, mp_policy=mp, reshard_after_forward=i < len(blocks) - 1)
    fully_shard(model, mp_policy=mp, reshard_after_forward=False)
    for before, after in zip(blocks, blocks[1:]):
        before.set_modules_to_forward_prefetch([after])
        after.set_modules_to_backward_prefetch([before])
    return model


def count_parameters(cfg) -> int:
    """Parameters of ``GPT(cfg)`` (a tied weight once), counted on the meta device."""
    from dpcourse.models import GPT

    with torch.device("meta"):
        return GPT(cfg, seed=None).num_parameters()


def state_bytes(opt) -> int:
    """Bytes of tensors in this rank's optimizer state (DTensors: the local shard)."""
    inner = getattr(opt, "optim", opt)
    return _bytes(v for s in inner.state.values() for v in s.values()
                  if isinstance(v, torch.Tensor))


def measure_memory(variant: str, cfg, device, idx, targets, *, steps: int = 3,
                   group=None) -> dict:
    """Peak and held memory of one variant alone, and its counted state and gradient bytes."""
    from dpcourse.zero.memory import gradient_bytes

    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
    model, opt, amp, params = build_variant(variant, cfg, device, group=group)
    step = make_step(model, opt, idx, targets, amp)
    for _ in range(steps - 1):
        step()
    with torch.autocast(device.type, dtype=amp or torch.float32, enabled=amp is not None):
        loss = model(idx, targets)[1]  # the logits are not kept
    loss.backward()
    del loss
    if hasattr(model, "finish_gradient_synchronization"):
        model.finish_gradient_synchronization()
    grads = _bytes(p.grad for p in params) + (gradient_bytes([], opt))
    opt.step()
    sync()
    row = {"variant": variant, "state_bytes": state_bytes(opt), "grad_bytes": grads,
           "param_bytes_local": _bytes(params)}
    if device.type == "cuda":
        row["peak_bytes"] = torch.cuda.max_memory_allocated(device) - base
        row["held_bytes"] = torch.cuda.memory_allocated(device) - base
    opt.zero_grad()
    del model, opt, step, params
    return row


def sharded_step_times(variants=SHARDED_VARIANTS, *, config: str = "auto", batch_size: int = 8,
                       warmup: int = 3, iters: int = 10, group=None) -> list[dict]:
    """Time and measure every variant on GPT; call on every rank (e.g. through dpcourse.run).

    Args:
        variants: names from :data:`SHARDED_VARIANTS`.
        config: ``"gpt2_small"``, ``"tiny"`` or ``"auto"`` (GPT-2 small on GPU, tiny on CPU).
        batch_size: sequences per rank.
        warmup: untimed steps per variant.
        iters: timed, interleaved steps per variant.
        group: process group (``None``: the default group).

    Returns:
        One row per variant: ``median_s`` and the other :func:`~dpcourse.bench.timing.summarize`
        fields, ``vs_torch_fsdp`` / ``vs_torch_ddp`` ratios of medians, ``peak_bytes`` and
        ``held_bytes`` (GPU), ``state_bytes``, ``grad_bytes``, and the setup.
    """
    from dpcourse.models import random_tokens

    device = rank_device(group)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    cfg_name, cfg = gpt_config(config, device)
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    idx, targets = (t.to(device) for t in random_tokens(batch_size, cfg, seed=rank))
    memory = {v: measure_memory(v, cfg, device, idx, targets, group=group) for v in variants}
    steps, keep = {}, []
    for v in variants:
        model, opt, amp, _ = build_variant(v, cfg, device, group=group)
        steps[v] = make_step(model, opt, idx, targets, amp)
        keep.append((model, opt))
    times = time_interleaved(steps, warmup=warmup, iters=iters, group=group, device=device)
    n_params = count_parameters(cfg)
    rows = []
    for v in variants:
        row = {"variant": v, "world_size": world, "backend": dist.get_backend(group),
               "device": device_name(device), "config": cfg_name, "batch_size": batch_size,
               "seq_len": cfg.block_size, "params": n_params}
        row.update(summarize(times[v]))
        row.update({k: val for k, val in memory[v].items() if k != "variant"})
        rows.append(row)
    by = {r["variant"]: r["median_s"] for r in rows}
    for r in rows:
        for ref in ("torch_ddp", "torch_fsdp", "torch_fsdp_tuned"):
            r[f"vs_{ref}"] = r["median_s"] / by[ref] if ref in by else None
    del steps, keep
    return rows
