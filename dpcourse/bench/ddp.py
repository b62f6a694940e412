"""Data-parallel step times: the course's wrappers against torch DDP, on every rank.

Each variant trains its own copy of the same GPT (same seed, so the same
weights) with its own optimizer; their steps are timed interleaved, so a
slow moment of the machine hits every variant alike. ``"local"`` is the
same step with no communication at all: the compute floor.
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist

from dpcourse.bench.records import StepRow
from dpcourse.bench.sharded import build_variant, measure_memory
from dpcourse.bench.timing import device_name, summarize, time_interleaved
from dpcourse.bench.workload import adamw, gpt_config, make_step
from dpcourse.device import rank_device

VARIANTS = ("local", "naive", "bucketed", "overlapped", "torch_ddp")
# Also accepted (not in the default list): sharded data parallelism, see dpcourse.bench.sharded.
SHARDED = ("zero1", "zero2", "fsdp", "torch_fsdp", "torch_fsdp_tuned")
# Our wrapper with the NVLink kernels (GPUs joined by NVLink only): on the backward pass's
# stream, and on a communication stream beside it (dpcourse.comm.OnCommStream).
KERNEL_VARIANTS = ("overlapped_one_shot", "overlapped_two_shot", "overlapped_one_shot_comm_stream",
                   "overlapped_two_shot_comm_stream")
# Two-shot's grid beside a backward pass: fewer blocks leave SMs to the backward kernels. GPT-2
# small on 2 x H200, step time with 16, 32, 48, 64 blocks each below 128's in the same run, and
# 48's level with dist.all_reduce's (docs/benchmarks.md, "... on a communication stream").
COMM_STREAM_TWO_SHOT_BLOCKS = 48


def kernel_variant(variant: str) -> tuple[str, int | None] | None:
    """Split a kernel variant's name into the variant and its grid cap; ``None`` if not one.

    ``"overlapped_two_shot_comm_stream"`` -> ``("overlapped_two_shot_comm_stream", None)``;
    ``"overlapped_two_shot_comm_stream_32_blocks"`` -> ``(..., 32)``: the same variant with
    the kernel capped at 32 blocks, so that one run can compare several caps, interleaved.
    """
    base, blocks = variant, None
    parts = variant.rsplit("_", 2)
    if len(parts) == 3 and parts[2] == "blocks" and parts[1].isdigit() and int(parts[1]) > 0:
        base, blocks = parts[0], int(parts[1])
    return (base, blocks) if base in KERNEL_VARIANTS else None


def _wrap(variant: str, model, device, bucket_cap_mb: float, group, torch_ddp_kwargs):
    from dpcourse import ddp

    if variant == "local":
        return model
    if variant == "naive":
        return ddp.DataParallelNaive(model, group=group)
    if variant == "bucketed":
        return ddp.DataParallelBucketed(model, bucket_cap_mb=bucket_cap_mb, group=group)
    if variant == "overlapped":
        return ddp.DataParallelOverlapped(model, bucket_cap_mb=bucket_cap_mb, group=group)
    split = kernel_variant(variant)
    if split is not None:  # our NVLink kernels plugged in through all_reduce= (GPU)
        from dpcourse.comm import OnCommStream, kernels

        base, blocks = split
        kernel = base.split("_")[1]  # one or two
        fn = getattr(kernels, f"{kernel}_shot_all_reduce")
        if blocks is None and kernel == "two" and base.endswith("_comm_stream"):
            blocks = COMM_STREAM_TWO_SHOT_BLOCKS
        if blocks is not None:
            fn = functools.partial(fn, max_blocks=blocks)
        if base.endswith("_comm_stream"):
            fn = OnCommStream(fn)
        return ddp.DataParallelOverlapped(model, bucket_cap_mb=bucket_cap_mb, group=group,
                                          all_reduce=fn)
    if variant == "torch_ddp":
        from torch.nn.parallel import DistributedDataParallel

        ids = [device.index] if device.type == "cuda" else None
        # torch reads a cap of 0 as "unset"; a tiny cap gives it one bucket per parameter too.
        return DistributedDataParallel(model, device_ids=ids, bucket_cap_mb=bucket_cap_mb or 1e-9,
                                       process_group=group, **(torch_ddp_kwargs or {}))
    raise ValueError(f"unknown variant {variant!r}: choose from "
                     f"{VARIANTS + SHARDED + KERNEL_VARIANTS} (a kernel variant may end in "
                     "_<N>_blocks, e.g. overlapped_two_shot_comm_stream_32_blocks).")


def _n_buckets(wrapped):
    buckets = getattr(wrapped, "buckets", None)
    return len(buckets) if buckets is not None else None


def _compare(variants, *, config, batch_size, bucket_cap_mb, warmup, iters, group,
             torch_ddp_kwargs, amp) -> list[StepRow]:
    """Build every variant, time their steps interleaved, return one row per variant."""
    from dpcourse.models import GPT, random_tokens

    device = rank_device(group)
    cfg_name, cfg = gpt_config(config, device)
    if batch_size is None:
        batch_size = 8
    amp_dtype = {"auto": torch.bfloat16 if device.type == "cuda" else None,
                 "bf16": torch.bfloat16, "none": None}[amp]
    rank, world_size = dist.get_rank(group), dist.get_world_size(group)
    idx, targets = (t.to(device) for t in random_tokens(batch_size, cfg, seed=rank))
    steps, wrapped_models, n_params = {}, {}, 0
    for variant in variants:
        if variant in SHARDED:  # ZeRO and FSDP build their own optimizer
            wrapped, opt, own_amp, _ = build_variant(variant, cfg, device,
                                                     bucket_cap_mb=bucket_cap_mb, group=group)
            amp_v = amp_dtype if variant in ("zero1", "zero2") else own_amp
            steps[variant] = make_step(wrapped, opt, idx, targets, amp_v)
            wrapped_models[variant] = wrapped
            continue
        model = GPT(cfg, seed=0).to(device)
        n_params = sum(p.numel() for p in model.parameters())
        wrapped = _wrap(variant, model, device, bucket_cap_mb, group, torch_ddp_kwargs)
        opt = adamw(model.parameters(), device)
        steps[variant] = make_step(wrapped, opt, idx, targets, amp_dtype)
        wrapped_models[variant] = wrapped
    times = time_interleaved(steps, warmup=warmup, iters=iters, group=group, device=device)
    n_buckets = {v: _n_buckets(w) for v, w in wrapped_models.items()}
    del steps, wrapped_models  # memory is measured with each variant alone
    peaks = _peak_memory(variants, cfg, device, idx, targets, group)
    rows = []
    for variant in variants:
        timing = summarize(times[variant])
        rows.append(StepRow(
            **timing, variant=variant, bucket_cap_mb=bucket_cap_mb,
            n_buckets=n_buckets[variant], world_size=world_size,
            backend=dist.get_backend(group), device=device_name(device), config=cfg_name,
            params=n_params, batch_size=batch_size, seq_len=cfg.block_size,
            amp=str(amp_dtype).replace("torch.", ""),
            tokens_per_s=world_size * batch_size * cfg.block_size / timing.median_s,
            peak_bytes_per_rank=peaks.get(variant)))
    _add_ratios(rows)
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return rows


def _peak_memory(variants, cfg, device, idx, targets, group) -> dict[str, list[int]]:
    """On GPUs: each rank's peak memory of every variant that :mod:`.sharded` builds, run alone."""
    if device.type != "cuda":
        return {}
    out = {}
    for v in [v for v in variants if v in ("torch_ddp",) + SHARDED]:
        mine = measure_memory(v, cfg, device, idx, targets, group=group)["peak_bytes"]
        per_rank: list = [None] * dist.get_world_size(group)
        dist.all_gather_object(per_rank, mine, group=group)
        out[v] = per_rank
    return out


