"""Checks for pure functions: bucket assignment (lesson 05) and the ring's cost model (lesson 09).

These functions do no communication, so they are checked in the calling
process (no ranks to launch) against expectations computed here from first
principles: the bucketing rule of torch DDP's reducer, and the alpha-beta
model of a ring all-reduce.
"""

from __future__ import annotations

import math

import torch

from dpcourse.grading.criteria import Criterion
from dpcourse.grading.runner import CheckSpec

MIB = 2**20


def expected_buckets(params, bucket_cap_mb: float) -> list[list[int]]:
    """Return torch DDP's bucket assignment: reverse order, a bucket closes once it holds >= cap.

    Every parameter given is assigned (callers pass only trainable ones), and all
    have one dtype here: torch DDP also keeps dtypes in separate buckets.

    Args:
        params: parameters in registration order.
        bucket_cap_mb: capacity in MiB (0: one bucket per parameter).

    Returns:
        Lists of indices into ``params``, in the order the buckets become ready.
    """
    cap, buckets, current, size = bucket_cap_mb * MIB, [], [], 0
    for i in reversed(range(len(params))):
        current.append(i)
        size += params[i].numel() * params[i].element_size()
        if size >= cap:
            buckets.append(current)
            current, size = [], 0
    if current:
        buckets.append(current)
    return buckets


def _params(sizes, dtype=torch.float32) -> list[torch.nn.Parameter]:
    return [torch.nn.Parameter(torch.zeros(n, dtype=dtype)) for n in sizes]


