"""What the data-parallel checks (03, 05, 06, 07) share: the model, the training run, the verdicts.

Every rank builds the check's small MLP from its *own* fresh seed (so a missing
start-up broadcast shows), trains it for a few SGD steps on its shard of fresh
random batches, and returns its gradients and parameters after each step.
The grader computes what DDP computes, and what one process on the whole batch
computes (:func:`dpcourse.grading.oracles.train_one_process`), and compares.
The overlap checks (06) judge one step's all-reduces with :func:`overlap_records`.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from dpcourse.grading.checks.base import (CaseVerdict, Exercise, begin, clone_all, compare,
                                          events_of)
from dpcourse.grading.checks.random_inputs import regression_batches, torch_generator
from dpcourse.grading.criteria import Criterion, first_mismatch, tolerance
from dpcourse.grading.shim import COLLECTIVES, P2P

IN, HIDDEN, MID, OUT = 8, 16, 12, 4
BATCH = 4     # samples per rank and micro-batch
STEPS = 3
LR = 0.05
MIB = 2**20


def sgd(params) -> torch.optim.Optimizer:
    """The checks' optimizer: plain SGD at :data:`LR`."""
    return torch.optim.SGD(params, lr=LR)


C_BROADCAST = Criterion(
    "initial_broadcast", "after construction every rank holds rank 0's parameters",
    "The replicas differ right after construction: each rank built its model from its own "
    "random seed, and nothing made the other ranks' values equal to rank 0's.")
C_AVERAGED = Criterion(
    "grads_averaged", "after backward + sync, param.grad equals DDP's gradient (the mean over "
    "ranks)", "The gradient is off by the ratio in the message. A ratio equal to the world size "
    "means every rank's contribution was summed but not averaged; a ratio of 1 / N, that a mean "
    "was taken twice.", weight=2)
C_DDP = Criterion(
    "matches_torch_ddp", "parameters after each of 3 SGD steps equal what torch DDP computes",
    "Check the other criteria first: a missing broadcast or a wrong average both show up here.",
    weight=3)
C_SINGLE = Criterion(
    "matches_single_process", "parameters after 3 steps equal one process training on the whole "
    "global batch", "With equal shards, one process on the whole batch takes exactly DDP's "
    "steps, so a drift from it means the ranks' gradients were not combined into their mean "
    "before the update.", weight=2)
LATER_STEP = "the earlier steps' gradients were right"


def make_model(seed: int) -> nn.Sequential:
    """Return the check's MLP (six parameters of distinct sizes) built from ``seed``."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(IN, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, MID), nn.ReLU(),
                         nn.Linear(MID, OUT))


def param_bytes() -> list[int]:
    return [p.numel() * p.element_size() for p in make_model(0).parameters()]


def make_inputs(rng, world_size: int, accumulation: int, runs: list[dict]) -> list[dict]:
    """Fresh seeds and batches; rank r gets only its own seed and shard."""
    seeds = [rng.getrandbits(31) for _ in range(world_size)]
    gen = torch_generator(rng)
    batches = [[regression_batches(gen, accumulation, BATCH, IN, OUT) for _ in range(world_size)]
               for _ in range(STEPS)]
    return [{"seed": seeds[r], "runs": runs, "batches": [batches[s][r] for s in range(STEPS)]}
            for r in range(world_size)]


def default_step(model, optimizer, micro_batches, loss_fn) -> None:
    """Accumulate over the micro-batches (all but the last inside ``no_sync``), then step."""
    optimizer.zero_grad(set_to_none=True)
    k = len(micro_batches)
    with model.no_sync() if k > 1 else contextlib.nullcontext():
        for x, y in micro_batches[:-1]:
            (loss_fn(model(x), y) / k).backward()
    x, y = micro_batches[-1]
    (loss_fn(model(x), y) / k).backward()
    finish = getattr(model, "finish_gradient_synchronization", None)
    if callable(finish):
        finish()
    optimizer.step()


def _instrument(link, first_layer: nn.Module, wrapped) -> None:
    """Mark when backward reaches the first layer, when finish runs, and no_sync's window."""
    def on_grad(grad):
        link.mark("first_layer_backward")  # returns None: the gradient is left unchanged

    def mark(module, inputs, output):
        if output.requires_grad:
            output.register_hook(on_grad)
    first_layer.register_forward_hook(mark)
    finish = getattr(wrapped, "finish_gradient_synchronization", None)
    if callable(finish):
        def marked_finish(*args, **kwargs):
            link.mark("finish")
            return finish(*args, **kwargs)
        object.__setattr__(wrapped, "finish_gradient_synchronization", marked_finish)
    no_sync = getattr(wrapped, "no_sync", None)
    if callable(no_sync):
        @contextlib.contextmanager
        def marked_no_sync(*args, **kwargs):
            with no_sync(*args, **kwargs):
                link.mark("no_sync_enter")
                try:
                    yield
                finally:
                    link.mark("no_sync_exit")
        object.__setattr__(wrapped, "no_sync", marked_no_sync)


