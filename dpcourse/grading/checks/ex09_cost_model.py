"""Exercise 09: the alpha-beta cost of the ring, and of an all-reduce lesson 09 did not price.

Part 1 writes lesson 09's ring formula as code. Part 2 prices exercise 04's
halving-doubling all-reduce from its structure: ``log2 p`` halving rounds and as
many doubling rounds among the largest power of two ``p <= N`` ranks, and, when
``N > p``, one whole-tensor message into the rounds and one out of them for the
ranks that sit out. The expected times come from :func:`halving_doubling_time`;
``tests/test_exercise_texts.py`` holds it against the messages the exercise's
solution really sends, replayed with the same alpha and beta.
"""

from __future__ import annotations

import math

from dpcourse.grading.checks.base import CaseVerdict, Exercise, begin, follow_causes
from dpcourse.grading.criteria import Criterion, no_delegation

HD = "halving_doubling"


def halving_doubling_time(nbytes: float, world_size: int, alpha: float, beta: float) -> float:
    """Return the alpha-beta time of exercise 04's halving-doubling all-reduce.

    ``2 log2(p) alpha + 2 (p - 1) / p nbytes beta`` among the largest power of two
    ``p <= N`` ranks, plus ``2 (alpha + nbytes beta)`` when ``N > p`` (the whole tensor
    into the rounds and the sum back out).
    """
    return sum(_hd_parts(nbytes, world_size, alpha, beta))


def _hd_parts(nbytes: float, n: int, alpha: float, beta: float) -> tuple[float, float]:
    """The rounds among ``p`` ranks, and the hand-over of the ranks that sit out."""
    p = 1 << (int(n).bit_length() - 1)
    rounds = 2 * (p.bit_length() - 1) * alpha + 2 * (p - 1) / p * nbytes * beta
    return rounds, (2 * (alpha + nbytes * beta) if n > p else 0.0)


def _slips(nbytes: float, n: int, alpha: float, beta: float) -> dict:
    """Times that common slips give for ``n`` ranks, by slip (keys of :data:`_SLIPS`)."""
    rounds, handoff = _hd_parts(nbytes, n, alpha, beta)
    slips = {"one_phase": rounds / 2 + handoff,
             "ring": 2 * (n - 1) * alpha + 2 * (n - 1) / n * nbytes * beta}
    if handoff:
        slips["real_log"] = 2 * math.log2(n) * alpha + 2 * (n - 1) / n * nbytes * beta
        slips["no_handoff"] = rounds
    return slips


_SLIPS = {  # slip: (what the detail calls it, the hint)
    "one_phase": ("the time of the halving rounds alone",
                  "Your time is half of it: the halving rounds leave each rank with one finished "
                  "part, and the doubling rounds, as many and as large in reverse, bring the "
                  "others back."),
    "real_log": ("the time with log2 N rounds among all N ranks",
                 "Your time uses log2 N rounds for an N that is not a power of two: rounds come "
                 "in whole numbers, and only p ranks (the largest power of two <= N) run them; "
                 "the others hand over their whole tensor before and get the sum back after."),
    "no_handoff": ("the time without the ranks that sit out",
                   "Your time leaves out the ranks that sit out: their whole tensor goes to a "
                   "partner before the rounds and the sum comes back after them, two messages "
                   "of the full size on the chain every rank waits for."),
    "ring": ("the ring's time",
             "Your time is the ring's, with its steps and its bytes: count the halving-doubling's "
             "own rounds instead, and the bytes in each."),
}


