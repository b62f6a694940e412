"""Exercise 05: torch DDP's bucket assignment (a pure function)."""

from __future__ import annotations

from dpcourse.grading.checks import ddp_common as d
from dpcourse.grading.checks.base import Exercise, CaseVerdict, begin
from dpcourse.grading.criteria import Criterion, no_delegation

MIB = d.MIB


class AssignBuckets(Exercise):
    """``assign_buckets(params, bucket_cap_mb) -> list[list[int]]``, DDP's bucketing rule."""

    name, exercise, title = "assign_buckets", "05", "Bucket assignment"
    defines = (("main", "assign_buckets"),)
    criteria = (
        Criterion("closes_at_cap", "a bucket closes as soon as it holds at least bucket_cap_mb "
                  "MiB (also exactly at the cap)", "A bucket closed one parameter early or "
                  "late: the size was compared before the parameter joined it, or a bucket that "
                  "reached the cap exactly stayed open.", weight=3),
        Criterion("reverse_order", "parameters are taken last to first (the order backward "
                  "produces their gradients)", "The first bucket holds the first layers: "
                  "backward produces gradients from the last layer to the first, so buckets "
                  "filled in registration order are the last to complete.",
                  needs=("covers_each_param_once",)),
        Criterion("covers_each_param_once", "every parameter is in exactly one bucket",
                  "An index is missing or appears twice: most often the last, partly filled "
                  "bucket was dropped when the loop ended."),
        Criterion("cap_zero_one_per_param", "bucket_cap_mb=0 gives one bucket per parameter",
                  "With a cap of 0 a bucket held several parameters: a bucket already at the "
                  "cap was left open for the next one."),
        Criterion("counts_bytes_not_elements", "sizes are counted in bytes (float16 and float64 "
                  "models)", "Only the float16 and float64 models fail: sizes were counted in "
                  "elements, but the cap is in bytes, and an element's bytes depend on the "
                  "dtype.", weight=2),
        no_delegation("closes_at_cap"),
    )
    allowed_imports: dict = {}
    notes = ("cases are fresh random parameter sizes on each run",)

    def make_inputs(self, rng, world_size):
        def sizes(k, lo, hi):
            return [rng.randrange(lo, hi) for _ in range(k)]

        mf = MIB // 4
        exact = sizes(6, 10, 400)
        cap_exact = sum(exact[-3:]) * 4 / MIB  # the last three fill the first bucket exactly
        cases = [
            ("closes_at_cap", [10, mf // 2, mf // 2, 7, mf, 3], "float32", 1.0),
            ("closes_at_cap", sizes(7, 50, 600), "float32", rng.randrange(500, 2000) * 4 / MIB),
            ("closes_at_cap", exact, "float32", cap_exact),
            ("closes_at_cap", sizes(9, 1, 20), "float32", 25.0),
            ("cap_zero_one_per_param", sizes(5, 1, 9), "float32", 0.0),
            ("covers_each_param_once", [8] * 7, "float32", 64 / MIB),
            ("counts_bytes_not_elements", sizes(4, 40, 90), "float64", 600 / MIB),
            ("counts_bytes_not_elements", sizes(5, 40, 90), "float16", 200 / MIB),
        ]
        return [{"cases": [{"crit": c, "sizes": s, "dtype": d, "cap": cap}
                           for c, s, d, cap in cases]}]

    @staticmethod
    def rank_run(link, learner, inputs):
        assign, out = learner["main"], []
        for case in inputs["cases"]:
            params = d.zero_params(case["sizes"], case["dtype"])
            begin(link, case["crit"])
            out.append(d.index_lists(assign(params, case["cap"])))
        return out

    def judge(self, ws, inputs, outputs, events):
        from dpcourse.grading import oracles

        recs = []
        for case, got in zip(inputs[0]["cases"], outputs[0]):
            nbytes = d.case_nbytes(case)
            name = (f"{len(nbytes)} {case['dtype']} params of {case['sizes']} elements, cap "
                    f"{case['cap'] * MIB:g} bytes")
            want = oracles.buckets(nbytes, case["cap"])
            if (wrong := d.not_index_lists(got, case["crit"], name)) is not None:
                recs.append(wrong)
                continue
            flat = [i for b in got for i in b]
            recs.append(CaseVerdict("reverse_order", flat == sorted(flat, reverse=True),
                               f"indices in the order {flat}", name))
            recs.append(CaseVerdict("covers_each_param_once", sorted(flat) == list(range(len(nbytes))),
                               f"buckets hold {sorted(flat)}, parameters are "
                               f"0..{len(nbytes) - 1}", name))
            detail = f"got {got}, expected {want}"
            if got != want and got == oracles.buckets(nbytes, case["cap"], strict=True):
                detail += (" (the bucket that reached exactly the cap stayed open: yours "
                           "close only above it)")
            recs.append(CaseVerdict(case["crit"], got == want, detail, name))
        return recs
