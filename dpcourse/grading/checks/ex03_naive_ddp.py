"""Exercise 03: naive data parallelism (broadcast at start, one averaged all-reduce per gradient)."""

from __future__ import annotations

from dpcourse.grading.checks import ddp_common as d
from dpcourse.grading.checks.base import CaseVerdict, follow_causes
from dpcourse.grading.criteria import Criterion, no_deadlock, no_delegation


class NaiveDDP(d.DDPExercise):
    """``NaiveDDP(module)``: broadcast at start, one all-reduce per parameter, averaged."""

    name, exercise, title = "naive_ddp", "03", "Naive data parallelism"
    defines = (("main", "NaiveDDP"),)
    world_sizes = (2, 3)
    criteria = (d.C_DDP, d.C_BROADCAST, d.C_AVERAGED, d.C_SINGLE, Criterion(
        "one_all_reduce_per_parameter", "each step all-reduces every parameter's gradient once",
        "The number of all-reduces per step differs from the number of trainable parameters: "
        "some gradient was all-reduced twice, or not at all.", needs=(d.C_AVERAGED.name,)),
        no_delegation(d.C_DDP.name), no_deadlock(d.C_DDP.name))
    def judge(self, ws, inputs, outputs, events):
        recs = d.judge_training(ws, inputs, outputs, events)
        sizes = sorted(d.param_bytes())
        for r in range(ws):
            for step in range(d.STEPS):
                got = sorted(e["nbytes"] for e in d.step_events(events[r], 0, step)
                             if e["op"] == "all_reduce")
                recs.append(CaseVerdict("one_all_reduce_per_parameter", got == sizes,
                                   f"rank {r}, step {step}: all-reduces of {got} bytes, the "
                                   f"parameters have {sizes} bytes"))
        follow_causes(self, recs, d.later_step_cause)
        return recs