class RingCost(Exercise):
    """``ring_all_reduce_time(nbytes, world_size, alpha, beta)``: the alpha-beta estimate."""

    name, exercise, title = "ring_cost", "09", "Cost of an all-reduce, from its structure"
    defines = (("main", "ring_all_reduce_time"), ("bytes_per_rank", "ring_bytes_per_rank"),
               (HD, "halving_doubling_time"))
    criteria = (
        Criterion("matches_alpha_beta", "the ring's time with latency and bandwidth together, "
                  "for sizes from 4 B to 1 GB and 2 to 1024 ranks (part 1)",
                  "The time differs from the model's: the latency and bandwidth criteria each "
                  "isolate one term; the one that fails names the part that is off.", weight=2),
        Criterion("latency_term", "an empty tensor still costs alpha once per ring step",
                  "With zero bytes only latency is left, and yours is off: the count of messages "
                  "a rank waits for one after another, over both phases, differs from the "
                  "ring's."),
        Criterion("bandwidth_term", "with alpha = 0 the time is the bytes one rank sends, at "
                  "beta seconds per byte",
                  "With alpha at 0 the time is off: beta prices the bytes one rank sends, and "
                  "that is not the tensor's size; count what a rank sends over both phases."),
        Criterion("single_rank_is_free", "one rank sends nothing: time 0",
                  "One rank alone was charged time: with no one to exchange with, its ring "
                  "has no step at all.",
                  needs=("matches_alpha_beta",)),
        Criterion("bytes_per_rank", "ring_bytes_per_rank(nbytes, N) is what one rank sends in "
                  "the ring's two phases",
                  "The bytes are off: count the chunks a rank sends in each phase, how large "
                  "each chunk is, and how many phases there are.",
                  requires="bytes_per_rank"),
        Criterion("halving_doubling_power_of_two", "halving_doubling_time is exercise 04's "
                  "halving-doubling on 2 to 1024 ranks, N a power of two (part 2)",
                  "Count the messages a rank waits for one after another (halving, then "
                  "doubling) and the bytes in each: a rank swaps half of what it still holds.",
                  requires=HD, weight=4),
        Criterion("halving_doubling_other_sizes", "halving_doubling_time for N not a power of "
                  "two (3, 5, 6, 1000 ranks and more): the ranks that sit out included",
                  "Only the ranks that run the rounds, p of them, halve and double; the others "
                  "hand their whole tensor to a partner first and get the sum back at the end.",
                  requires=HD, weight=3),
        no_delegation("matches_alpha_beta"),
    )
    notes = ("compared with the alpha-beta model to a relative tolerance of 1e-9, on fresh "
             "random sizes",)

    def make_inputs(self, rng, world_size):
        def size():
            return float(rng.choice([4, 12, 1e6, 4e6, 1e8, 1e9]) * rng.randrange(1, 9))

        cases = [("latency_term", 0.0, n, rng.uniform(1e-6, 1e-5), 1e-9)
                 for n in (2, 3, rng.randrange(4, 64))]
        cases += [("bandwidth_term", size(), n, 0.0, 1 / rng.uniform(1e9, 1e11))
                  for n in (2, 3, rng.randrange(4, 64))]
        cases += [("single_rank_is_free", size(), 1, 5e-6, 1e-9)]
        cases += [("matches_alpha_beta", size(), n, rng.uniform(1e-6, 1e-5),
                   1 / rng.uniform(1e9, 1e11)) for n in (2, 16, 1024, rng.randrange(3, 9))]
        per_rank = [("bytes_per_rank", size(), n) for n in (2, 4, 8, rng.randrange(3, 100), 1)]
        powers = (1, 2, 4, 8, 1024, 2 ** rng.randrange(4, 10))
        others = (3, 5, 6, 1000, rng.choice([n for n in range(9, 1000) if n & (n - 1)]))
        hd = [("halving_doubling_power_of_two", size(), n, rng.uniform(1e-6, 1e-5),
               1 / rng.uniform(1e9, 1e11)) for n in powers]
        hd += [("halving_doubling_other_sizes", size(), n, rng.uniform(1e-6, 1e-5),
                1 / rng.uniform(1e9, 1e11)) for n in others]
        return [{"time": cases, "bytes": per_rank, "hd": hd}]

    @staticmethod
    def rank_run(link, learner, inputs):
        out = {}
        for key, role in (("time", "main"), ("bytes", "bytes_per_rank"), ("hd", HD)):
            fn, out[key] = learner.get(role), []
            for crit, *args in inputs[key] if fn is not None else []:
                begin(link, crit)
                out[key].append(_number(fn(*args)))
        return out

    def judge(self, ws, inputs, outputs, events):
        from dpcourse.grading import oracles

        recs = []
        for key, want_of in (("time", oracles.ring_time), ("bytes", oracles.expected_ring_bytes),
                             ("hd", halving_doubling_time)):
            for (crit, *args), got in zip(inputs[0][key], outputs[0][key]):
                want = want_of(*args)
                detail = f"got {got}, expected {want:.6g}"
                slip = next((k for k, t in _slips(*args).items() if not _close(t, want)
                             and _close(got, t)), None) if key == "hd" else None
                case = ", ".join(f"{k}={v:{f}}" for k, f, v in zip(
                    ("nbytes", "N", "alpha", "beta"), ("g", "d", ".3g", ".3g"), args))
                recs.append(CaseVerdict(crit, _close(got, want), detail + (
                    f" ({_SLIPS[slip][0]})" if slip else ""), case))
        follow_causes(self, recs, _cause)
        return recs


def _cause(rec: CaseVerdict) -> str:
    """The hint for the slip a failing record's detail names, if any."""
    return next((hint for name, hint in _SLIPS.values() if f"({name})" in rec.detail), "")


def _number(x):
    try:
        return float(x)
    except (TypeError, ValueError):
        return f"not a number: {type(x).__name__}"


def _close(got, want) -> bool:
    return isinstance(got, float) and math.isclose(got, want, rel_tol=1e-9, abs_tol=1e-15)
