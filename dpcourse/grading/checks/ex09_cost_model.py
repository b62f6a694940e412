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
        Criterion("matches_alpha_beta", "alpha + beta together, for sizes from 4 B to 1 GB and "
                  "2 to 1024 ranks", "time = 2 (N - 1) alpha + 2 (N - 1) / N * nbytes * beta.",
                  weight=3),
        Criterion("latency_term", "an empty tensor still costs 2 (N - 1) alpha (one message per "
                  "ring step)", "The ring has 2 (N - 1) sequential steps; each pays alpha."),
        Criterion("bandwidth_term", "with alpha = 0 the time is 2 (N - 1) / N * nbytes * beta",
                  "beta is seconds per byte: multiply the bytes each rank sends by beta."),
        Criterion("single_rank_is_free", "one rank sends nothing: time 0",
                  "With N = 1 there are no steps: 2 (N - 1) = 0.",
                  needs=("matches_alpha_beta",)),
        Criterion("bytes_per_rank", "ring_bytes_per_rank(nbytes, N) = 2 (N - 1) / N * nbytes",
                  "Each phase sends N - 1 chunks of nbytes / N; there are two phases.",
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
