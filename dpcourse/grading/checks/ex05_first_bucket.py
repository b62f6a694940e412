"""Exercise 05, part 2: torch DDP's small first bucket; frozen parameters left out.

torch DDP gives the bucket that is all-reduced first a smaller cap
(``first_bucket_bytes_cap``, 1 MiB when ``bucket_cap_mb`` is left at its
default), so communication starts early in backward; every later bucket closes
at ``bucket_cap_mb``. Parameters that never get a gradient
(``requires_grad=False``) are in no bucket. The expected assignment comes from
an independent rule (:func:`dpcourse.grading.oracles.buckets_with_first`); the tests compare
that rule with torch's own ``dist._compute_bucket_assignment_by_size`` and with
the buckets a real torch DDP run all-reduces.
"""

from __future__ import annotations

from dpcourse.grading.checks import bucket_cases, ddp_common as d
from dpcourse.grading.checks.base import Exercise, CaseVerdict, begin
from dpcourse.grading.criteria import Criterion, no_delegation

MIB = d.MIB


class FirstBucket(Exercise):
    """``assign_buckets_like_torch(params, bucket_cap_mb, first_bucket_mb) -> list[list[int]]``."""

    name, exercise, title = "first_bucket", "05", "Bucket assignment with torch's first bucket"
    defines = (("main", "assign_buckets_like_torch"),)
    criteria = (
        Criterion("first_bucket_small", "the bucket all-reduced first closes at first_bucket_mb",
                  "Which bucket goes out first? The one holding the gradients backward produces "
                  "first. Only that one gets the small cap; its job is to start communication "
                  "early.", weight=2),
        Criterion("later_buckets_use_cap", "every bucket after the first closes at bucket_cap_mb "
                  "(checked from wherever your first bucket ended)",
                  "The first bucket is right but later ones close at the wrong place: they were "
                  "cut with the small cap too, or with a cap that counts the first bucket's "
                  "bytes.", weight=2),
        Criterion("frozen_left_out", "parameters with requires_grad=False are in no bucket; "
                  "every other index is in exactly one",
                  "A frozen parameter is in a bucket, or the indices are shifted: a frozen "
                  "parameter never gets a gradient, so no hook would ever complete its bucket, "
                  "and the indices refer to the list you were given, frozen ones included."),
        Criterion("matches_torch_rule", "the whole assignment equals torch DDP's (float32, "
                  "float64, frozen parameters, first_bucket_mb = 0)",
                  "Check the other criteria first; each names one cause. Sizes count bytes, "
                  "not elements.",
                  weight=2),
        no_delegation("matches_torch_rule"),
    )
    notes = ("cases include fresh random parameter sizes on each run",)

    def make_inputs(self, rng, world_size):
        mf = MIB // 4  # float32 elements in one MiB
        sizes = [rng.randrange(100, 2000) for _ in range(8)]
        cases = [  # (sizes, dtype, frozen, bucket_cap_mb, first_bucket_mb)
            ([3 * mf, 5 * mf, 100, mf // 2, mf // 2, 10], "float32", [], 25.0, 1.0),
            ([10, mf // 2, mf // 2, 7, mf, 3, mf // 4], "float32", [], 1.0, 0.25),
            (sizes, "float32", [], sum(sizes[:3]) * 4 / MIB, sizes[-1] * 2 / MIB),
            ([5, 6, 7, 8, 9], "float32", [], 40 / MIB, 0.0),
            ([64] * 8, "float64", [], 1500 / MIB, 600 / MIB),
            ([1000, 1000, 30, 1000, 20, 1000], "float32", [4, 5], 4000 / MIB, 1000 / MIB),
            ([200] * 6, "float32", [0, 3], 1000 / MIB, 900 / MIB),
        ]
        return [{"cases": [{"sizes": s, "dtype": d, "frozen": f, "cap": c, "first": first}
                           for s, d, f, c, first in cases]}]

    @staticmethod
    def rank_run(link, learner, inputs):
        assign, out = learner["main"], []
        for case in inputs["cases"]:
            params = bucket_cases.zero_params(case["sizes"], case["dtype"], case["frozen"])
            begin(link, "matches_torch_rule")
            got = assign(params, bucket_cap_mb=case["cap"], first_bucket_mb=case["first"])
            out.append(bucket_cases.index_lists(got))
        return out

    def judge(self, ws, inputs, outputs, events):
        from dpcourse.grading.oracles import buckets_with_first, close_by_caps

        recs = []
        for case, got in zip(inputs[0]["cases"], outputs[0]):
            nbytes = bucket_cases.case_nbytes(case)
            trainable = [i not in case["frozen"] for i in range(len(nbytes))]
            name = (f"{case['sizes']} elements of {case['dtype']}"
                    + (f", frozen {case['frozen']}" if case["frozen"] else "")
                    + f", cap {case['cap'] * MIB:g} B, first {case['first'] * MIB:g} B")
            want = buckets_with_first(nbytes, trainable, case["cap"], case["first"])
            if (wrong := bucket_cases.not_index_lists(got, "matches_torch_rule", name)) is not None:
                recs.append(wrong)
                continue
            flat = [i for b in got for i in b]
            expected_members = sorted(i for b in want for i in b)
            recs.append(CaseVerdict("frozen_left_out", sorted(flat) == expected_members,
                               f"buckets hold {sorted(flat)}, the trainable parameters are "
                               f"{expected_members}", name))
            recs.append(CaseVerdict("matches_torch_rule", got == want, f"got {got}, expected {want}",
                               name))
            if case["frozen"]:
                continue  # a frozen parameter in a bucket is its own mistake: caps judged elsewhere
            recs.append(CaseVerdict("first_bucket_small", bool(got) and got[0] == want[0],
                               f"first bucket {got[0] if got else None}, expected {want[0]}",
                               name))
            if got and all(0 <= i < len(nbytes) for i in flat):  # the closing rule, your order
                rest = close_by_caps(flat[len(got[0]):], nbytes, [case["cap"] * MIB])
                recs.append(CaseVerdict("later_buckets_use_cap", got[1:] == rest,
                                   f"after your first bucket {got[0]}: got {got[1:]}, expected "
                                   f"{rest}", name))
        return recs
