"""Exercise 06: bucketed all-reduces started from gradient hooks, overlapping backward."""

from __future__ import annotations

from dpcourse.grading.checks import ddp_common as d
from dpcourse.grading.checks.base import CaseVerdict, follow_causes
from dpcourse.grading.criteria import Criterion, no_deadlock, no_delegation

CAPS = (500 / d.MIB, 0.0)  # a few buckets, then one per parameter
CARRIED = "issued exactly the right all-reduces"
RESET_HINT = ("The first step went right and a later one did not: what your wrapper counts "
              "during one step (how many gradients each bucket has received, the work in "
              "flight) was not started afresh in finish_gradient_synchronization, so in the next "
              "backward the buckets complete at the wrong time, or never.")


def carried_over(sizes: dict, want: list) -> tuple[int, int] | None:
    """``(good, bad)`` when the first judged step issued ``want`` and step ``bad`` did not.

    Args:
        sizes: ``{step: all-reduce sizes in issue order}`` of one rank and run.
        want: the sizes every judged step should issue.
    """
    steps = sorted(sizes)
    if not steps or sizes[steps[0]] != want:
        return None
    bad = next((s for s in steps[1:] if sizes[s] != want), None)
    return None if bad is None else (steps[0], bad)


def mark_carried(recs: list, where: str, good: int, bad: int) -> None:
    """Say in each failing record of ``where`` from step ``bad`` on that step ``good`` was right."""
    note = f" (step {good} {CARRIED})"
    for rec in recs:
        at = f"{rec.case} {rec.detail}"
        after = [k for k in range(bad, d.STEPS) if f"step {k}" in at]
        if not rec.passed and where in at and after and CARRIED not in rec.detail:
            rec.detail += note


def cause(rec: CaseVerdict) -> str:
    """The reset hint for a record :func:`mark_carried` marked, else a later step's own."""
    return RESET_HINT if CARRIED in rec.detail else d.later_step_cause(rec)


def cap_case(cap: float) -> str:
    return f"bucket_cap_mb={cap:g} ({cap * d.MIB:g} bytes)"


def judge_buckets(ws: int, events: list, wants: list, first_step: int, structure,
                  training: list) -> list[CaseVerdict]:
    """Judge the all-reduces of every rank's steps from ``first_step`` on, in every run.

    When the first judged step issued the right all-reduces and a later one did not, the
    failing records of that rank from then on (``training``'s of the same run too) say so.

    Args:
        wants: per run, ``(bucket_cap_mb, the all-reduce sizes every step must issue)``.
        structure: ``structure(got, want, case)``: the records of one step's sizes ``got``.
        training: the records of :func:`~ddp_common.judge_training`, cased by ``cap_case``.
    """
    recs = []
    for i, (cap, want) in enumerate(wants):
        for r in range(ws):
            sizes, mine = {}, []
            for step in range(first_step, d.STEPS):
                case = f"{cap_case(cap)}, rank {r}, step {step}"
                sizes[step], overlap = d.overlap_records(d.step_events(events[r], i, step), case)
                mine += structure(sizes[step], want, case) + overlap
            found = carried_over(sizes, want)
            if found:
                mark_carried(mine, f"rank {r}", *found)
                mark_carried([t for t in training if t.case == cap_case(cap)], f"rank {r},",
                             *found)
            recs += mine
    return recs


class OverlappedDDP(d.DDPExercise):
    """``OverlappedDDP(module, bucket_cap_mb=...)``: bucketed all-reduces started from hooks."""

    name, exercise, title = "overlapped_ddp", "06", "Overlapped bucketed data parallelism"
    defines = (("main", "OverlappedDDP"),)
    allowed_imports = {"dpcourse.ddp": {"assign_buckets"}, "dpcourse.ddp.bucket_assignment":
                       {"assign_buckets"}}
    criteria = (d.C_DDP, d.C_BROADCAST, d.C_AVERAGED, d.C_SINGLE,
                Criterion("one_all_reduce_per_bucket", "each step issues exactly one all-reduce "
                          "per bucket (bucket_cap_mb = 500 bytes and 0)",
                          "The number of all-reduces differs from the number of buckets: a "
                          "bucket's gradients went out one parameter at a time, or a bucket "
                          "went out more than once in a step."),
                Criterion("buckets_in_reverse_order", "buckets follow DDP's rule (reverse "
                          "parameter order, close at the cap) and go out in the order they fill",
                          "The all-reduces went out in another order than the buckets fill: "
                          "backward produces the last layer's gradients first, so buckets "
                          "built or launched in registration order wait for the end of "
                          "backward."),
                Criterion("starts_during_backward", "the first all-reduce of a step starts "
                          "before backward reaches the first layer",
                          "The first all-reduce started only when backward was over: nothing "
                          "launched communication while gradients were still being computed, "
                          "so there was nothing to overlap.", weight=2),
                Criterion("no_serialising_wait", "every bucket's all-reduce is issued "
                          "(async_op=True) before the first wait", "A wait came before every "
                          "bucket was in flight: a wait (or a blocking all-reduce) during "
                          "backward stalls it until that bucket's communication is done, which "
                          "is exactly what overlap avoids.",
                          needs=("one_all_reduce_per_bucket",)),
                no_delegation(d.C_DDP.name), no_deadlock(d.C_DDP.name))
    runs = tuple({"bucket_cap_mb": cap} for cap in CAPS)

    def judge(self, ws, inputs, outputs, events):
        from dpcourse.grading import oracles

        recs = d.judge_training(ws, inputs, outputs, events, case=cap_case(CAPS[0]))
        nbytes = d.param_bytes()
        wants = [(cap, [sum(nbytes[j] for j in b) for b in oracles.buckets(nbytes, cap)])
                 for cap in CAPS]
        recs += judge_buckets(ws, events, wants, 0, _structure, recs)
        follow_causes(self, recs, cause)
        return recs


def _structure(got: list, want: list, case: str) -> list[CaseVerdict]:
    return [CaseVerdict("one_all_reduce_per_bucket", len(got) == len(want),
                        f"{len(got)} all-reduces, expected {len(want)} buckets", case),
            CaseVerdict("buckets_in_reverse_order", got == want,
                        f"all-reduce sizes in issue order {got} bytes, expected {want}", case)]
