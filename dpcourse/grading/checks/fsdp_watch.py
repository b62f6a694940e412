"""The rank's side of exercise 14: the check's model, and the learner's hooks trained and watched.

:func:`train` builds the model, cuts every unit into
:class:`~dpcourse.fsdp.flat_params.FlatParams`, hands each unit to the learner's
``UnitHooks`` and trains the shards. :class:`Watch` registers the rank's own
hooks after the learner's: they note which flats hold memory, and what each
unit computes with, when its forward starts and ends and when its backward
starts, and they stop a step with a message before torch would read freed
memory (which would crash the rank). Nothing here knows an expected value.
"""

from __future__ import annotations

from collections import OrderedDict

import torch
from torch import nn

from dpcourse.grading.checks.base import begin

IN, OUT, BATCH, STEPS = 4, 3, 4, 3
UNITS = ("inp", "mid", "out")
RUNS = (("sgd", {"lr": 0.05, "momentum": 0.9}), ("adamw", {"lr": 1e-2, "weight_decay": 0.1}))
TOL = (0.0, 3e-5)  # the bound tests/test_14_fsdp.py holds lesson 14's FSDP to (fp32)


def make_model(seed: int) -> nn.Sequential:
    """Return the check's model built from ``seed``; ``mid.0.weight`` is frozen (and not ones)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = nn.Sequential(OrderedDict(
            inp=nn.Sequential(nn.Linear(IN, 7), nn.Tanh()),
            mid=nn.Sequential(nn.LayerNorm(7), nn.Linear(7, 6), nn.Tanh()),
            out=nn.Linear(6, OUT)))
        with torch.no_grad():
            model.mid[0].weight.uniform_(0.5, 1.5)
    model.mid[0].weight.requires_grad_(False)
    return model


def layout() -> list[list[tuple[list[str], list, bool]]]:
    """Per unit, its flats as ``(parameter names, shapes, trainable)``: trainable first."""
    model, out = make_model(0), []
    for u in UNITS:
        named = list(getattr(model, u).named_parameters())
        out.append([([f"{u}.{n}" for n, p in named if p.requires_grad == k],
                     [tuple(p.shape) for _, p in named if p.requires_grad == k], k)
                    for k in (True, False) if any(p.requires_grad == k for _, p in named)])
    return out


class _Stop(Exception):
    """Raised by the rank's own hooks to end a step before torch reads freed memory."""


def _readable(t) -> bool:
    if not isinstance(t, torch.Tensor):
        return False
    if t.numel() == 0:
        return True
    last = t.storage_offset() + sum((n - 1) * s for n, s in zip(t.shape, t.stride()))
    return t.untyped_storage().nbytes() >= (last + 1) * t.element_size()


