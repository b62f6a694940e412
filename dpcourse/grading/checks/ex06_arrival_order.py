"""Exercise 06, part 2: buckets built from the order gradients arrived in during the first step.

The check's model registers its layers in a different order from the one its
forward pass uses them in (``out``, ``mid``, ``inp``, run as inp -> mid -> out),
so reverse registration order is *not* the order backward produces gradients.
The learner's wrapper must watch the first step, then bucket in the order it
saw, as torch DDP's reducer does when it rebuilds its buckets after the first
iteration. From the second step on, the grader's record shows one all-reduce per
bucket, in arrival order, the first one issued before backward reaches the first
layer; every step is compared with what DDP computes and with one process.
"""

from __future__ import annotations

import torch
from torch import nn

from dpcourse.grading.checks import ddp_common as d
from dpcourse.grading.checks.base import CaseVerdict, follow_causes
from dpcourse.grading.checks.ex06_overlap import cap_case, cause, judge_buckets
from dpcourse.grading.criteria import Criterion, no_deadlock, no_delegation

CAPS = (700 / d.MIB, 0.0)


class Permuted(nn.Module):
    """An MLP whose layers are registered out, mid, inp but run inp -> mid -> out."""

    def __init__(self):
        super().__init__()
        self.out = nn.Linear(d.MID, d.OUT)
        self.mid = nn.Linear(d.HIDDEN, d.MID)
        self.inp = nn.Linear(d.IN, d.HIDDEN)

    def forward(self, x):
        return self.out(torch.relu(self.mid(torch.relu(self.inp(x)))))


def make_model(seed: int) -> Permuted:
    """Return the check's model built from ``seed``."""
    torch.manual_seed(seed)
    return Permuted()


def arrival_order() -> list[int]:
    """Return parameter indices (registration order) in the order backward fills their grads."""
    model, order = make_model(0), []
    for i, p in enumerate(model.parameters()):
        p.register_post_accumulate_grad_hook(lambda p, i=i: order.append(i))
    x, y = torch.randn(d.BATCH, d.IN), torch.randn(d.BATCH, d.OUT)
    nn.functional.mse_loss(model(x), y).backward()
    return order


def rank_train(link, learner, inputs) -> dict:
    """Train the learner's wrapper of the permuted model (see :func:`ddp_common.rank_train`)."""
    return d.rank_train(link, learner, inputs, make_model, lambda model: model.inp)


class ArrivalOrderDDP(d.DDPExercise):
    """``ArrivalOrderDDP(module, bucket_cap_mb=...)``: buckets rebuilt in step 1's arrival order."""

    name, exercise, title = "arrival_order", "06", "Buckets in the order gradients arrive"
    defines = (("main", "ArrivalOrderDDP"),)
    criteria = (
        Criterion("matches_torch_ddp", "parameters after each of 3 SGD steps equal what torch "
                  "DDP computes, the first step included", "Some step's gradients are not "
                  "torch DDP's mean over ranks: a gradient was left unsynchronised or summed "
                  "without averaging, the first step (while the order is still being learned) "
                  "included.", weight=3),
        Criterion("matches_single_process", "parameters after 3 steps equal one process "
                  "training on the whole global batch", "Check matches_torch_ddp first."),
        Criterion("buckets_follow_arrival", "from the second step on, the all-reduces carry the "
                  "buckets of the arrival order (caps 700 B and 0), issued in that order",
                  "The buckets follow registration order, which is not the order gradients "
                  "arrive in this model: those buckets complete only when their last-arriving "
                  "gradient does, late and out of turn.", weight=3),
        Criterion("starts_during_backward", "from the second step on, the first all-reduce "
                  "starts before backward reaches the first layer",
                  "The first all-reduce started only after backward: buckets were launched at "
                  "the sync point, not when their last gradient arrived.",
                  needs=("buckets_follow_arrival",)),
        Criterion("no_serialising_wait", "from the second step on, every bucket is issued "
                  "(async_op=True) before the first wait",
                  "A wait came before every bucket was in flight: waiting (or a blocking "
                  "all-reduce) during backward stalls it until that bucket's communication is "
                  "done.", needs=("buckets_follow_arrival",)),
        no_delegation("matches_torch_ddp"), no_deadlock("matches_torch_ddp"),
    )
    runs = tuple({"bucket_cap_mb": cap} for cap in CAPS)

    rank_run = staticmethod(rank_train)

    def judge(self, ws, inputs, outputs, events):
        from dpcourse.grading import oracles

        recs = [rec for i, cap in enumerate(CAPS)
                for rec in d.judge_training(ws, inputs, outputs, events, i, make_model,
                                            cap_case(cap))
                if rec.criterion in (d.C_DDP.name, d.C_SINGLE.name)]
        nbytes = [p.numel() * p.element_size() for p in make_model(0).parameters()]
        wants = [(cap, [sum(nbytes[j] for j in b)
                        for b in oracles.close_by_caps(arrival_order(), nbytes, [cap * d.MIB])])
                 for cap in CAPS]
        # step 0 only learns the order: the first bucketed step is step 1
        recs += judge_buckets(ws, events, wants, 1, _structure, recs)
        follow_causes(self, recs, cause)
        return recs


def _structure(got: list, want: list, case: str) -> list[CaseVerdict]:
    return [CaseVerdict("buckets_follow_arrival", got == want, f"all-reduce sizes in issue "
                        f"order {got} bytes, the arrival order's buckets are {want}", case)]