def _add_ratios(rows: list[StepRow]) -> None:
    """Give each row its step time relative to torch DDP and to no communication (same run)."""
    by = {r.variant: r.median_s for r in rows}
    for r in rows:
        r.vs_torch_ddp = r.median_s / by["torch_ddp"] if "torch_ddp" in by else None
        # Efficiency: the fraction of the step that is not waiting on communication.
        r.efficiency = by["local"] / r.median_s if "local" in by else None


def ddp_step_times(variants=VARIANTS, *, config: str = "auto", batch_size: int | None = None,
                   bucket_cap_mb: float = 25.0, warmup: int = 3, iters: int = 10, group=None,
                   amp: str = "auto", torch_ddp_kwargs: dict | None = None) -> list[StepRow]:
    """Time one training step (forward, backward, AdamW step) per variant; call on every rank.

    Args:
        variants: names from ``("local", "naive", "bucketed", "overlapped", "torch_ddp")``,
            and on GPUs joined by NVLink :data:`KERNEL_VARIANTS` (each also with a grid cap:
            ``"overlapped_two_shot_comm_stream_32_blocks"``, see :func:`kernel_variant`).
        config: ``"gpt2_small"`` (~124M parameters), ``"tiny"``, or ``"auto"`` (GPT-2 small
            on GPU, tiny on CPU).
        batch_size: sequences per rank per step (default 8; sequence length is the config's).
        bucket_cap_mb: bucket size for the bucketed, overlapped and torch DDP variants.
        warmup: untimed steps per variant.
        iters: timed steps per variant.
        group: the process group; ``None`` means the default group.
        amp: ``"auto"`` (bf16 autocast on GPU, none on CPU), ``"bf16"`` or ``"none"``.
        torch_ddp_kwargs: extra arguments for torch's ``DistributedDataParallel``.

    Returns:
        One :class:`~dpcourse.bench.records.StepRow` per variant, identical on every rank: ``variant``, ``median_s``,
        ``min_s``, ``max_s``, ``p25_s``, ``p75_s``, ``trials``, ``vs_torch_ddp``
        (median / torch DDP's median), ``efficiency`` (local median / median),
        ``tokens_per_s``, ``n_buckets`` and the setup (model, batch, device, backend).
    """
    if amp not in ("auto", "bf16", "none"):
        raise ValueError(f"amp must be 'auto', 'bf16' or 'none', got {amp!r}.")
    return _compare(list(variants), config=config, batch_size=batch_size,
                    bucket_cap_mb=bucket_cap_mb, warmup=warmup, iters=iters, group=group,
                    torch_ddp_kwargs=torch_ddp_kwargs, amp=amp)


