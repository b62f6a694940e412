"""Exercise 05, part 1: buckets that never hold more than their cap (a pure function).

Lesson 05's buckets (and torch DDP's) close once they reach the cap, with the
gradient that crossed it inside, so a bucket may exceed the cap by one tensor.
Here the all-reduce works from a staging buffer of ``bucket_cap_mb`` MiB, so a
bucket must fit in it: the learner carries the lesson's reasons (backward's
order, tensors never split, sizes in bytes) over to a closing rule the lesson
did not state. The verdicts live in :mod:`dpcourse.grading.checks.bucket_verdicts`.
"""

from __future__ import annotations

from dpcourse.grading.checks import bucket_cases
from dpcourse.grading.checks.base import Exercise, begin
from dpcourse.grading.checks.ddp_common import MIB
from dpcourse.grading.criteria import Criterion, no_delegation


class AssignBuckets(Exercise):
    """``assign_buckets_within_cap(params, bucket_cap_mb) -> list[list[int]]``."""

    name, exercise, title = "buckets_within_cap", "05", "Buckets that fit their buffer"
    defines = (("main", "assign_buckets_within_cap"),)
    criteria = (
        Criterion("never_over_cap", "no bucket of several gradients holds more than "
                  "bucket_cap_mb MiB", "A bucket holds more than the cap: a gradient joined it "
                  "without room for it.", weight=3),
        Criterion("fills_up_to_cap", "a bucket closes only when the next gradient would take "
                  "it past the cap (one that fills it to exactly the cap still goes in)",
                  "A bucket was closed while the next gradient still fitted: a bucket closes "
                  "only when the next gradient would take it past the cap.", weight=2),
        Criterion("oversized_alone", "a gradient larger than the cap is a bucket of its own "
                  "(also with bucket_cap_mb=0)", "A gradient larger than the cap shares a "
                  "bucket: it fits in no buffer, so it is all-reduced alone.", weight=2),
        Criterion("reverse_order", "gradients are taken last parameter to first (the order "
                  "backward produces them), each bucket a run of neighbours",
                  "The first bucket holds the first layers, or a bucket skips a gradient: "
                  "backward produces gradients from the last layer to the first, and a bucket "
                  "can go out only once every gradient in it has arrived."),
        Criterion("covers_each_param_once", "every parameter is in exactly one bucket, and no "
                  "bucket is empty", "An index is missing or appears twice: most often the "
                  "last, partly filled bucket was dropped when the loop ended."),
        Criterion("counts_bytes_not_elements", "sizes are counted in bytes (float16 and float64 "
                  "models)", "Only the float16 and float64 models fail: the cap is in bytes, "
                  "and an element's bytes depend on the dtype.", weight=2),
        no_delegation("never_over_cap"),
    )
    verdicts = "dpcourse.grading.checks.bucket_verdicts"
    notes = ("cases are fresh random parameter sizes on each run",)

    def make_inputs(self, rng, world_size):
        def sizes(k, lo, hi):
            return [rng.randrange(lo, hi) for _ in range(k)]

        mf = MIB // 4  # float32 elements in one MiB
        exact = sizes(6, 10, 400)
        s64, s16 = sizes(4, 40, 90), sizes(5, 40, 90)
        cases = [  # (criterion the case is for, sizes in elements, dtype, bucket_cap_mb)
            ("never_over_cap", [10, mf // 2, mf // 2, 7, mf, 3], "float32", 1.0),
            ("never_over_cap", [100, 300, 200, 500, 700], "float32", 4000 / MIB),
            ("never_over_cap", sizes(8, 50, 600), "float32", rng.randrange(500, 2000) * 4 / MIB),
            ("never_over_cap", sizes(9, 1, 20), "float32", 25.0),
            # the last three fill the first bucket to exactly the cap
            ("fills_up_to_cap", exact, "float32", sum(exact[-3:]) * 4 / MIB),
            ("oversized_alone", [5, 3 * mf, 7, 2 * mf, 2 * mf, 9], "float32", 1.0),
            ("oversized_alone", [7, 9, 2 * mf], "float32", 1.0),
            ("oversized_alone", sizes(5, 1, 9), "float32", 0.0),
            # the last two fill a bucket exactly when counted in bytes, and not in elements
            ("counts_bytes_not_elements", s64, "float64", (s64[-1] + s64[-2]) * 4 / MIB),
            ("counts_bytes_not_elements", s16, "float16", (s16[-1] + s16[-2]) * 2 / MIB),
        ]
        return [{"cases": [{"crit": c, "sizes": s, "dtype": dt, "cap": cap}
                           for c, s, dt, cap in cases]}]

    @staticmethod
    def rank_run(link, learner, inputs):
        assign, out = learner["main"], []
        for case in inputs["cases"]:
            params = bucket_cases.zero_params(case["sizes"], case["dtype"])
            begin(link, case["crit"])
            out.append(bucket_cases.index_lists(assign(params, case["cap"])))
        return out
