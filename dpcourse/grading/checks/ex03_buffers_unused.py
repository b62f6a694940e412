"""Exercise 03, part 2: naive DDP with buffers, unused and frozen parameters.

The check's model has what real models have and the warm-up's MLP lacks:

* a ``BatchNorm1d``, whose running statistics are *buffers* that every rank
  updates from its own shard (torch DDP makes them follow rank 0: broadcast at
  construction and before every forward);
* ``extra``, a layer used depending on the data: in step 0 only on rank 0, in
  step 1 on no rank, in step 2 on every rank;
* ``spare``, a trainable layer the forward never uses;
* ``frozen``, a layer with ``requires_grad=False``.

The grader computes what torch DDP (``find_unused_parameters=True``) leaves on
every rank (:func:`ddp_reference`; the tests hold it against torch DDP itself)
and compares, step by step: gradients (``None`` included), parameters and buffers.
"""

from __future__ import annotations

import torch
from torch import nn

from dpcourse.grading.checks import ddp_common as d
from dpcourse.grading.checks.base import CaseVerdict, begin, clone_all, compare
from dpcourse.grading.checks.random_inputs import regression_batches, torch_generator
from dpcourse.grading.criteria import (Criterion, mismatch, no_deadlock, no_delegation,
                                       tolerance)

EXTRA_USED = ((0,), (), None)  # ranks that use ``extra`` in each step: some, none, all
# Samples per rank and step. Batch norm divides by the batch's standard deviation, and
# over 4 samples a feature's can be tiny: the last ulp in which correct wrappers differ
# (dividing before or after the sum) then grows past the tolerance by the next step.
BATCH = 16


class Branchy(nn.Module):
    """An MLP with batch norm, a data-dependent layer, an unused layer and a frozen one."""

    def __init__(self):
        super().__init__()
        # No bias before batch norm, as is usual: the norm subtracts the batch mean, so
        # such a bias's gradient is zero up to rounding, and comparing that noise with
        # torch DDP's would pass or fail a correct wrapper depending on the random case.
        self.inp = nn.Linear(d.IN, d.HIDDEN, bias=False)
        self.norm = nn.BatchNorm1d(d.HIDDEN)
        self.out = nn.Linear(d.HIDDEN, d.OUT)
        self.extra = nn.Linear(d.HIDDEN, d.OUT)
        self.spare = nn.Linear(d.HIDDEN, d.OUT)
        self.frozen = nn.Linear(d.IN, d.OUT, bias=False).requires_grad_(False)
        self.use_extra = True

    def forward(self, x):
        hidden = torch.relu(self.norm(self.inp(x)))
        y = self.out(hidden) + self.frozen(x)
        return y + self.extra(hidden) if self.use_extra else y


def make_model(seed: int, rank: int) -> Branchy:
    """Return rank ``rank``'s model: its own seed and its own buffer values."""
    torch.manual_seed(seed)
    model = Branchy()
    with torch.no_grad():  # so that a missing buffer broadcast shows at construction
        model.norm.running_mean.fill_(0.1 * rank)
        model.norm.running_var.fill_(1.0 + rank)
    return model


def uses_extra(step: int, rank: int) -> bool:
    used = EXTRA_USED[step]
    return used is None or rank in used


def ddp_reference(seed0: int, batches: list) -> dict:
    """What torch DDP (``find_unused_parameters=True``, ``broadcast_buffers=True``) leaves.

    Args:
        seed0: rank 0's seed (DDP starts every replica from rank 0's parameters and buffers).
        batches: ``batches[step][rank]`` is ``(x, y)``.

    Returns:
        :func:`~dpcourse.grading.oracles.train_one_process`'s record: a gradient is the mean
        over ranks with zeros for ranks that did not use the parameter, and stays None when
        no rank used it (or it is frozen); the buffers are each rank's after its forward.
    """
    from dpcourse.grading import oracles

    def use_extra(model, step, rank):
        model.use_extra = uses_extra(step, rank)

    return oracles.train_one_process(lambda seed: make_model(seed, 0), seed0,
                                     [[[xy] for xy in per_rank] for per_rank in batches],
                                     d.sgd, prepare=use_extra)


