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

The file is a one-line header (a format tag, the payload's length and its SHA-256)
followed by what ``torch.save`` wrote. A file that was cut short, overwritten or
is no checkpoint at all is refused with a :class:`CheckpointError` naming the file
and the damage, never loaded with silently wrong tensors.
"""

from __future__ import annotations

import hashlib
import io
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


MAGIC = b"DPCOURSE-CHECKPOINT 1"


class CheckpointError(RuntimeError):
    """A checkpoint file that cannot be used: missing, cut short, changed, or not a checkpoint."""


def write_checkpoint_file(path, state: dict) -> None:
    """Write ``state`` to ``path`` with its checksum, atomically.

    The bytes are written to ``path + ".tmp"`` and renamed over ``path`` only when
    complete, so a crash never leaves half a checkpoint under the real name; if
    writing fails the temporary file is removed and the error raised.
    """
    buffer = io.BytesIO()
    torch.save(state, buffer)  # a pickling error happens here, before any file exists
    payload = buffer.getbuffer()
    header = MAGIC + b" %d %s\n" % (len(payload), hashlib.sha256(payload).hexdigest().encode())
    tmp = f"{path}.tmp"
    try:
        with open(tmp, "wb") as f:
            f.write(header)
            f.write(payload)
            f.flush()
            os.fsync(f.fileno())  # on disk before the rename makes it the checkpoint
        os.replace(tmp, path)
    except BaseException:
        try:
            os.remove(tmp)
        except OSError:
            pass
        raise


def read_checkpoint_file(path) -> dict:
    """Return the state in a file written by :func:`write_checkpoint_file`, after checking it.

    Only read checkpoints you trust: they hold pickled Python objects.

    Raises:
        CheckpointError: the file is missing, is not a dpcourse checkpoint, was cut
            short, or its bytes no longer match the checksum recorded when it was saved.
    """
    try:
        with open(path, "rb") as f:
            header, payload = f.readline(), f.read()
    except FileNotFoundError:
        hint = (f" {path}.tmp exists: a save was interrupted before it finished, so that file "
                "is incomplete and was never made the checkpoint."
                if os.path.exists(f"{path}.tmp") else "")
        raise CheckpointError(f"no checkpoint at {path}.{hint} Check the path, or start the run "
                              "from scratch.") from None
    parts = header.split()
    if header[:len(MAGIC)] != MAGIC or len(parts) != 4 or not parts[2].isdigit():
        raise CheckpointError(
            f"{path} is not a checkpoint written by save_checkpoint (its first bytes are "
            f"{header[:24]!r}). A file written by torch.save is read with torch.load; a "
            "damaged checkpoint cannot be repaired: resume from an earlier one.")
    size, digest = int(parts[2]), parts[3].decode(errors="replace")
    if len(payload) != size:
        raise CheckpointError(
            f"{path} is damaged: {len(payload)} of its {size} bytes are there (cut short by an "
            "interrupted copy or a full disk, or extended). Resume from an earlier checkpoint.")
    actual = hashlib.sha256(payload).hexdigest()
    if actual != digest:
        raise CheckpointError(
            f"{path} is damaged: its bytes no longer match the SHA-256 checksum recorded when "
            f"it was saved (recorded {digest[:16]}..., now {actual[:16]}...), so some tensors or "
            "settings changed after saving (a disk error, a bad copy, an edit). Loading it "
            "would train from wrong values: resume from an earlier checkpoint.")
    try:
        return torch.load(io.BytesIO(payload), map_location="cpu", weights_only=False)
    except Exception as exc:  # intact bytes, but not readable by this torch (version?)
        raise CheckpointError(
            f"{path} is intact (its checksum matches) but torch.load cannot read it: "
            f"{type(exc).__name__}: {exc}. Load it with the torch version that saved it.") from exc


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
        path: file to write (replaced atomically: a crash never leaves half a checkpoint;
            see :func:`write_checkpoint_file`, which also records a checksum).
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
        write_checkpoint_file(path, state)
    dist.barrier(group=group)  # nobody reads the file before it is complete


def load_checkpoint(path, model, optimizer=None, scheduler=None, sampler=None,
                    group=None) -> dict:
    """Restore what :func:`save_checkpoint` wrote, this rank's generators included.

    Only load checkpoints you trust: they hold pickled Python objects.

    Args:
        path: the checkpoint file (checked first: see :func:`read_checkpoint_file`).
        model: the wrapped or bare model; keys with or without ``module.`` load.
        optimizer, scheduler, sampler: restored when given.
        group: process group (``None``: the default group).

    Returns:
        The checkpoint dictionary (``step``, ``extra``, ...).

    Raises:
        CheckpointError: the file is missing or damaged (the message says how).
    """
    ckpt = read_checkpoint_file(path)
    world = dist.get_world_size(group)
    if ckpt["world_size"] != world:
        raise ValueError(
            f"{path} was saved by {ckpt['world_size']} ranks and is loaded by {world}: the "
            "per-rank random generators and the data shards would not line up. Resume with "
            f"world_size={ckpt['world_size']}, or load only the model with "
            "unwrap(model).load_state_dict(read_checkpoint_file(path)['model']).")
    unwrap(model).load_state_dict(strip_module_prefix(ckpt["model"]))
    if optimizer is not None:
        optimizer.load_state_dict(ckpt["optimizer"])
    if scheduler is not None and ckpt["scheduler"] is not None:
        scheduler.load_state_dict(ckpt["scheduler"])
    if sampler is not None and ckpt["sampler_epoch"] is not None:
        sampler.set_epoch(ckpt["sampler_epoch"])
    set_rng_state(ckpt["rng"][dist.get_rank(group)])
    return ckpt
