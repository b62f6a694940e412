"""Exercise 14: the hooks of one FSDP unit (gather, free, gather again, reduce-scatter, free).

The learner writes ``UnitHooks(unit, flats, group=None)``. The rank builds a
three-unit model (``mid`` holds a frozen LayerNorm weight, so it has a trainable
and a frozen flat; flats of 35, 55 + 7 and 21 elements), hands each unit to
``UnitHooks`` and trains the shards for 3 steps with SGD (momentum) and with AdamW;
once backward returns, the loop frees what is still gathered (frozen flats). The
rank's own hooks (:class:`Watch`), registered after the learner's, note which flats
hold memory and what each unit computes with at its forward start and end and its
backward start, and stop a step before torch would read freed memory. The verdicts,
against one process on the whole batch and the collectives FSDP issues, are
:mod:`~dpcourse.grading.checks.fsdp_verdicts`.
"""

from __future__ import annotations

from collections import OrderedDict

import torch
from torch import nn

from dpcourse.grading.checks.base import Exercise, begin, clone_all
from dpcourse.grading.checks.random_inputs import regression_batches, torch_generator
from dpcourse.grading.criteria import Criterion, no_deadlock, no_delegation, tolerance
from dpcourse.grading.shim import COLLECTIVES, SHARDED, SHARDED_WHY

IN, OUT, BATCH, STEPS = 4, 3, 4, 3
UNITS = ("inp", "mid", "out")
RUNS = (("sgd", {"lr": 0.05, "momentum": 0.9}), ("adamw", {"lr": 1e-2, "weight_decay": 0.1}))
TOL = (0.0, 3e-5)  # the bound tests/test_14_fsdp.py holds lesson 14's FSDP to (fp32)
CRASH_HINT = ("A rank crashed inside torch: something read or wrote a tensor whose memory had "
              "been freed. A flat's buffer may be freed only after the last use of its weights, "
              "and must be allocated and gathered again before anything reads it.")


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


def make_optimizer(run: int, params) -> torch.optim.Optimizer:
    """Run ``run``'s optimizer (:data:`RUNS`) over ``params``."""
    name, kwargs = RUNS[run]
    return (torch.optim.SGD if name == "sgd" else torch.optim.AdamW)(params, **kwargs)


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


def train_watched(link, cls, inputs: dict, run: int) -> dict:
    """Train run ``run`` of :data:`RUNS` with the learner's ``cls`` on every unit, watched."""
    name = RUNS[run][0]
    ws, rank = link.world_size, link.rank
    model = make_model(inputs["seed"])
    from dpcourse.fsdp.flat_params import FlatParams

    begin(link, f"{name}: construction")
    flats = {u: FlatParams.of_unit(getattr(model, u), ws, rank) for u in UNITS}
    hooks = [cls(getattr(model, u), flats[u]) for u in UNITS]
    watch = Watch(model, flats)
    shards = [f for u in UNITS for f in flats[u]]
    trainable = [f.shard for f in shards if f.requires_grad]
    opt = make_optimizer(run, trainable)
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
        rec["grads"] = clone_all(f.shard.grad for f in shards)
        opt.step()
        opt.zero_grad(set_to_none=step % 2 == 0)
        rec["shards"] = clone_all(f.shard for f in shards)
    return out


