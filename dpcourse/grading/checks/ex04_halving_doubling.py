"""Exercise 04, part 2: an all-reduce in about log2(N) rounds, for any world size.

The ranks run on the grader's process group, which offers only point-to-point
messages. The grader delivers every message, so it counts each rank's messages
and bytes: a ring needs 2 (N - 1) rounds, and every byte beyond what halving and
doubling carry (:func:`~dpcourse.grading.oracles.halving_doubling_sent_bytes`) is
reported. The sums are checked against the grader's own oracle on fresh random
tensors, on 3, 4 and 5 ranks (one power of two, two not).
"""

from __future__ import annotations

import torch

from dpcourse.grading.checks.base import CaseVerdict, Exercise, events_of
from dpcourse.grading.checks.ex04_ring import MATCH, NOTES, awkward_cases, case_inputs, run_cases
from dpcourse.grading.criteria import (Criterion, mismatch, no_deadlock, no_delegation,
                                       tolerance)
from dpcourse.grading.shim import P2P


def round_limit(n: int) -> int:
    """Most sends any rank may issue: 2 log2 N for a power of two, one fold more otherwise."""
    p = 1 << (n.bit_length() - 1)
    return 2 * (p.bit_length() - 1) + (0 if p == n else 1)


def _shapes(ws: int, rng) -> list[tuple[str, tuple, str]]:
    even = 8 * ws * rng.randrange(2, 9)  # halves divide it evenly down to single chunks
    cases = [(MATCH, (even,), "float32"), (MATCH, (4 * ws, 8), "float32"),
             (MATCH, (even,), "float64"), (MATCH, (even,), "bfloat16")]
    return cases + awkward_cases(ws, rng.randrange(100, 2000) * 2 + 1)


def _bytes_verdict(ws: int, sent: list[int], nbytes: int, crit: str, case: str) -> CaseVerdict:
    """Every rank's bytes against halving-doubling's; where halves are uneven, their total."""
    from dpcourse.grading import oracles

    if crit == MATCH:
        want, got = oracles.halving_doubling_sent_bytes(nbytes, ws), sorted(sent)
    else:  # a pair sends its region once each way, and a folded rank's tensor goes both ways
        want, got = 2 * (ws - 1) * nbytes, sum(sent)
    return CaseVerdict("bandwidth_power_of_two" if ws & (ws - 1) == 0 else "bytes_other_sizes",
                       got == want, f"the ranks sent {got} bytes of a {nbytes}-byte tensor, "
                       f"halving-doubling sends {want}", case)


class HalvingDoubling(Exercise):
    """``halving_doubling_all_reduce(tensor, group=None)`` in O(log N) rounds, any world size."""

    name, exercise, title = "halving_doubling", "04", "All-reduce in log2(N) rounds"
    defines = (("main", "halving_doubling_all_reduce"),)
    world_sizes = (3, 4, 5)
    dist_api = P2P
    dist_why = ("Build it from messages between pairs of ranks: the grader's process group offers "
                "only send, recv, isend, irecv, P2POp and batch_isend_irecv.")
    timeout = 40.0
    criteria = (
        Criterion(MATCH, "leaves the same sum as dist.all_reduce on every rank (3, 4 and 5 ranks; "
                  "float32, float64, bfloat16; 1-D and 2-D)",
                  "Partners must agree on which part each of them keeps: both cut the same "
                  "region at the same point, and the one with the lower rank in the pair keeps "
                  "the same half on every step. If the values are N times off, something is "
                  "added twice or averaged.", weight=3),
        Criterion("awkward_lengths", "also works for lengths 0, 1, fewer than N and odd lengths",
                  "Only odd or tiny lengths fail: the two partners cut a region at different "
                  "points (its halves differ by one element), or one side skips an empty half "
                  "that the other still sends or expects.", weight=2),
        Criterion("in_place", "updates the tensor it is given, any shape",
                  "The tensor you were given still holds its old values: the sums went into a "
                  "new tensor (a copy, not a view of the given one), which the caller never "
                  "sees.", needs=(MATCH,)),
        Criterion("log_rounds", "no rank sends more than 2 log2 N messages (one more when N is "
                  "not a power of two): 4 on 4 ranks where a ring sends 6",
                  "A rank sent more messages than log2 N rounds allow: its partners are chosen "
                  "so that what a rank knows reaches one more rank per round, as in a ring, "
                  "instead of doubling the ranks it has heard from every round.",
                  needs=(MATCH,)),
        Criterion("bandwidth_power_of_two", "on 4 ranks each rank sends exactly 2 (N - 1) / N "
                  "of the tensor's bytes, as a ring does; for odd lengths the ranks' total is "
                  "exactly 2 (N - 1) tensors",
                  "The ranks sent more bytes than halving and doubling carry: a round carried "
                  "the whole tensor (or a rank sent it to every other rank), although after "
                  "each round a pair has only half as much left to reduce.", weight=2,
                  needs=(MATCH,)),
        Criterion("bytes_other_sizes", "on 3 and 5 ranks each rank sends exactly what folding "
                  "onto the largest power of two p below N costs: a rank left over sends its "
                  "tensor once, its partner 2 (p - 1) / p of it plus the sum back, every other "
                  "rank 2 (p - 1) / p; for odd lengths the ranks' total is exactly 2 (N - 1) "
                  "tensors",
                  "With N not a power of two the ranks' bytes differ from the fold's: the ranks "
                  "left over took part in the rounds, or some rank sent its whole tensor to "
                  "several others.", weight=2, needs=(MATCH,)),
        no_delegation(MATCH), no_deadlock(MATCH),
    )
    notes = NOTES

    def make_inputs(self, rng, world_size):
        return case_inputs(_shapes(world_size, rng), rng, world_size)

    @staticmethod
    def rank_run(link, learner, inputs):
        return run_cases(link, learner["main"], inputs["cases"])

    def judge(self, ws, inputs, outputs, events):
        from dpcourse.grading import oracles

        recs = []
        for k, case in enumerate(inputs[0]["cases"]):
            name, crit = case["case"], case["crit"]
            want = oracles.all_reduce_sum([inputs[r]["cases"][k]["x"] for r in range(ws)])
            rtol, atol = tolerance("gloo", want.dtype, "collective")
            sends = [[e for e in events_of(events[r], name) if e["op"] == "send"]
                     for r in range(ws)]
            for r in range(ws):
                got = outputs[r][k]
                diff = mismatch(got["x"], want, rtol, atol)
                recs.append(CaseVerdict(crit, not diff, f"rank {r}: {diff}", name))
                if want.numel() > 1:
                    recs.append(CaseVerdict("in_place", got["same"], "the tensor was replaced "
                                            "instead of updated in place", name))
                if crit == MATCH:  # rounds are counted where every message is non-empty
                    recs.append(CaseVerdict("log_rounds", len(sends[r]) <= round_limit(ws),
                                            f"rank {r} sent {len(sends[r])} messages, at most "
                                            f"{round_limit(ws)} allowed on {ws} ranks", name))
            recs.append(_bytes_verdict(ws, [sum(e["nbytes"] for e in s) for s in sends],
                                       want.numel() * want.element_size(), crit, name))
        return recs
