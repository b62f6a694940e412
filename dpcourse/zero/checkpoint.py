"""Checkpoint a ShardedOptimizer: gather the state shards into one dict, and cut it again to resume.

Each rank holds the optimizer state of only its chunk of every parameter
(:mod:`dpcourse.zero.layout`). A checkpoint is written as ONE consolidated
state dict, in the format of a plain ``optimizer_cls`` over the same
parameters and groups: ``{"state": {index: {"exp_avg": full-shaped tensor,
"step": ...}}, "param_groups": [...]}``, where ``index`` counts the parameters
of ``param_groups`` in order, frozen ones included (as torch numbers them).
Because it holds whole tensors, the checkpoint does not depend on the number of
ranks: it resumes on any world size, and a single-process optimizer can load it.

Consolidating is a collective (every rank sends its chunks to one rank, as
torch's ``ZeroRedundancyOptimizer.consolidate_state_dict(to)`` does); loading is
local (every rank reads the full dict and keeps its own chunks). To checkpoint::

    opt.consolidate_state_dict(to=0)          # every rank
    if dist.get_rank() == 0:
        torch.save({"model": model.state_dict(), "optim": opt.state_dict()}, path)

and to resume, on every rank::

    opt.load_state_dict(torch.load(path)["optim"])

The functions here take the :class:`~dpcourse.zero.optimizer.ShardedOptimizer`
as ``opt``; its methods of those names call them.
"""

from __future__ import annotations

import copy
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from dpcourse.comm.sharding import shard_range


class Consolidated(NamedTuple):
    """The full state dict on the rank it was gathered on, and the step count it is from."""

    state_dict: dict[str, Any]
    steps: int


def consolidate_on(opt, to: int) -> Consolidated | None:
    """Gather every rank's state shard on rank ``to`` of ``opt``'s group (a collective).

    Args:
        opt: the ShardedOptimizer; every rank of its group must call this.
        to: rank of the group that receives the state.

    Returns:
        The consolidated state on rank ``to``, ``None`` on the other ranks.
    """
    if not 0 <= to < opt.world_size:
        raise ValueError(f"to must be a rank of the group (0..{opt.world_size - 1}), "
                         f"got {to!r}.")
    per_rank = gather_state(opt, to)
    return None if per_rank is None else Consolidated(consolidate(opt, per_rank), opt._steps)


def consolidated(opt, held: Consolidated | None) -> dict[str, Any]:
    """Return the state dict ``held`` by this rank, refusing a missing or outdated one.

    Args:
        opt: the ShardedOptimizer (for its rank and its current step count).
        held: what :func:`consolidate_on` returned on this rank, if it was called.
    """
    if held is None:
        raise RuntimeError(
            f"rank {opt.rank} holds no consolidated optimizer state: call "
            "consolidate_state_dict(to=r) on every rank first, then state_dict() on rank r.")
    if held.steps != opt._steps:
        raise RuntimeError(
            f"the consolidated state is {opt._steps - held.steps} step(s) old: call "
            "consolidate_state_dict() on every rank again before state_dict().")
    return held.state_dict


def _to_cpu(state: dict) -> dict:
    """Copy every tensor of an inner state to the CPU (a pickled tensor keeps its device)."""
    return {i: {k: v.detach().cpu() if isinstance(v, torch.Tensor) else v for k, v in s.items()}
            for i, s in state.items()}


def gather_state(opt, to: int) -> list[dict] | None:
    """Send every rank's inner state (by position in ``opt._params``) to rank ``to`` of the group.

    A collective. Returns the list of per-rank states on rank ``to``, ``None`` elsewhere.
    """
    inner = opt.optim
    pos = {id(s): k for k, s in enumerate(opt.shards)}
    mine = _to_cpu({pos[id(s)]: st for s, st in inner.state.items() if id(s) in pos})
    dst = to if opt.process_group is None else dist.get_global_rank(opt.process_group, to)
    out: list | None = [None] * opt.world_size if opt.rank == to else None
    dist.gather_object(mine, out, dst=dst, group=opt.process_group)
    return out


def _join_chunks(param: torch.Tensor, key: str, chunks: list, world_size: int):
    """Rebuild one state entry of ``param`` from every rank's value (chunks, or a scalar)."""
    first = chunks[0]
    if not isinstance(first, torch.Tensor) or first.dim() == 0:
        return first  # replicated (e.g. Adam's step count): every rank holds the same value
    sizes = [hi - lo for lo, hi in (shard_range(param.numel(), world_size, r)
                                    for r in range(world_size))]
    if [c.dim() for c in chunks] != [1] * world_size or [c.numel() for c in chunks] != sizes:
        raise ValueError(f"cannot consolidate optimizer state {key!r} of a parameter of shape "
                         f"{tuple(param.shape)}: it is neither a scalar nor shaped like the "
                         "parameter (ShardedOptimizer needs an element-wise optimizer).")
    return torch.cat(chunks).view(param.shape)


def consolidate(opt, per_rank: list[dict]) -> dict[str, Any]:
    """Return the full state dict (plain-optimizer format) from every rank's inner state."""
    from torch.optim import Optimizer

    # The outer groups hold the current hyperparameters (a scheduler writes there).
    sd = Optimizer.state_dict(opt)  # param_groups with indices; the outer state is empty
    index: dict[int, int] = {}
    k = 0
    for g in opt.param_groups:
        for p in g["params"]:
            index.setdefault(id(p), k)
            k += 1
    state = {}
    for j, p in enumerate(opt._params):
        if j not in per_rank[0]:
            continue  # never stepped (no gradient yet): a plain optimizer has no state either
        keys = per_rank[0][j].keys()
        state[index[id(p)]] = {key: _join_chunks(p, key, [r[j][key] for r in per_rank],
                                                 opt.world_size) for key in keys}
    sd["state"] = dict(sorted(state.items()))
    return sd


def load_state(opt, state_dict: dict[str, Any]) -> None:
    """Load a consolidated state dict: check it, keep this rank's chunk of every state tensor."""
    from torch.optim import Optimizer

    groups = state_dict["param_groups"]
    # The outer load checks group and parameter counts and takes the hyperparameters.
    Optimizer.load_state_dict(opt, {"state": {}, "param_groups": groups})
    trainable = {id(p) for p in opt._params}
    inner_state, inner_groups, k_inner = {}, [], 0
    for g, saved in zip(opt.param_groups, groups):
        ids = []
        for p, i in zip(g["params"], saved["params"]):
            if id(p) not in trainable:
                continue
            if i in state_dict["state"]:
                inner_state[k_inner] = _cut(p, i, state_dict["state"][i], opt.world_size,
                                            opt.rank)
            ids.append(k_inner)
            k_inner += 1
        inner_groups.append({**{k: v for k, v in g.items() if k != "params"}, "params": ids})
    opt.optim.load_state_dict({"state": inner_state, "param_groups": inner_groups})


def _cut(param, index: int, entry: dict, world_size: int, rank: int) -> dict:
    """This rank's chunk of every full-shaped state tensor of ``param``; scalars as they are."""
    lo, hi = shard_range(param.numel(), world_size, rank)
    out = {}
    for key, v in entry.items():
        if isinstance(v, torch.Tensor) and v.dim() > 0:
            if v.numel() != param.numel():
                raise ValueError(f"state {key!r} of parameter {index} has {v.numel()} elements, "
                                 f"the parameter {param.numel()}: load a state dict saved from "
                                 "the same model and parameter groups.")
            out[key] = v.reshape(-1)[lo:hi].clone()
        else:
            out[key] = copy.deepcopy(v)
    return out