class FSDPHooks(Exercise):
    """``UnitHooks(unit, flats, group=None)``: one FSDP unit's gather, free and reduce-scatter."""

    name, exercise, title = "fsdp_hooks", "14", "The hooks of an FSDP unit"
    defines = (("main", "UnitHooks"),)
    world_sizes = (2, 3)
    dist_api, dist_why = SHARDED + COLLECTIVES, SHARDED_WHY
    allowed_imports = {"dpcourse.fsdp.flat_params": {"FlatParams", "gathered"}}
    timeout = 60.0
    criteria = (
        Criterion("gathers_before_forward", "when a unit's forward starts, every parameter of "
                  "it is a view into its flat's gathered buffer and holds the full weight",
                  "When the unit's forward started, its weights were not the full weights, or "
                  "not views into its flats' full buffers. Before a unit computes, each of its "
                  "flats is gathered from every rank's shard into the buffer that alloc_unsharded "
                  "hands out, and the module is pointed at views of it: through gathered for a "
                  "trainable flat (autograd's only path back to the shard), at the full buffer "
                  "itself for a frozen one. A copy instead of a view keeps memory that freeing "
                  "does not release."),
        Criterion("frees_after_forward", "when a unit's forward ends, none of its flats holds "
                  "memory", "A unit still held gathered weights after its forward had ended. "
                  "Its forward no longer needs them and its backward gathers them again: "
                  "keeping them adds up every unit's full weights over the forward.",
                  needs=("gathers_before_forward",)),
        Criterion("gathers_before_backward", "when a unit's backward starts, its flats are "
                  "gathered again, into the same buffers autograd saved views of",
                  "A unit's backward started with its weights freed, or gathered into a buffer "
                  "autograd never saw. The backward needs the weights the forward used, and "
                  "autograd saved views of each flat's full buffer: those same buffers must be "
                  "gathered again by a hook that runs when the unit's output gradient is known, "
                  "one registered on the output while the unit's forward ends.", weight=2),
        Criterion("frees_after_backward", "once a unit's gradient is reduce-scattered its "
                  "trainable flats hold no memory (checked when the next unit's backward "
                  "starts, and when backward returns)",
                  "A unit's trainable weights were still gathered after its gradient had been "
                  "reduce-scattered. Its backward is over at that moment; keeping them means "
                  "holding every unit's full weights by the end of backward.",
                  needs=("gathers_before_backward",)),
        Criterion("reduce_scatters_gradients", "at optimizer.step(), each trainable shard's "
                  ".grad is this rank's chunk of the gradient averaged over the ranks; frozen "
                  "shards have none",
                  "The shard's gradient was not this rank's chunk of the gradient averaged over "
                  "the ranks. The gradient hook receives this rank's own gradient of the whole "
                  "flat, and a reduce-scatter leaves each rank the sum of its chunk over all "
                  "ranks. A ratio equal to the world size means the sum was never divided; no "
                  "gradient at all means nothing was stored on the shard.", weight=2),
        Criterion("collectives_as_fsdp", "each step issues exactly: forward, one all-gather "
                  "per flat, unit by unit; backward, in reverse unit order, the unit's "
                  "all-gathers again, then one reduce-scatter per trainable flat; sizes N x "
                  "chunk", "The collectives differ from FSDP's. An all-reduce of the gradient "
                  "leaves every rank the whole gradient, which sharding exists to avoid, and "
                  "moves twice the bytes of a reduce-scatter; an extra or missing gather shows "
                  "a hook that runs too often, or never.",
                  weight=2, needs=("gathers_before_forward",)),
        Criterion("matches_single_process", "after each of 3 steps (SGD with momentum, and "
                  "AdamW), the parameters assembled from the ranks' shards equal one process "
                  "training on the whole batch (the frozen weight unchanged)",
                  "Check the other criteria first: each names one part of the step.", weight=2),
        no_delegation("matches_single_process"), no_deadlock("matches_single_process"),
    )
    notes = (f"model: units inp (35 elements), mid (55 trainable + 7 frozen), out (21); world "
             f"sizes 2 and 3; parameters compared with one process to atol={TOL[1]:g}, "
             f"gradients to (rtol, atol) {tolerance('gloo', torch.float32, 'vs_single')}; fresh "
             "random seeds and batches on each run",)
    error_hints = ((("SIGSEGV",), CRASH_HINT), (("SIGBUS",), CRASH_HINT),
                   (("has no memory",), "A collective touched a buffer that held no memory: it "
                    "was not allocated before the gather, or it was freed before the collective "
                    "had finished."),
                   (("not available to graded code",), SHARDED_WHY))

    def make_inputs(self, rng, world_size):
        seed, gen = rng.getrandbits(31), torch_generator(rng)
        return [{"seed": seed, "batches": regression_batches(gen, STEPS, BATCH, IN, OUT)}
                for _ in range(world_size)]

    @staticmethod
    def rank_run(link, learner, inputs):
        return [train_watched(link, learner["main"], inputs, run)
                for run in range(len(RUNS))]

    verdicts = "dpcourse.grading.checks.fsdp_verdicts"
