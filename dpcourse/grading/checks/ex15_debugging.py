"""Exercise 15: name the cause of six broken jobs from their logs, and fix three of them.

The learner's ``diagnosis()`` returns ``{job: cause}`` for the jobs A-F of the
notebook (one of :data:`CAUSES` each). Three fixes run on the grader's ranks (world
sizes 2 and 3) on fresh random cases, each judged on its result and on what crossed
the wire: ``global_histogram`` (one all-reduce of ``num_classes`` counts),
``pass_to_the_right`` (one send to the right neighbour) and ``should_stop`` (one
all-reduce of one number, on every rank whatever its flag).
"""

from __future__ import annotations

import torch

from dpcourse.grading.checks.base import CaseVerdict, Exercise, begin, events_of, follow_causes
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
                  "every rank, when the ranks' largest labels differ, with one all-reduce of "
                  "num_classes counts",
                  "The counts' length must be one every rank knows before it sees its data "
                  "(num_classes), or the ranks all-reduce tensors of different lengths, as job "
                  "A's log says.", requires="histogram", weight=2),
        Criterion("exchange_completes", "pass_to_the_right returns the left neighbour's tensor on "
                  "every rank (2 and 3 ranks), each rank sending its tensor once, to rank + 1",
                  "Each rank must send its tensor to rank + 1 and receive from rank - 1 (modulo the "
                  "world size); post both at once (batch_isend_irecv) or order them by rank, so "
                  "that no rank waits to receive from a rank that is itself waiting.",
                  requires="exchange", weight=2),
        Criterion("stop_agrees", "should_stop returns True on every rank if any rank's flag is "
                  "set, else False on every rank, with one all-reduce of one number",
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
        one = rng.randrange(world_size)  # the third case: exactly one rank's flag is set
        flag_cases = [[False] * world_size, [True] * world_size,
                      [r == one for r in range(world_size)]]
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
        recs, where = [], f"{ws} ranks"
        want = sum(torch.bincount(i["labels"], minlength=i["num_classes"]) for i in inputs)
        counts = {n * inputs[0]["num_classes"] for n in (4, 8)}  # float32 or int64 counts
        for r, out in enumerate(outputs):
            got, left, nxt = out["hist"], inputs[(r - 1) % ws]["tensor"], (r + 1) % ws
            ok = isinstance(got, torch.Tensor) and got.shape == want.shape and \
                torch.equal(got.double(), want.double())
            recs.append(_sent(CaseVerdict("histogram_sums", ok, f"rank {r} returned {got}, the "
                                          f"summed counts are {want.tolist()}", where),
                              r, events[r], "global_histogram",
                              lambda m: m[0][0] == "all_reduce" and m[0][2] in counts))
            got = out["passed"]
            ok = isinstance(got, torch.Tensor) and torch.equal(got, left)
            recs.append(_sent(CaseVerdict("exchange_completes", ok, f"rank {r} returned {got}, its "
                                          f"left neighbour (rank {(r - 1) % ws}) holds {left}",
                                          where), r, events[r], "pass_to_the_right",
                              lambda m: m[0] == ("send", nxt, left.numel() * left.element_size())))
            for k, got in enumerate(out["stops"]):
                flags = [i["flags"][k] for i in inputs]
                ok = isinstance(got, (bool, int, float)) and bool(got) == any(flags)
                recs.append(_sent(CaseVerdict("stop_agrees", ok, f"flags {flags}: rank {r} "
                                              f"returned {got!r}, expected {any(flags)}", where),
                                  r, events[r], f"should_stop, flag case {k}",
                                  lambda m: m[0][0] == "all_reduce" and 0 < m[0][2] <= 8))
        causes = outputs[0]["causes"]
        if not isinstance(causes, dict):
            recs.append(CaseVerdict("causes_named", False, f"diagnosis() returned {causes}, "
                                    "expected a dict {job: cause}"))
        else:
            wrong = sorted(job for job, cause in ANSWERS.items() if causes.get(job) != cause)
            unknown = sorted({str(v) for v in causes.values()} - set(CAUSES))
            extra = f"; {unknown} are not among the causes" if unknown else ""
            recs.append(CaseVerdict("causes_named", not wrong, f"job(s) {', '.join(wrong)}: the "
                                    f"named cause does not fit the log{extra}"))
        follow_causes(self, recs, lambda rec: _TRAFFIC_HINTS[rec.criterion]
                      if "crossed the wire" in rec.detail else "")
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


_TRAFFIC_HINTS = {
    "histogram_sums": "The counts were right, but more than one all-reduce of num_classes counts "
                      "crossed the wire: every rank adds its counts into one tensor of a length "
                      "all ranks know, and one all-reduce sums them everywhere; sending each "
                      "rank's counts to all others moves N times the bytes.",
    "exchange_completes": "The right tensor arrived, but not by one message to the right: each "
                          "rank needs only its left neighbour's tensor, so each sends its own "
                          "once, to rank + 1, and receives once; a broadcast from every "
                          "rank hands every tensor to every rank.",
    "stop_agrees": "The answer was right, but not from one all-reduce of one number: each rank "
                   "puts its flag in a one-element tensor and all reduce it with MAX (or SUM) "
                   "together; a broadcast per rank is N collectives for one bit each.",
}


def _sent(rec: CaseVerdict, rank: int, events: list, case: str, right) -> CaseVerdict:
    """``rec``, failed where what the rank sent in ``case`` is not one message ``right`` accepts.

    ``right`` gets the rank's messages as ``(op, peer, bytes)``, receives and barriers aside.
    """
    moved = [(e["op"], e.get("peer"), e["nbytes"]) for e in events_of(events, case)
             if "nbytes" in e and e["op"] not in ("delivered", "barrier")]
    if not rec.passed or (len(moved) == 1 and right(moved)):
        return rec
    sent = ", ".join(f"{op}{f' to rank {p}' if op == 'send' else ''} of {n} bytes"
                     for op, p, n in moved) or "nothing"
    return CaseVerdict(rec.criterion, False, f"rank {rank} returned the right value in {case}, "
                       f"but what crossed the wire was {sent}", rec.case)
