"""Exercise 15: name the cause of six broken jobs from their logs, and fix three of them.

The learner's ``diagnosis()`` returns ``{job: cause}`` for the jobs A-F of the
notebook, each cause one of :data:`CAUSES`; the grader compares it with its own
table. Three fixes run on the grader's ranks (world sizes 2 and 3) on fresh
random cases:

- ``global_histogram(labels, num_classes, group=None)``: every rank's class
  counts summed, on every rank (job A all-reduced counts whose length came from
  the data);
- ``pass_to_the_right(tensor, group=None)``: each rank's tensor passed one rank to
  the right around the ring, so every rank returns its left neighbour's (job B
  posted every receive before any send);
- ``should_stop(flag, group=None)``: ``True`` on every rank once any rank's flag is
  set (job C all-reduced only on the ranks whose flag was set).

The expected values are computed here, in the grader, from the inputs it made.
"""

from __future__ import annotations

import torch

from dpcourse.grading.checks.base import CaseVerdict, Exercise, begin
from dpcourse.grading.criteria import Criterion, no_deadlock, no_delegation
from dpcourse.grading.shim import COLLECTIVES, P2P

CAUSES = ("skipped_collective", "order_mismatch", "shape_mismatch", "dead_rank",
          "p2p_deadlock", "timeout_too_short")
ANSWERS = {"A": "shape_mismatch", "B": "p2p_deadlock", "C": "skipped_collective",
           "D": "dead_rank", "E": "timeout_too_short", "F": "order_mismatch"}


class DebuggingFixes(Exercise):
    """Causes of six broken jobs, and the fixes of three, run on CPU ranks."""

    name, exercise, title = "debugging", "15", "Diagnose and fix broken distributed jobs"
    defines = (("main", "diagnosis"), ("histogram", "global_histogram"),
               ("exchange", "pass_to_the_right"), ("stop", "should_stop"))
    world_sizes = (2, 3)
    dist_api = P2P + COLLECTIVES
    dist_why = "The fixes need only all_reduce, broadcast, barrier and point-to-point calls."
    timeout = 20.0
    criteria = (
        Criterion("histogram_sums", "global_histogram returns every rank's counts summed, on "
                  "every rank, when the ranks' largest labels differ",
                  "The counts' length must be one every rank knows before it sees its data "
                  "(num_classes), or the ranks all-reduce tensors of different lengths, as job "
                  "A's log says.", requires="histogram", weight=2),
        Criterion("exchange_completes", "pass_to_the_right returns the left neighbour's tensor on "
                  "every rank (2 and 3 ranks)",
                  "Each rank must send its tensor to rank + 1 and receive from rank - 1 (modulo the "
                  "world size); post both at once (batch_isend_irecv) or order them by rank, so "
                  "that no rank waits to receive from a rank that is itself waiting.",
                  requires="exchange", weight=2),
        Criterion("stop_agrees", "should_stop returns True on every rank if any rank's flag is "
                  "set, else False on every rank",
                  "Every rank must issue the same collective whatever its own flag says: reduce "
                  "the flags with MAX (or SUM) on every rank, then decide.",
                  requires="stop", weight=2),
        Criterion("causes_named", "diagnosis() names the cause of each of the six jobs",
                  f"Read each log for who waits where, what the error names and what the other "
                  f"ranks did; the causes are {', '.join(CAUSES)}.", weight=3),
        no_delegation("histogram_sums"), no_deadlock("histogram_sums"),
    )
    notes = ("fixes compared exactly with the grader's own result; fresh random cases per run",)

    def make_inputs(self, rng, world_size):
        num_classes = rng.randrange(5, 9)
        # distinct largest labels per rank: a length taken from the data differs between ranks
        tops = rng.sample(range(num_classes), world_size)
        flag_cases = [[False] * world_size, [True] * world_size,
                      [r == rng.randrange(world_size) for r in range(world_size)]]
        return [{"num_classes": num_classes,
                 "labels": torch.tensor([rng.randrange(tops[r] + 1) for _ in range(6)] + [tops[r]]),
                 "tensor": torch.tensor([rng.uniform(-9, 9) for _ in range(3)]),
                 "flags": [case[r] for case in flag_cases]} for r in range(world_size)]

    @staticmethod
    def rank_run(link, learner, inputs):
        begin(link, "global_histogram")
        hist = learner["histogram"](inputs["labels"].clone(), inputs["num_classes"])
        begin(link, "pass_to_the_right")
        passed = learner["exchange"](inputs["tensor"].clone())
        stops = []
        for k, flag in enumerate(inputs["flags"]):
            begin(link, f"should_stop, flag case {k}")
            stops.append(learner["stop"](flag))
        begin(link, "diagnosis")
        causes = learner["main"]()
        return {"hist": hist, "passed": passed, "stops": stops,
                "causes": dict(causes) if isinstance(causes, dict) else repr(causes)}

    def judge(self, ws, inputs, outputs, events):
        recs = []
        want = sum(torch.bincount(i["labels"], minlength=i["num_classes"]) for i in inputs)
        for r, out in enumerate(outputs):
            got, left = out["hist"], inputs[(r - 1) % ws]["tensor"]
            ok = isinstance(got, torch.Tensor) and got.shape == want.shape and \
                torch.equal(got.double(), want.double())
            recs.append(CaseVerdict("histogram_sums", ok, f"rank {r} returned {got}, the summed "
                                    f"counts are {want.tolist()}", f"{ws} ranks"))
            got = out["passed"]
            ok = isinstance(got, torch.Tensor) and torch.equal(got, left)
            recs.append(CaseVerdict("exchange_completes", ok, f"rank {r} returned {got}, its left "
                                    f"neighbour (rank {(r - 1) % ws}) holds {left}", f"{ws} ranks"))
            for k, got in enumerate(out["stops"]):
                flags = [i["flags"][k] for i in inputs]
                ok = isinstance(got, (bool, int, float)) and bool(got) == any(flags)
                recs.append(CaseVerdict("stop_agrees", ok, f"flags {flags}: rank {r} "
                                        f"returned {got!r}, expected {any(flags)}", f"{ws} ranks"))
        causes = outputs[0]["causes"]
        if not isinstance(causes, dict):
            recs.append(CaseVerdict("causes_named", False, f"diagnosis() returned {causes}, "
                                    "expected a dict {job: cause}"))
            return recs
        wrong = sorted(job for job, cause in ANSWERS.items() if causes.get(job) != cause)
        unknown = sorted({str(v) for v in causes.values()} - set(CAUSES))
        recs.append(CaseVerdict("causes_named", not wrong, f"job(s) {', '.join(wrong)}: the named "
                                "cause does not fit the log" + (f"; {unknown} are not among the "
                                                                 "causes" if unknown else "")))
        return recs

    def explain(self, text):
        if "disagree on collective" in text:
            return "The ranks passed tensors of different sizes to one collective."
        if "should_stop" in text and "never issued" in text:
            return ("Some ranks never issued should_stop's collective: every rank must issue it, "
                    "whatever its own flag says.")
        if "recv" in text and ("waiting" in text or "timed out" in text):
            return "Every rank was waiting in a receive: nobody had sent yet."
        return ""
