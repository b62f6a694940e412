"""FullyShardedDataParallel: ZeRO stage 3, every rank keeps 1/N of the parameters.

The model is cut into *units* (by default each block of every ``nn.ModuleList``,
e.g. a GPT's transformer blocks; the rest of the model is the root unit). Each
unit's parameters are flattened and sharded (:class:`~dpcourse.fsdp.flat_params.FlatParams`);
a unit's full weights exist only while it computes (:mod:`dpcourse.fsdp.unit`).
Per step every rank moves, per parameter byte: one all-gather in forward, one
in backward and one reduce-scatter of the gradient, 3 x (N-1)/N, against an
all-reduce's 2 x (N-1)/N: 1.5x the bytes of DDP, for 1/N of the memory of
parameters, gradients and optimizer state.

Mixed precision (``compute_dtype=torch.bfloat16``): the fp32 shards stay the
master weights that the optimizer steps in fp32; they are cast to
``compute_dtype`` before the all-gather (half the bytes), the model computes in
``compute_dtype`` (floating inputs are cast, as torch's ``fully_shard`` does),
and gradients are reduced in ``reduce_dtype`` (default ``compute_dtype``, as
torch's ``MixedPrecisionPolicy``) and accumulated into fp32 shard gradients.

Reference: torch's ``fully_shard`` (FSDP2) and Zhao et al., "PyTorch FSDP" (2023).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from dpcourse.ddp.broadcast import broadcast_module_state
from dpcourse.ddp.guards import check_same_model
from dpcourse.ddp.rounds import BucketRound
from dpcourse.device import rank_device
from dpcourse.fsdp.flat_params import FlatParams, sites_by_param
from dpcourse.fsdp.materialize import Materializer, built_on_meta
from dpcourse.fsdp.unit import FSDPUnit

LOW_PRECISION = (torch.bfloat16, torch.float16)


def default_units(module: nn.Module) -> list[nn.Module]:
    """Every child of every ``nn.ModuleList``; if there are none, every direct child with parameters."""
    units = [child for m in module.modules() if isinstance(m, nn.ModuleList) for child in m]
    if not units:
        units = [c for c in module.children() if any(True for _ in c.parameters())]
    return units


def _check(module, compute_dtype, units) -> None:
    if not isinstance(module, nn.Module):
        raise TypeError(f"expected a torch.nn.Module to wrap, got {type(module).__name__}.")
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("FullyShardedDataParallel needs a process group: run this code "
                           "inside dpcourse.run(fn), or call init_process_group first.")
    if compute_dtype is not None and compute_dtype not in LOW_PRECISION + (torch.float32,):
        raise ValueError(f"compute_dtype must be None, torch.float32, torch.bfloat16 or "
                         f"torch.float16, got {compute_dtype!r}.")
    if any(u is module for u in units):
        raise ValueError("units= must be submodules of the module, not the module itself "
                         "(the module is always the root unit).")


class FullyShardedDataParallel(nn.Module):
    """Shard a module's parameters, gradients and optimizer state across ranks (ZeRO-3).

    Args:
        module: the model, on this rank's device; rank 0's weights are used everywhere.
            Or built under ``torch.device("meta")``: then it is materialised unit by
            unit on ``device`` and initialised by ``param_init_fn`` on rank 0, so that
            no rank ever holds the whole model (:mod:`dpcourse.fsdp.materialize`).
        compute_dtype: ``None`` (compute in the parameters' dtype), ``torch.bfloat16`` or
            ``torch.float16``: gather and compute in it, keep fp32 master shards.
        reduce_dtype: dtype of the gradient reduce-scatter (default: ``compute_dtype``).
        units: submodules gathered one at a time (default :func:`default_units`).
        prefetch: start the next unit's all-gather while the current one computes.
        group: process group (``None``: the default group).
        param_init_fn: for a meta module: called on rank 0 with each submodule that owns
            parameters or buffers, it initialises that submodule's own ones (default:
            ``module.reset_parameters()``).
        device: for a meta module: where to build it (default: this rank's GPU under
            NCCL, else the CPU).

    Attributes:
        module: the wrapped model (its parameters are views while a unit computes).
        units: :class:`~dpcourse.fsdp.unit.FSDPUnit` list; ``units[0]`` is the root.
        shards: the local shards; ``parameters()`` yields exactly these.
    """

    def __init__(self, module: nn.Module, *, compute_dtype: torch.dtype | None = None,
                 reduce_dtype: torch.dtype | None = None, units=None, prefetch: bool = True,
                 group=None, param_init_fn=None, device: torch.device | str | None = None):
        super().__init__()
        unit_modules = default_units(module) if units is None else list(units)
        _check(module, compute_dtype, unit_modules)
        self.module, self.group, self.prefetch = module, group, prefetch
        self.world_size, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.compute_dtype = compute_dtype
        self.reduce_dtype = reduce_dtype or compute_dtype
        # Before any collective that depends on the shapes: ranks with different models
        # would otherwise hang, crash in the backend, or shard a (4, 2) weight like a (2, 4).
        check_same_model(module, group, rank_device(group))
        meta = built_on_meta(module, param_init_fn)
        if not meta and (param_init_fn is not None or device is not None):
            raise ValueError("param_init_fn= and device= are for a module built under "
                             "torch.device('meta'); this one already has its weights.")
        if not meta:
            broadcast_module_state(module, group)
        self._names = {id(p): n for n, p in module.named_parameters()}
        self.units: list[FSDPUnit] = []
        self._build_units(module, unit_modules, meta and (
            param_init_fn, torch.device(device) if device else rank_device(group)))
        if meta:
            broadcast_module_state(module, group)  # the buffers: rank 0 initialised them
        self.shards = nn.ParameterList([f.shard for u in self.units for f in u.flats])
        self._order: list[FSDPUnit] = []   # non-root units in this forward's order
        # Lesson 06's round: each unit starts its reduce-scatter once autograd has its whole
        # gradient (FSDPUnit.reduce_gradient); the round finishes them, all at the end.
        self._round = BucketRound([], None, on_backward_end=self.finish_gradient_synchronization,
                                  finish=self._finish_reduce)

    def _build_units(self, module: nn.Module, unit_modules: list[nn.Module], meta) -> None:
        """Cut every unit's parameters into flat shards (``meta``: ``(param_init_fn, device)``)."""
        owner_of: dict[int, int] = {}  # module id -> unit position (1-based; 0 is the root)
        for k, unit_module in enumerate(unit_modules, start=1):
            for m in unit_module.modules():
                if owner_of.setdefault(id(m), k) != k:
                    raise ValueError("units= must not overlap (a module inside two units).")
        sites = sites_by_param(module)
        params = {id(p): p for p in module.parameters()}
        groups: dict[tuple[int, bool], list[int]] = {}
        for pid in params:  # registration order
            owners = {owner_of.get(id(s.module), 0) for s in sites[pid]}
            # A weight tied across units (or used by the root) lives in the root unit,
            # which stays gathered for the whole forward and backward.
            unit = owners.pop() if len(owners) == 1 else 0
            groups.setdefault((unit, params[pid].requires_grad), []).append(pid)
        self._names_by_flat: dict[int, list[str]] = {}
        modules: list[nn.Module | None] = [None, *unit_modules]
        # Trainable and frozen parameters never share a flat.
        specs = [[groups[(k, rg)] for rg in (True, False) if (k, rg) in groups]
                 for k in range(len(modules))]
        shards = {}
        if meta:
            shards = Materializer(module, modules, [[[params[i] for i in ids] for ids in spec]
                                                    for spec in specs], sites, meta[1], meta[0],
                                  self.group, self.world_size, self.rank).run()
        for k, um in enumerate(modules):
            flats = []
            for j, ids in enumerate(specs[k]):
                flats.append(FlatParams([params[i] for i in ids], [sites[i] for i in ids],
                                        self.world_size, self.rank, group=self.group,
                                        compute_dtype=self.compute_dtype,
                                        shard=shards.get((k, j))))
                self._names_by_flat[id(flats[-1])] = [self._names[i] for i in ids]
            self.units.append(FSDPUnit(um, flats, self, k))

    # -- called by the units ---------------------------------------------------------
    def _cast_inputs(self, args):
        if self.compute_dtype not in LOW_PRECISION:
            return args
        return tuple(a.to(self.compute_dtype) if isinstance(a, torch.Tensor)
                     and a.is_floating_point() else a for a in args)

    def _prefetch_after(self, unit: FSDPUnit, backward: bool) -> None:
        if not self.prefetch:
            return
        if not backward:
            self._order.append(unit)
            nxt = self.units.index(unit) + 1  # forward: assume registration order
            if nxt < len(self.units):
                self.units[nxt].unshard()
            return
        pos = self._order.index(unit) if unit in self._order else 0
        if pos > 0:  # backward runs the units in reverse forward order
            self._order[pos - 1].unshard()

    # -- public API --------------------------------------------------------------------
    def forward(self, *args, **kwargs):
        """Gather the root unit, run the module, and arrange the backward hooks."""
        root = self.units[0]
        self._order = []
        for u in self.units:
            u.forwarded = False
        root.wait_for_unshard()
        root.to_unsharded()
        if self.prefetch and len(self.units) > 1:
            self.units[1].unshard()
        out = self.module(*self._cast_inputs(args), **kwargs)
        if not torch.is_grad_enabled():
            root.reshard()
            return out
        for t in _tensors(out):
            if t.requires_grad:
                t.register_hook(self._root_pre_backward)
        return out

    def _root_pre_backward(self, grad):
        self._round.start()  # finish_gradient_synchronization once backward is done
        if self.prefetch and self._order:
            self._order[-1].unshard()  # the last unit's backward comes first
        return grad

    @torch.no_grad()
    def finish_gradient_synchronization(self) -> None:
        """Wait for the gradient reduce-scatters; add them into the shards' fp32 ``.grad``.

        Runs automatically at the end of each ``loss.backward()``; calling it again
        does nothing. Also frees every gathered weight.
        """
        self._round.finish()  # every reduce-scatter still in flight, oldest first
        for u in self.units:
            u.reshard()

    @torch.no_grad()
    def _finish_reduce(self, flat, handle) -> None:
        """Wait for one flat's reduce-scatter; add the result into its shard's gradient."""
        work, out, _grad, divide_after = handle
        work.wait()  # on GPU: the current stream waits for the collective
        if divide_after:
            out.div_(self.world_size)
        if flat.shard.grad is None:
            flat.shard.grad = out.to(flat.shard.dtype)
        else:
            flat.shard.grad.add_(out)

    @torch.no_grad()
    def gather_full_params(self) -> dict[str, torch.Tensor]:
        """Return every parameter, full and in its master dtype, by ``module.named_parameters()`` name.

        A collective: every rank must call it. A tied weight appears once, under its first name.
        """
        out: dict[str, torch.Tensor] = {}
        for u in self.units:
            for f in u.flats:
                out.update(zip(self._names_by_flat[id(f)], f.full_tensors()))
        return {n: out[n] for n in sorted(out, key=list(self._names.values()).index)}


def _tensors(out):
    from torch.utils._pytree import tree_flatten

    return [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