def rank_train(link, learner: dict, inputs: dict, model_fn=make_model,
               first_layer=lambda model: model[0]) -> dict:
    """Construct the learner's wrapper and train it; return what each step left behind.

    Args:
        model_fn: ``model_fn(seed)`` builds the check's model.
        first_layer: the layer backward reaches last, in a model ``model_fn`` built.
    """
    cls, train_step = learner["main"], learner.get("train_step") or default_step
    out = {"runs": []}
    for i, kwargs in enumerate(inputs["runs"]):
        model = model_fn(inputs["seed"])
        begin(link, f"run {i}: construction")
        wrapped = cls(model, **kwargs)
        init = clone_all(model.parameters())
        _instrument(link, first_layer(model), wrapped)
        optimizer = sgd(model.parameters())
        run = {"init": init, "grads": [], "params": []}
        for step, micro in enumerate(inputs["batches"]):
            begin(link, f"run {i}: step {step}")
            train_step(wrapped, optimizer, micro, nn.functional.mse_loss)
            run["grads"].append(clone_all(p.grad for p in model.parameters()))
            run["params"].append(clone_all(model.parameters()))
        out["runs"].append(run)
    return out


def step_events(events: list, run: int, step: int) -> list:
    return events_of(events, f"run {run}: step {step}")


def judge_training(ws, inputs, outputs, events, run=0, model_fn=make_model,
                   case="") -> list:
    """Records of initial_broadcast, grads_averaged, matches_torch_ddp, matches_single_process.

    Args:
        run: which of :func:`rank_train`'s runs to judge.
        model_fn: the model it trained.
        case: the records' case (e.g. the run's bucket cap).
    """
    from dpcourse.grading import oracles

    batches = [[inputs[r]["batches"][s] for r in range(ws)] for s in range(STEPS)]
    ddp = oracles.train_one_process(model_fn, inputs[0]["seed"], batches, sgd)
    single = oracles.train_one_process(model_fn, inputs[0]["seed"],
                                       oracles.whole_batch(batches), sgd)
    names = [n for n, _ in model_fn(0).named_parameters()]
    tol_ddp, tol_one = tolerance("gloo", torch.float32, "vs_ddp"), \
        tolerance("gloo", torch.float32, "vs_single")
    recs = []
    for r in range(ws):
        out = outputs[r]["runs"][run]
        recs.append(compare(C_BROADCAST.name, names, out["init"], ddp["init"], (0, 0), case,
                            f"rank {r}, "))
        earlier_ok = True
        for step in range(STEPS):
            bad = first_mismatch(names, out["grads"][step], ddp["grads"][step], tol_ddp,
                                 ".grad")
            detail = f"rank {r}, step {step}, {bad}" if bad else ""
            if bad and not any(e.get("label") == "finish"
                               for e in step_events(events[r], run, step)):
                detail += (" — model.finish_gradient_synchronization() was never called in the "
                           "step: gradients left by the hooks were not waited for and averaged")
            elif bad and step and earlier_ok:
                detail += f" ({LATER_STEP})"
            earlier_ok = earlier_ok and not bad
            recs.append(CaseVerdict(C_AVERAGED.name, not bad, detail, case))
        recs += [compare(C_DDP.name, names, out["params"][step], ddp["params"][step], tol_ddp,
                         case, f"rank {r}, after step {step}, ") for step in range(STEPS)]
        recs.append(compare(C_SINGLE.name, names, out["params"][-1], single["params"][-1],
                            tol_one, case, f"rank {r}, after step {STEPS - 1}, "))
    return recs