class Watch:
    """The rank's own hooks on every unit; each notes what it sees and stops before a crash."""

    def __init__(self, model, flats: dict):
        self.model, self.flats, self.log = model, flats, []
        self.stopped, self.criterion = "", ""
        for k, u in enumerate(UNITS):
            unit = getattr(model, u)
            unit.register_forward_pre_hook(lambda m, a, k=k: self._forward_start(k))
            unit.register_forward_hook(lambda m, a, out, k=k: self._forward_end(k, out))

    def allocated(self) -> list[list[bool]]:
        return [[f.is_unsharded for f in self.flats[u]] for u in UNITS]

    def _weights(self, k: int, moment: str) -> list:
        """The tensors unit ``k`` computes with; stop if one holds no memory."""
        unit, out = getattr(self.model, UNITS[k]), []
        for f in self.flats[UNITS[k]]:
            for name, shape in zip(f.names, f.shapes):
                owner, _, attr = name.rpartition(".")
                t = getattr(unit.get_submodule(owner), attr, None)
                if not _readable(t) or tuple(t.shape) != tuple(shape):
                    what = ("holds no memory (freed)" if isinstance(t, torch.Tensor) and
                            tuple(t.shape) == tuple(shape) else
                            f"is {tuple(t.shape) if isinstance(t, torch.Tensor) else t!r}, not a "
                            f"view of shape {tuple(shape)}")
                    self.stop(f"when unit '{UNITS[k]}' started its {moment}, "
                              f"{UNITS[k]}.{name} {what}", f"gathers_before_{moment}")
                same = f.is_unsharded and t.untyped_storage().data_ptr() == \
                    f.full.untyped_storage().data_ptr()
                out.append({"value": t.detach().clone(), "view_of_full": bool(same)})
        return out

    def stop(self, why: str, criterion: str) -> None:
        if not self.stopped:
            self.stopped, self.criterion = why, criterion
        raise _Stop(why)

    def _forward_start(self, k: int) -> None:
        self.log.append({"at": "forward_start", "unit": k, "allocated": self.allocated(),
                         "weights": self._weights(k, "forward")})

    def _forward_end(self, k: int, output) -> None:
        self.log.append({"at": "forward_end", "unit": k, "allocated": self.allocated()})
        if isinstance(output, torch.Tensor) and output.requires_grad:
            output.register_hook(lambda grad, k=k: self._backward_start(k))

    def _backward_start(self, k: int) -> None:
        self.log.append({"at": "backward_start", "unit": k, "allocated": self.allocated(),
                         "weights": self._weights(k, "backward")})

    def unpack(self, t):
        """Autograd is about to use a tensor it saved in forward: stop if its memory is gone."""
        if not _readable(t):
            self.stop("backward needed a weight saved in forward whose memory was freed (it was "
                      "not gathered again into the same buffer before its unit's backward)",
                      "gathers_before_backward")
        return t


def train(link, cls, inputs: dict, run: int) -> dict:
    """Train run ``run`` of :data:`RUNS` with the learner's ``cls`` on every unit; return what was seen."""
    name, kwargs = RUNS[run]
    ws, rank = link.world_size, link.rank
    model = make_model(inputs["seed"])
    from dpcourse.fsdp.flat_params import FlatParams

    begin(link, f"{name}: construction")
    flats = {u: FlatParams.of_unit(getattr(model, u), ws, rank) for u in UNITS}
    hooks = [cls(getattr(model, u), flats[u]) for u in UNITS]
    watch = Watch(model, flats)
    shards = [f for u in UNITS for f in flats[u]]
    trainable = [f.shard for f in shards if f.requires_grad]
    opt = (torch.optim.SGD if name == "sgd" else torch.optim.AdamW)(trainable, **kwargs)
    out = {"steps": [], "stopped": "", "stopped_criterion": "", "hooks": len(hooks)}
    for step, (x, y) in enumerate(inputs["batches"]):
        watch.log = []
        rec = {"log": watch.log}
        out["steps"].append(rec)
        try:
            begin(link, f"{name}, step {step}: forward")
            with torch.autograd.graph.saved_tensors_hooks(lambda t: t, watch.unpack):
                loss = nn.functional.mse_loss(model(x), y)
            begin(link, f"{name}, step {step}: backward")
            loss.backward()
        except Exception:  # noqa: BLE001 - ours (to avoid a crash) or the learner's
            if not watch.stopped:
                raise
            out["stopped"], out["stopped_criterion"] = watch.stopped, watch.criterion
            break
        begin(link, f"{name}, step {step}: optimizer step")
        rec["after_backward"] = watch.allocated()
        for f in shards:  # the loop's end of backward: frozen flats are freed here
            f.reshard()
        if any(f.shard.grad is not None and not _readable(f.shard.grad) for f in shards):
            out["stopped"] = "a shard's .grad holds no memory (a view of a buffer that was freed)"
            out["stopped_criterion"] = "reduce_scatters_gradients"
            break
        rec["grads"] = [None if f.shard.grad is None else f.shard.grad.detach().clone()
                        for f in shards]
        opt.step()
        opt.zero_grad(set_to_none=step % 2 == 0)
        rec["shards"] = [f.shard.detach().clone() for f in shards]
    return out
