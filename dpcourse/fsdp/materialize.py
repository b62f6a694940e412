"""Materialise a model built on the meta device one FSDP unit at a time.

``with torch.device("meta"): model = GPT(cfg)`` records every shape and dtype
and allocates nothing. :class:`~dpcourse.fsdp.FullyShardedDataParallel` then
builds the weights unit by unit: allocate the unit's flat vector (its
parameters become views into it), initialise them, send each rank its shard,
free the flat vector, go on to the next unit. No rank ever holds more than the
root unit, one other unit and its shards, where building the model first and
sharding it afterwards needs the whole model on every rank.

Who initialises: rank 0, and ``scatter`` sends each rank its shard. The
alternative, every rank initialising the unit from the same seeded generator,
sends nothing but asks every rank to hold the whole unit, to keep its
generator in step with rank 0's (a learner who seeds ``seed + rank`` for
dropout breaks it silently) and to draw the same numbers on every device. With
rank 0 alone the weights are rank 0's, as every wrapper of this course already
broadcasts them, and the other ranks hold only shards. The cost is one
scatter per unit, (N-1)/N of the unit's bytes: less than one training step moves.

The initialisation contract: ``param_init_fn(module)`` is called, on rank 0,
once for every module that directly owns parameters or buffers, in
``model.modules()`` order; it must initialise that module's OWN parameters and
buffers (those of its children get their own call). The default calls
``module.reset_parameters()``, which every torch layer defines. A weight
shared by several modules (tied) is initialised at its first module; later
ones initialise a throwaway tensor of the same shape, as they did when the
tie was made after construction. Hence: rank 0's weights equal those of the
same model built normally when that construction draws its random numbers
only through ``reset_parameters()``, module by module in registration order,
from the same generator state (e.g. ``torch.manual_seed(s)`` before each).
A model whose constructor re-initialises afterwards (GPT-2's normal(0, 0.02))
needs a ``param_init_fn`` that does the same, and then gets the same
distribution, not the same numbers.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from dpcourse.comm.sharding import chunk_size


def reset_parameters(module: nn.Module) -> None:
    """Default ``param_init_fn``: the module's own ``reset_parameters()``."""
    module.reset_parameters()  # type: ignore[operator]


def _own(module: nn.Module) -> list[torch.Tensor]:
    return [t for t in (*module._parameters.values(), *module._buffers.values()) if t is not None]


def built_on_meta(module: nn.Module, param_init_fn) -> bool:
    """Whether ``module`` waits to be materialised; raise if it cannot be.

    Returns:
        True when every parameter and buffer is on the meta device, False when none is.
    """
    names = [n for n, _ in module.named_parameters()] + [n for n, _ in module.named_buffers()]
    meta = [t.is_meta for t in (*module.parameters(), *module.buffers())]
    if not any(meta):
        return False
    if not all(meta):
        real = [n for n, m in zip(names, meta) if not m][:3]
        raise ValueError(f"the module is partly on the meta device ({real} are not): build all "
                         "of it under torch.device('meta'), or none of it.")
    if param_init_fn is None:
        bad = [f"{n or '<root>'} ({type(m).__name__})" for n, m in module.named_modules()
               if _own(m) and not callable(getattr(m, "reset_parameters", None))]
        if bad:
            raise ValueError(
                f"cannot initialise {', '.join(bad[:3])} built on the meta device: it has "
                "parameters or buffers but no reset_parameters(). Pass param_init_fn= (called "
                "with each module, it must initialise the module's own parameters and "
                "buffers), or build that module on a real device.")
    return True