def later_step_cause(rec: CaseVerdict) -> str:
    """The hint for a gradient that only a later step got wrong (see ``follow_causes``)."""
    if LATER_STEP not in rec.detail:
        return ""
    return ("The first step's gradients were averaged and a later step's were not: something "
            "your wrapper set during the first step (a flag, a count, a hook removed) kept it "
            "from all-reducing the next steps' gradients. Every step must average anew.")


def overlap_records(events: list, case: str) -> tuple[list[int], list[CaseVerdict]]:
    """Judge one step's all-reduces: their sizes in issue order, and whether they overlap.

    Returns:
        The sizes (bytes), and records of ``starts_during_backward`` (the first all-reduce
        is issued before backward reaches the first layer) and ``no_serialising_wait``
        (every all-reduce is asynchronous and issued before the first wait).
    """
    order = [e for e in events if e["op"] in ("all_reduce", "wait", "mark")]
    colls = [k for k, e in enumerate(order) if e["op"] == "all_reduce"]
    marks = [k for k, e in enumerate(order) if e.get("label") == "first_layer_backward"]
    recs = [CaseVerdict("starts_during_backward", bool(colls and marks and colls[0] < marks[-1]),
                        "no all-reduce was issued before backward reached the first layer", case)]
    waits = [k for k, e in enumerate(order) if e["op"] == "wait"]
    blocking = [k for k in colls if not order[k]["async_op"]]
    detail = ""
    if blocking:
        detail = f"{len(blocking)} all-reduce(s) were blocking (async_op=False)"
    elif colls and waits and waits[0] < colls[-1]:
        detail = ("a bucket was waited on before the next bucket was issued: the waits "
                  "serialise communication with backward")
    recs.append(CaseVerdict("no_serialising_wait", not detail, detail, case))
    return [order[k]["nbytes"] for k in colls], recs


class DDPExercise(Exercise):
    """A check of a data-parallel wrapper or training loop: 2 ranks, messages and collectives.

    Unless a check says otherwise, each rank trains the learner's wrapper (:func:`rank_train`)
    once per entry of ``runs`` (the wrapper's keyword arguments), ``accumulation``
    micro-batches per step.
    """

    world_sizes = (2,)
    dist_api = P2P + COLLECTIVES
    timeout = 45.0
    runs: tuple[dict, ...] = ({},)
    accumulation = 1
    notes = (f"tolerances (rtol, atol), float32: vs DDP "
             f"{tolerance('gloo', torch.float32, 'vs_ddp')}, vs one process "
             f"{tolerance('gloo', torch.float32, 'vs_single')}; fresh random seeds and "
             "batches on each run",)
    error_hints = (
        (("'NoneType' object has no attribute",),
         "p.grad is None inside your hook: a hook registered with register_hook runs before the "
         "gradient is accumulated into p.grad (it receives the gradient as its argument), so it "
         "fired too early to read p.grad; lesson 06 names the kind of hook that runs after."),
        (("Default process group has not been initialized",),
         "Something in your code used torch's own process group (torch DDP, or a course "
         "reference), which does not exist while your code is graded: communicate with "
         "dist.all_reduce / dist.broadcast yourself."),
    )
    rank_run = staticmethod(rank_train)

    def make_inputs(self, rng, world_size):
        return make_inputs(rng, world_size, self.accumulation, list(self.runs))

