"""Exercise 09: the alpha-beta cost of a ring all-reduce (pure functions)."""

from __future__ import annotations

import math

from dpcourse.grading.checks.base import Exercise, Record, begin
from dpcourse.grading.criteria import Criterion, no_delegation


class RingCost(Exercise):
    """``ring_all_reduce_time(nbytes, world_size, alpha, beta)``: the alpha-beta estimate."""

    name, exercise, title = "ring_cost", "09", "Cost of a ring all-reduce"
    defines = (("main", "ring_all_reduce_time"), ("bytes_per_rank", "ring_bytes_per_rank"))
    criteria = (
        Criterion("matches_alpha_beta", "the ring's time with latency and bandwidth together, "
                  "for sizes from 4 B to 1 GB and 2 to 1024 ranks",
                  "The time differs from the model's: the latency and bandwidth criteria each "
                  "isolate one term; the one that fails names the part that is off.", weight=3),
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
        per_rank = [(size(), n) for n in (2, 4, 8, rng.randrange(3, 100), 1)]
        return [{"time": cases, "bytes": per_rank}]

    @staticmethod
    def rank_run(link, learner, inputs):
        out = {"time": [], "bytes": []}
        fn = learner["main"]
        for crit, nbytes, n, alpha, beta in inputs["time"]:
            begin(link, crit)
            out["time"].append(_number(fn(nbytes, n, alpha, beta)))
        fn = learner.get("bytes_per_rank")
        for nbytes, n in inputs["bytes"] if fn is not None else []:
            begin(link, "bytes_per_rank")
            out["bytes"].append(_number(fn(nbytes, n)))
        return out

    def judge(self, ws, inputs, outputs, events):
        from dpcourse.grading import oracles

        recs = []
        for (crit, nbytes, n, alpha, beta), got in zip(inputs[0]["time"], outputs[0]["time"]):
            want = oracles.ring_time(nbytes, n, alpha, beta)
            case = f"nbytes={nbytes:g}, N={n}, alpha={alpha:.3g}, beta={beta:.3g}"
            recs.append(Record(crit, _close(got, want), f"got {got}, expected {want:.6g} s",
                               case))
        for (nbytes, n), got in zip(inputs[0]["bytes"], outputs[0]["bytes"]):
            want = oracles.ring_bytes_per_rank(nbytes, n)
            recs.append(Record("bytes_per_rank", _close(got, want),
                               f"got {got}, expected {want:g}", f"nbytes={nbytes:g}, N={n}"))
        return recs


def _number(x):
    try:
        return float(x)
    except (TypeError, ValueError):
        return f"not a number: {type(x).__name__}"


def _close(got, want) -> bool:
    return isinstance(got, float) and math.isclose(got, want, rel_tol=1e-9, abs_tol=1e-15)