def ddp_bucket_sweep(bucket_caps=(0, 1, 5, 25, 100),
                     variants=("bucketed", "overlapped", "torch_ddp"), **kwargs) -> list[dict]:
    """Time the bucketed variants at several ``bucket_cap_mb`` values; call on every rank.

    Each cap is one interleaved comparison of ``variants`` (ratios within it).

    Args:
        bucket_caps: bucket sizes in MiB (0: one bucket per parameter).
        variants: variant names (see :func:`ddp_step_times`).
        **kwargs: passed to :func:`ddp_step_times` (config, batch_size, warmup, iters, ...).

    Returns:
        The rows of every comparison, each with its ``bucket_cap_mb``.
    """
    rows = []
    for cap in bucket_caps:
        rows += ddp_step_times(variants, bucket_cap_mb=cap, **kwargs)
    return rows


def ddp_benchmark(variants=VARIANTS, sweep_caps=(0, 1, 5, 25, 100), *,
                  bucket_cap_mb: float = 25.0, **kwargs) -> tuple[list[dict], list[dict]]:
    """Run :func:`ddp_step_times`, then :func:`ddp_bucket_sweep`, in one launch; call on every rank.

    Args:
        variants: variants of the main comparison.
        sweep_caps: bucket sizes for the sweep (empty: no sweep).
        bucket_cap_mb: bucket size of the main comparison.
        **kwargs: passed to both (config, batch_size, warmup, iters, amp, ...).

    Returns:
        ``(rows, sweep_rows)``.
    """
    rows = ddp_step_times(variants, bucket_cap_mb=bucket_cap_mb, **kwargs)
    sweep_variants = [v for v in ("bucketed", "overlapped", "torch_ddp") if v in variants]
    sweep = []
    if sweep_caps and sweep_variants:
        sweep = ddp_bucket_sweep(sweep_caps, sweep_variants, **kwargs)
    return rows, sweep
