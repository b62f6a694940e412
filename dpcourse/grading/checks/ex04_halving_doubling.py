"""Exercise 04, part 2: an all-reduce in about log2(N) rounds, for any world size.

The ranks run on the grader's process group, which offers only point-to-point
messages. The grader delivers every message, so it knows how many each rank
sent and how many bytes: a ring needs 2 (N - 1) rounds, swapping whole tensors
sends too many bytes, and each is reported as what it is. The sums are checked
against the grader's own oracle on fresh random tensors, on 3, 4 and 5 ranks
(one power of two, two not).
"""

from __future__ import annotations

import torch

from dpcourse.grading.checks.base import Exercise, CaseVerdict, begin, events_of
from dpcourse.grading.criteria import (Criterion, mismatch, no_deadlock, no_delegation,
                                       tolerance)
from dpcourse.grading.shim import P2P

MATCH = "matches_all_reduce"
_DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16}


def largest_power_of_two(n: int) -> int:
    """Return the largest power of two that is <= ``n`` (``n`` >= 1)."""
    return 1 << (n.bit_length() - 1)


def round_limit(n: int) -> int:
    """Most sends any rank may issue: 2 log2 N for a power of two, one fold more otherwise."""
    p = largest_power_of_two(n)
    return 2 * (p.bit_length() - 1) + (0 if p == n else 1)


def byte_limit(n: int, nbytes: int) -> float:
    """Most bytes any rank may send: 2 (p - 1) / p of the tensor, plus one copy when p < N."""
    p = largest_power_of_two(n)
    return 2 * (p - 1) / p * nbytes + (0 if p == n else nbytes)


def _shapes(ws: int, rng) -> list[tuple[str, tuple, str]]:
    even = 8 * ws * rng.randrange(2, 9)  # halves divide it evenly down to single chunks
    cases = [(MATCH, (even,), "float32"), (MATCH, (4 * ws, 8), "float32"),
             (MATCH, (even,), "float64"), (MATCH, (even,), "bfloat16")]
    odd = rng.randrange(100, 2000) * 2 + 1
    return cases + [("awkward_lengths", s, "float32")
                    for s in ((0,), (1,), (max(ws - 1, 1),), (2 * ws + 1,), (odd,))]


def _random(shape, dtype: str, gen) -> torch.Tensor:
    if dtype == "bfloat16":  # small integers: every partial sum is exact in bfloat16
        return torch.randint(-8, 9, shape, generator=gen).to(torch.bfloat16)
    return torch.randn(shape, generator=gen, dtype=torch.float64).to(_DTYPES[dtype])


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
                  "instead of doubling the ranks it has heard from every round.", weight=2,
                  needs=(MATCH,)),
        Criterion("bandwidth_power_of_two", "on 4 ranks each rank sends 2 (N - 1) / N of the "
                  "tensor's bytes, no more than a ring",
                  "A rank sent more bytes than a ring: every round carried the whole tensor, "
                  "log2 N full copies, although after each round a pair has less left to "
                  "reduce than before.", needs=(MATCH,)),
        Criterion("bounded_bytes_other_sizes", "on 3 and 5 ranks no rank sends more than the "
                  "largest power of two below N would need, plus one copy of the tensor",
                  "With N not a power of two some rank sent far more than the power of two "
                  "below N needs: the extra ranks took part in every round, and every rank paid "
                  "for them.", needs=(MATCH,)),
        no_delegation(MATCH), no_deadlock(MATCH),
    )
    notes = (f"tolerances (rtol, atol): float32 {tolerance('gloo', torch.float32, 'collective')}, "
             f"bfloat16 {tolerance('gloo', torch.bfloat16, 'collective')}; cases are fresh random "
             "tensors on each run",)

    def make_inputs(self, rng, world_size):
        gens = [torch.Generator().manual_seed(rng.getrandbits(62)) for _ in range(world_size)]
        per_rank = [{"cases": []} for _ in range(world_size)]
        for crit, shape, dtype in _shapes(world_size, rng):
            for r in range(world_size):
                per_rank[r]["cases"].append({"crit": crit, "case": f"shape {shape}, {dtype}",
                                             "x": _random(shape, dtype, gens[r])})
        return per_rank

    @staticmethod
    def rank_run(link, learner, inputs):
        fn, out = learner["main"], []
        for c in inputs["cases"]:
            x = c["x"].clone()
            ptr, shape = x.data_ptr(), tuple(x.shape)
            begin(link, c["case"])
            fn(x)
            out.append({"x": x, "same": x.data_ptr() == ptr and tuple(x.shape) == shape})
        return out

    def judge(self, ws, inputs, outputs, events):
        from dpcourse.grading import oracles

        recs = []
        for k, case in enumerate(inputs[0]["cases"]):
            name, crit = case["case"], case["crit"]
            want = oracles.all_reduce_sum([inputs[r]["cases"][k]["x"] for r in range(ws)])
            rtol, atol = tolerance("gloo", want.dtype, "collective")
            nbytes = want.numel() * want.element_size()
            for r in range(ws):
                got = outputs[r][k]
                diff = mismatch(got["x"], want, rtol, atol)
                recs.append(CaseVerdict(crit, not diff, f"rank {r}: {diff}", name))
                if want.numel() > 1:
                    recs.append(CaseVerdict("in_place", got["same"], "the tensor was replaced instead "
                                       "of updated in place", name))
                if crit != MATCH:
                    continue  # rounds and bytes are judged where every message is non-empty
                sends = [e for e in events_of(events[r], name) if e["op"] == "send"]
                recs.append(CaseVerdict("log_rounds", len(sends) <= round_limit(ws),
                                   f"rank {r} sent {len(sends)} messages, at most "
                                   f"{round_limit(ws)} allowed on {ws} ranks", name))
                sent = sum(e["nbytes"] for e in sends)
                if largest_power_of_two(ws) == ws:
                    need = 2 * (ws - 1) * nbytes // ws
                    recs.append(CaseVerdict("bandwidth_power_of_two", sent == need,
                                       f"rank {r} sent {sent} bytes of a {nbytes}-byte tensor, "
                                       f"expected {need}", name))
                else:
                    limit = byte_limit(ws, nbytes)
                    recs.append(CaseVerdict("bounded_bytes_other_sizes", sent <= limit,
                                       f"rank {r} sent {sent} bytes of a {nbytes}-byte tensor, "
                                       f"at most {limit:g} allowed", name))
        return recs