class Materializer:
    """Build the shards of every flat of every unit from a meta module (see the module docstring).

    Args:
        module: the model, every parameter and buffer on the meta device.
        unit_modules: ``[None, unit 1, ...]`` (``None``: the root unit).
        flats: ``flats[k]``: for unit ``k``, a list of ``[original parameters]``, one per flat.
        sites: ``sites[id(p)]``: where ``p`` is registered.
        device: where the weights are built.
        param_init_fn: called with each module that owns parameters or buffers (rank 0 only).
        group, world_size, rank: the process group.
    """

    def __init__(self, module, unit_modules, flats, sites, device, param_init_fn, group,
                 world_size: int, rank: int):
        self.module, self.units, self.flats, self.sites = module, unit_modules, flats, sites
        self.device, self.init_fn = device, param_init_fn or reset_parameters
        self.group, self.world_size, self.rank = group, world_size, rank
        self.src = 0 if group is None else dist.get_global_rank(group, 0)
        self.names = {id(p): n for n, p in module.named_parameters()}
        self.shards: dict[tuple[int, int], torch.Tensor] = {}
        # A tied weight's later sites (sites are listed in module order): (id(module), attr).
        self._later_sites = {(id(x.module), x.attr) for ss in sites.values() for x in ss[1:]}
        self._done: set[int] = set()        # modules already initialised
        self._root_modules: list[nn.Module] = []
        self._error: str | None = None      # rank 0's first failure, told to every rank

    def run(self) -> dict[tuple[int, int], torch.Tensor]:
        """Materialise every unit (the root last); return ``{(unit, flat): shard}``."""
        self._materialize_buffers()
        unit_of = {id(m): k for k, m in enumerate(self.units) if m is not None}
        full_root = self._allocate(0)  # root modules come first and last in module order
        self._walk(self.module, unit_of)
        self._finish(0, full_root)
        return self.shards

    def _walk(self, m: nn.Module, unit_of: dict[int, int]) -> None:
        k = unit_of.get(id(m))
        if k is not None:
            full = self._allocate(k)
            for sub in m.modules():
                self._init(sub)
            self._finish(k, full)
            return
        self._root_modules.append(m)
        self._init(m)
        for child in m.children():
            self._walk(child, unit_of)

    def _materialize_buffers(self) -> None:
        """Buffers are not sharded: every rank gets them (rank 0's values, broadcast later)."""
        for m in self.module.modules():
            for name, b in m._buffers.items():
                if b is not None:
                    m._buffers[name] = self._blank(b)

    def _blank(self, like: torch.Tensor) -> torch.Tensor:
        # NaN, so that a parameter or buffer param_init_fn forgot is caught, not trained.
        t = torch.empty_like(like, device=self.device)
        if self.rank == 0 and t.is_floating_point():
            t.fill_(float("nan"))
        return t

    def _allocate(self, k: int) -> list[torch.Tensor | None]:
        """Rank 0: one flat vector per flat of unit ``k``; its parameters become views into it."""
        if self.rank != 0:
            return [None] * len(self.flats[k])
        out: list[torch.Tensor | None] = []
        for params in self.flats[k]:
            n = sum(p.numel() for p in params)
            flat = torch.full((self.world_size * chunk_size(n, self.world_size),), float("nan"),
                              dtype=params[0].dtype, device=self.device)
            flat[n:].zero_()  # the padding, as when a built model is sharded
            for p, part in zip(params, flat[:n].split([q.numel() for q in params])):
                view = nn.Parameter(part.view(p.shape), requires_grad=p.requires_grad)
                for s in self.sites[id(p)]:
                    s.module._parameters[s.attr] = view
            out.append(flat)
        return out

    def _init(self, m: nn.Module) -> None:
        if self.rank != 0 or id(m) in self._done or not _own(m) or self._error:
            return
        self._done.add(id(m))
        saved = {}
        for attr, p in m._parameters.items():
            if p is None:
                continue
            if (id(m), attr) in self._later_sites:  # tied: initialised at its first module
                saved[attr] = p
                m._parameters[attr] = nn.Parameter(torch.empty_like(p), p.requires_grad)
        try:
            with torch.no_grad():
                self.init_fn(m)
        except Exception as exc:  # every rank must hear of it, or they wait in the scatter
            self._error = (f"param_init_fn failed on {type(m).__name__}: "
                           f"{type(exc).__name__}: {exc}")
        finally:
            m._parameters.update(saved)

    def _finish(self, k: int, full: list[torch.Tensor | None]) -> None:
        """Check rank 0's initialisation, scatter the shards, drop the full flat vectors."""
        msg = [self._error or self._unfilled(k) if self.rank == 0 else None]
        dist.broadcast_object_list(msg, src=self.src, group=self.group, device=self.device)
        if msg[0] is not None:
            raise RuntimeError(msg[0] if self.rank == 0 else f"rank 0: {msg[0]}")
        for j, params in enumerate(self.flats[k]):
            n = sum(p.numel() for p in params)
            shard = torch.empty(chunk_size(n, self.world_size), dtype=params[0].dtype,
                                device=self.device)
            self._scatter(shard, full[j])
            self.shards[(k, j)] = shard
            for p in params:  # the module lets go of the views: the unit's memory goes
                for s in self.sites[id(p)]:
                    s.module._parameters[s.attr] = p
        full.clear()

    def _scatter(self, shard: torch.Tensor, flat: torch.Tensor | None) -> None:
        """Rank 0 sends chunk ``r`` of ``flat`` to rank ``r``; every rank receives its own.

        Point to point rather than ``dist.scatter``: gloo's scatter first copies the
        whole list into one buffer, a second full unit on rank 0.
        """
        if flat is None:  # not rank 0
            dist.recv(shard, src=self.src, group=self.group)
            return
        chunks = flat.split(shard.numel())
        works = [dist.isend(chunks[r], dst=self._global(r), group=self.group)
                 for r in range(1, self.world_size)]
        shard.copy_(chunks[0])
        for w in works:
            if w is not None:
                w.wait()

    def _global(self, r: int) -> int:
        return r if self.group is None else dist.get_global_rank(self.group, r)

    def _unfilled(self, k: int) -> str | None:
        """Name the first parameter or buffer of unit ``k`` that still holds NaN."""
        for params in self.flats[k]:
            for p in params:
                view = self.sites[id(p)][0]
                t = view.module._parameters[view.attr]
                if torch.isnan(t).any():
                    return (f"param_init_fn left parameter {self.names[id(p)]!r} uninitialised "
                            "(it still holds the NaN it was allocated with): initialise every "
                            "parameter of the module it is called with.")
        mods = self._root_modules if k == 0 else list(self.units[k].modules())
        for m in mods:
            for name, b in m._buffers.items():
                if b is not None and b.is_floating_point() and torch.isnan(b).any():
                    return (f"param_init_fn left buffer {name!r} of {type(m).__name__} "
                            "uninitialised: initialise the module's buffers too (or register "
                            "them with real values after materialising).")
        return None