class AssignBuckets(CheckSpec):
    """``assign_buckets(params, bucket_cap_mb) -> list[list[int]]``, DDP's bucketing rule."""

    name, exercise, title = "assign_buckets", "05", "Bucket assignment"
    in_rank = False
    forbidden = ("dpcourse.ddp.buckets.assign_buckets", "dpcourse.ddp.assign_buckets",
                 "dpcourse.costmodel.step.bucket_sizes")
    criteria = (
        Criterion("reverse_order", "parameters are taken last to first (the order backward "
                  "produces their gradients)", "Iterate over reversed(range(len(params))): the "
                  "last layer's gradients are ready first, so they go in the first bucket."),
        Criterion("covers_each_param_once", "every parameter is in exactly one bucket",
                  "Add every index exactly once; keep the last, partly filled bucket too."),
        Criterion("closes_at_cap", "a bucket closes as soon as it holds at least bucket_cap_mb MiB",
                  "Add the parameter first, then close the bucket when its size in bytes is >= "
                  "bucket_cap_mb * 2**20; the last, partly filled bucket is kept too."),
        Criterion("cap_zero_one_per_param", "bucket_cap_mb=0 gives one bucket per parameter",
                  "With a cap of 0 bytes every bucket is full after its first parameter."),
        Criterion("counts_bytes_not_elements", "sizes are counted in bytes (float16 and float64 "
                  "models)", "Use p.numel() * p.element_size(): a float64 gradient takes twice "
                  "the bytes of a float32 one, a float16 gradient half."),
    )

    def run(self, rec, assign, extras, reference):
        mf = MIB // 4  # float32 elements in one MiB
        cases = [
            ("closes_at_cap", _params([10, mf // 2, mf // 2, 7, mf, 3]), 1.0),
            ("closes_at_cap", _params([100, 200, 300, 400, 500]), 1000 * 4 / MIB),
            ("closes_at_cap", _params([5] * 9), 25.0),
            ("cap_zero_one_per_param", _params([3, 1, 4, 1, 5]), 0.0),
            ("covers_each_param_once", _params([8] * 7), 64 / MIB),
            ("counts_bytes_not_elements", _params([64, 64, 64, 64], torch.float64), 600 / MIB),
            ("counts_bytes_not_elements", _params([64, 64, 64, 64, 64], torch.float16), 200 / MIB),
        ]
        for crit, params, cap in cases:
            case = f"{len(params)} params of {[p.numel() for p in params]} elements, cap " \
                   f"{cap * MIB:g} bytes"
            with rec.case(crit, case):
                got = assign(params, cap)
            want = expected_buckets(params, cap)
            try:
                got = [[int(i) for i in b] for b in got]
            except TypeError:
                rec.record(crit, False, f"expected a list of lists of indices, got {got!r}", case)
                continue
            flat = [i for b in got for i in b]
            rec.record("reverse_order", flat == sorted(flat, reverse=True),
                       f"indices in the order {flat}", case)
            rec.record("covers_each_param_once", sorted(flat) == list(range(len(params))),
                       f"buckets hold {sorted(flat)}, parameters are 0..{len(params) - 1}", case)
            rec.record(crit, got == want, f"got {got}, expected {want}", case)


def _alpha_beta(nbytes, n, alpha, beta) -> float:
    return 0.0 if n == 1 else 2 * (n - 1) * alpha + 2 * (n - 1) / n * nbytes * beta


class RingCost(CheckSpec):
    """``ring_all_reduce_time(nbytes, world_size, alpha, beta)``: the alpha-beta estimate."""

    name, exercise, title = "ring_cost", "09", "Cost of a ring all-reduce"
    in_rank = False
    forbidden = tuple(f"dpcourse.costmodel.{p}" for p in (
        "alphabeta.ring_bytes_per_rank", "alphabeta.AlphaBeta", "alphabeta.latency_terms",
        "limits.allreduce_traffic", "ring_bytes_per_rank", "AlphaBeta"))
    criteria = (
        Criterion("bytes_per_rank", "ring_bytes_per_rank(nbytes, N) = 2 (N - 1) / N * nbytes",
                  "Each phase sends N - 1 chunks of nbytes / N; there are two phases.",
                  requires="bytes_per_rank"),
        Criterion("latency_term", "an empty tensor still costs 2 (N - 1) alpha (one message per "
                  "ring step)", "The ring has 2 (N - 1) sequential steps; each pays alpha."),
        Criterion("bandwidth_term", "with alpha = 0 the time is 2 (N - 1) / N * nbytes * beta",
                  "beta is seconds per byte: multiply the bytes each rank sends by beta."),
        Criterion("single_rank_is_free", "one rank sends nothing: time 0",
                  "With N = 1 there are no steps: 2 (N - 1) = 0."),
        Criterion("matches_alpha_beta", "alpha + beta together, for sizes from 4 B to 1 GB and "
                  "2 to 1024 ranks", "time = 2 (N - 1) alpha + 2 (N - 1) / N * nbytes * beta."),
    )
    notes = ("compared with the alpha-beta model to a relative tolerance of 1e-9",)

    def run(self, rec, time_fn, extras, reference):
        def close(a, b):
            return math.isclose(float(a), float(b), rel_tol=1e-9, abs_tol=1e-15)

        if "bytes_per_rank" in extras:
            for nbytes, n in [(4e6, 2), (4e6, 4), (1e9, 8), (12, 3), (1e6, 1)]:
                case = f"nbytes={nbytes:g}, N={n}"
                with rec.case("bytes_per_rank", case):
                    got = extras["bytes_per_rank"](nbytes, n)
                want = 2 * (n - 1) / n * nbytes
                rec.record("bytes_per_rank", close(got, want), f"got {got}, expected {want:g}",
                           case)
        groups = {
            "latency_term": [(0, n, 5e-6, 1e-9) for n in (2, 3, 8)],
            "bandwidth_term": [(nb, n, 0.0, 1 / 50e9) for nb, n in ((1e8, 2), (4e6, 8), (1e9, 3))],
            "single_rank_is_free": [(1e9, 1, 5e-6, 1e-9)],
            "matches_alpha_beta": [(4, 2, 1e-5, 1e-10), (1e6, 16, 2e-6, 1 / 25e9),
                                   (1e9, 1024, 3e-6, 1 / 100e9), (123456, 3, 7e-6, 2e-10)],
        }
        for crit, cases in groups.items():
            for nbytes, n, alpha, beta in cases:
                case = f"nbytes={nbytes:g}, N={n}, alpha={alpha:g}, beta={beta:g}"
                with rec.case(crit, case):
                    got = time_fn(nbytes, n, alpha, beta)
                want = _alpha_beta(nbytes, n, alpha, beta)
                rec.record(crit, close(got, want), f"got {got}, expected {want:.6g} s", case)
