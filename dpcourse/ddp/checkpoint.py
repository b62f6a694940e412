"""Save and resume a data-parallel run exactly: model, optimizer, schedule, RNG of every rank.

A resumed run is only the same run if everything that decides the next step
comes back: the parameters, the optimizer's state (AdamW's moments, step
counts), the learning-rate schedule, the sampler's epoch (it seeds the
shuffle), and the random number generators of **every** rank (dropout masks
and augmentations differ per rank, so rank 0's state alone is not enough).

The ``module.`` trap: ``DistributedDataParallel.state_dict()`` (and a
wrapper's) prefixes every key with ``module.``, so a checkpoint saved from the
wrapper does not load into the bare model. Here the bare model's state is
saved, and a prefixed state is accepted on loading.
"""

from __future__ import annotations

import os
import random

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.modules.utils import consume_prefix_in_state_dict_if_present

try:
    import numpy as np
except ImportError:  # numpy is optional for this module
    np = None  # type: ignore[assignment]


def unwrap(model: nn.Module) -> nn.Module:
    """Return the bare model inside a data-parallel wrapper (ours or torch's), else ``model``."""
    while hasattr(model, "module") and isinstance(model.module, nn.Module):
        model = model.module
    return model


def strip_module_prefix(state_dict: dict) -> dict:
    """Return a copy of ``state_dict`` without the ``module.`` prefix a wrapper adds to keys."""
    state = dict(state_dict)
    consume_prefix_in_state_dict_if_present(state, "module.")
    return state


def rng_state() -> dict:
    """This process's random generators: Python, NumPy (if present), torch CPU and CUDA."""
    state = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if np is not None:
        state["numpy"] = np.random.get_state()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    """Restore generators saved by :func:`rng_state`."""
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if np is not None and "numpy" in state:
        np.random.set_state(state["numpy"])
    if "cuda" in state:
        torch.cuda.set_rng_state_all(state["cuda"])


def save_checkpoint(path, model, optimizer, scheduler=None, sampler=None, *, step: int = 0,
                    extra: dict | None = None, group=None) -> None:
    """Write the full training state (call on every rank; rank 0 writes the file).

    Args:
        path: file to write (replaced atomically: a crash never leaves half a checkpoint).
        model: the wrapped or bare model (saved without the ``module.`` prefix).
        optimizer: its optimizer (identical on every rank under data parallelism).
        scheduler: an optional learning-rate scheduler.
        sampler: an optional sampler with ``epoch`` (e.g. :class:`dpcourse.data.ShardedSampler`).
        step: the number of optimizer steps taken so far.
        extra: anything else to keep (picklable).
        group: process group (``None``: the default group).
    """
    world = dist.get_world_size(group)
    rngs = [None] * world
    dist.all_gather_object(rngs, rng_state(), group=group)  # every rank's generators
    if dist.get_rank(group) == 0:
        state = {"model": unwrap(model).state_dict(), "optimizer": optimizer.state_dict(),
                 "scheduler": None if scheduler is None else scheduler.state_dict(),
                 "sampler_epoch": None if sampler is None else sampler.epoch,
                 "rng": rngs, "world_size": world, "step": int(step), "extra": extra}
        tmp = f"{path}.tmp"
        torch.save(state, tmp)
        os.replace(tmp, path)
    dist.barrier(group=group)  # nobody reads the file before it is complete


def load_checkpoint(path, model, optimizer=None, scheduler=None, sampler=None,
                    group=None) -> dict:
    """Restore what :func:`save_checkpoint` wrote, this rank's generators included.

    Only load checkpoints you trust: they hold pickled Python objects.

    Args:
        path: the checkpoint file.
        model: the wrapped or bare model; keys with or without ``module.`` load.
        optimizer, scheduler, sampler: restored when given.
        group: process group (``None``: the default group).

    Returns:
        The checkpoint dictionary (``step``, ``extra``, ...).
    """
    ckpt = torch.load(path, map_location="cpu", weights_only=False)
    world = dist.get_world_size(group)
    if ckpt["world_size"] != world:
        raise ValueError(
            f"{path} was saved by {ckpt['world_size']} ranks and is loaded by {world}: the "
            "per-rank random generators and the data shards would not line up. Resume with "
            f"world_size={ckpt['world_size']}, or load only the model with "
            "unwrap(model).load_state_dict(torch.load(path)['model']).")
    unwrap(model).load_state_dict(strip_module_prefix(ckpt["model"]))
    if optimizer is not None:
        optimizer.load_state_dict(ckpt["optimizer"])
    if scheduler is not None and ckpt["scheduler"] is not None:
        scheduler.load_state_dict(ckpt["scheduler"])
    if sampler is not None and ckpt["sampler_epoch"] is not None:
        sampler.set_epoch(ckpt["sampler_epoch"])
    set_rng_state(ckpt["rng"][dist.get_rank(group)])
    return ckpt