class BuffersUnused(d.DDPExercise):
    """``CompleteNaiveDDP(module)``: buffers follow rank 0; unused and frozen layers handled."""

    name, exercise, title = "naive_ddp_complete", "03", "Naive DDP with buffers and unused layers"
    defines = (("main", "CompleteNaiveDDP"),)
    world_sizes = (2, 3)
    criteria = (
        Criterion("initial_broadcast", "after construction every rank holds rank 0's parameters "
                  "and buffers", "The ranks differ right after construction: each started from "
                  "its own parameters and batch-norm statistics, and the statistics are buffers, "
                  "not parameters, so a copy of the parameters alone leaves them apart."),
        Criterion("buffers_follow_rank_0", "after each step the buffers equal torch DDP's on "
                  "the same rank", "The running statistics differ from torch DDP's after a "
                  "step: each rank updates them from its own shard, so they drift apart unless "
                  "they are made equal again, at the point in every step where torch DDP does "
                  "it.", weight=2),
        Criterion("grads_averaged", "every gradient equals torch DDP's (the mean over ranks)",
                  "The gradient is off by the ratio in the message: a ratio equal to the world "
                  "size means every rank's contribution was summed but not averaged."),
        Criterion("partly_used_parameter", "a parameter used on some ranks only gets the mean "
                  "over all ranks, zeros counted for the others, on every rank",
                  "A rank on which a layer was unused has p.grad None, yet its peers all-reduce "
                  "that layer: every rank must take part in the same all-reduces, in the same "
                  "order, and a rank that skips one leaves its peers' mean wrong or waiting.",
                  weight=2),
        Criterion("unused_parameter_keeps_no_grad", "a parameter no rank used keeps grad None, "
                  "as with torch DDP", "A parameter no rank used got a gradient (zeros): a rank "
                  "sees only its own use, and decided without the others. A zero gradient is "
                  "not the same as none: an optimizer skips a parameter whose grad is None, but "
                  "weight decay, or momentum built up in earlier steps, still moves one whose "
                  "grad is zeros.", weight=2),
        Criterion("frozen_parameter_untouched", "a parameter with requires_grad=False gets no "
                  "gradient and stays rank 0's value", "The frozen parameter got a gradient or "
                  "moved: the synchronisation treated a parameter that requires no gradient like "
                  "a trained one."),
        Criterion("matches_torch_ddp", "parameters after each of 3 SGD steps equal torch DDP's",
                  "Check the other criteria first: each names one cause of a difference.",
                  weight=2),
        no_delegation("matches_torch_ddp"), no_deadlock("matches_torch_ddp"),
    )
    notes = (f"tolerances (rtol, atol), float32: vs torch DDP "
             f"{tolerance('gloo', torch.float32, 'vs_ddp')}; what torch DDP computes with "
             "find_unused_parameters=True; fresh random seeds and batches on each run",)

    def make_inputs(self, rng, world_size):
        seeds = [rng.getrandbits(31) for _ in range(world_size)]
        gen = torch_generator(rng)
        batches = [regression_batches(gen, world_size, BATCH, d.IN, d.OUT) for _ in EXTRA_USED]
        return [{"seed": seeds[r], "seed0": seeds[0], "rank": r,
                 "batches": [batches[s][r] for s in range(len(EXTRA_USED))]}
                for r in range(world_size)]

    @staticmethod
    def rank_run(link, learner, inputs):
        rank = inputs["rank"]
        model = make_model(inputs["seed"], rank)
        begin(link, "construction")
        wrapped = learner["main"](model)
        out = {"steps": [], "init": {"params": clone_all(model.parameters()),
                                     "buffers": clone_all(model.buffers())}}
        optimizer = d.sgd(model.parameters())
        for step, (x, y) in enumerate(inputs["batches"]):
            model.use_extra = uses_extra(step, rank)
            begin(link, f"step {step}; extra used on rank(s) "
                        f"{list(EXTRA_USED[step]) if EXTRA_USED[step] is not None else 'all'}")
            d.default_step(wrapped, optimizer, [(x, y)], nn.functional.mse_loss)
            out["steps"].append({"grads": clone_all(p.grad for p in model.parameters()),
                                 "params": clone_all(model.parameters()),
                                 "buffers": clone_all(model.buffers())})
        return out

    def judge(self, ws, inputs, outputs, events):
        batches = [[inputs[r]["batches"][s] for r in range(ws)] for s in range(len(EXTRA_USED))]
        ref = ddp_reference(inputs[0]["seed0"], batches)
        tol = tolerance("gloo", torch.float32, "vs_ddp")
        model = make_model(0, 0)
        names = [n for n, _ in model.named_parameters()]
        bnames = [n for n, _ in model.named_buffers()]
        init = ref["init"] + clone_all(make_model(inputs[0]["seed0"], 0).buffers())
        recs = []
        for r in range(ws):
            got = outputs[r]
            recs.append(compare("initial_broadcast", names + bnames,
                                got["init"]["params"] + got["init"]["buffers"], init, (0, 0),
                                f"rank {r}, construction"))
            for step, used in enumerate(EXTRA_USED):
                case = f"rank {r}, step {step}, extra used on " + (
                    "every rank" if used is None else f"rank(s) {list(used)}" if used
                    else "no rank")
                mine = got["steps"][step]
                recs.append(compare("buffers_follow_rank_0", bnames, mine["buffers"],
                                    ref["buffers"][step][r], tol, case))
                for n, a, b in zip(names, mine["grads"], ref["grads"][step]):
                    crit = ("frozen_parameter_untouched" if n.startswith("frozen")
                            else "unused_parameter_keeps_no_grad" if b is None
                            else "partly_used_parameter" if n.startswith("extra") and used
                            else "grads_averaged")
                    if a is None or b is None:
                        detail = f"{n}.grad is {'None' if a is None else 'a tensor'}, torch " \
                                 f"DDP's is {'None' if b is None else 'a tensor'}"
                        recs.append(CaseVerdict(crit, a is None and b is None, detail, case))
                    else:
                        diff = mismatch(a, b, *tol)
                        recs.append(CaseVerdict(crit, not diff, f"{n}.grad: {diff}", case))
                recs.append(compare("matches_torch_ddp", names, mine["params"],
                                    ref["params"][step], tol, case))
            frozen = [i for i, n in enumerate(names) if n.startswith("frozen")]
            recs.append(compare("frozen_parameter_untouched", [names[i] for i in frozen],
                                [got["steps"][-1]["params"][i] for i in frozen],
                                [ref["init"][i] for i in frozen], (0, 0),
                                f"rank {r}, after training"))
        return recs
