"""Check for exercise 05, part 2: torch DDP's small first bucket; frozen parameters left out.

torch DDP gives the bucket that is all-reduced first a smaller cap
(``first_bucket_bytes_cap``, 1 MiB by default), so communication starts
early in backward; every later bucket closes at ``bucket_cap_mb``. Parameters
that never get a gradient (``requires_grad=False``) are in no bucket. The
expected assignment is computed here by an independent rule
(:func:`expected_buckets_with_first`); the tests compare that rule with torch's
own ``dist._compute_bucket_assignment_by_size`` and with the buckets a real
torch DDP run all-reduces.
"""

from __future__ import annotations

import torch

from dpcourse.grading.criteria import Criterion
from dpcourse.grading.inprocess import CheckSpec

MIB = 2**20


def _close_by_caps(indices, params, caps) -> list[list[int]]:
    """Fill buckets along ``indices``; bucket k closes once it holds >= caps[min(k, last)] bytes."""
    buckets, current, size = [], [], 0
    for i in indices:
        current.append(i)
        size += params[i].numel() * params[i].element_size()
        if size >= caps[min(len(buckets), len(caps) - 1)]:
            buckets.append(current)
            current, size = [], 0
    return buckets + ([current] if current else [])


def expected_buckets_with_first(params, bucket_cap_mb: float,
                                first_bucket_mb: float) -> list[list[int]]:
    """Return torch DDP's buckets (in the order they are all-reduced) for ``params``.

    Args:
        params: every parameter of the model, in registration order (frozen ones included).
        bucket_cap_mb: cap of every bucket after the first, in MiB.
        first_bucket_mb: cap of the first bucket, in MiB.

    Returns:
        Lists of indices into ``params``; parameters with ``requires_grad=False`` are in none.
    """
    trainable = [i for i in reversed(range(len(params))) if params[i].requires_grad]
    return _close_by_caps(trainable, params, [first_bucket_mb * MIB, bucket_cap_mb * MIB])


def _params(sizes, dtype=torch.float32, frozen=()) -> list[torch.nn.Parameter]:
    return [torch.nn.Parameter(torch.zeros(n, dtype=dtype), requires_grad=i not in frozen)
            for i, n in enumerate(sizes)]


def _cases():
    mf = MIB // 4  # float32 elements in one MiB
    return [  # (params, bucket_cap_mb, first_bucket_mb)
        (_params([3 * mf, 5 * mf, 100, mf // 2, mf // 2, 10]), 25.0, 1.0),
        (_params([10, mf // 2, mf // 2, 7, mf, 3, mf // 4]), 1.0, 0.25),
        (_params([1000] * 9), 8000 / MIB, 2000 / MIB),
        (_params([5, 6, 7, 8, 9]), 40 / MIB, 0.0),
        (_params([64] * 8, torch.float64), 1500 / MIB, 600 / MIB),
        (_params([1000, 1000, 30, 1000, 20, 1000], frozen=(4, 5)), 4000 / MIB, 1000 / MIB),
        (_params([200] * 6, frozen=(0, 3)), 1000 / MIB, 900 / MIB),
    ]


class FirstBucket(CheckSpec):
    """``assign_buckets_like_torch(params, bucket_cap_mb, first_bucket_mb) -> list[list[int]]``."""

    name, exercise, title = "first_bucket", "05", "Bucket assignment with torch's first bucket"
    in_rank = False
    forbidden = ("dpcourse.ddp.buckets.assign_buckets", "dpcourse.ddp.assign_buckets",
                 "dpcourse.ddp.bucket_order.assign_buckets_in_order",
                 "dpcourse.costmodel.step.bucket_sizes")
    criteria = (
        Criterion("first_bucket_small", "the bucket all-reduced first closes at first_bucket_mb",
                  "Which bucket goes out first? The one holding the gradients backward produces "
                  "first. Only that one gets the small cap; its job is to start communication "
                  "early."),
        Criterion("later_buckets_use_cap", "every bucket after the first closes at bucket_cap_mb "
                  "(checked from wherever your first bucket ended)",
                  "Once the first bucket is closed, continue exactly as in part 1 with "
                  "bucket_cap_mb: the small cap applies to one bucket only."),
        Criterion("frozen_left_out", "parameters with requires_grad=False are in no bucket; "
                  "every other index is in exactly one",
                  "A frozen parameter never gets a gradient, so no hook would ever complete its "
                  "bucket: leave it out, but keep the indices of the list you were given (don't "
                  "renumber after filtering)."),
        Criterion("matches_torch_rule", "the whole assignment equals torch DDP's (7 models: "
                  "float32, float64, frozen parameters, first_bucket_mb = 0)",
                  "Check the other criteria first; sizes are bytes (numel * element_size)."),
    )

    def run(self, rec, assign, extras, reference):
        for params, cap, first in _cases():
            case = (f"{[p.numel() for p in params]} elements of {str(params[0].dtype)[6:]}"
                    + (f", frozen {[i for i, p in enumerate(params) if not p.requires_grad]}"
                       if not all(p.requires_grad for p in params) else "")
                    + f", cap {cap * MIB:g} B, first {first * MIB:g} B")
            with rec.case("matches_torch_rule", case):
                got = assign(params, bucket_cap_mb=cap, first_bucket_mb=first)
            want = expected_buckets_with_first(params, cap, first)
            try:
                got = [[int(i) for i in b] for b in got]
            except TypeError:
                rec.record("matches_torch_rule", False, f"expected a list of lists of indices, "
                           f"got {got!r}", case)
                continue
            flat = [i for b in got for i in b]
            trainable = sorted(i for b in want for i in b)
            rec.record("frozen_left_out", sorted(flat) == trainable,
                       f"buckets hold {sorted(flat)}, the trainable parameters are {trainable}",
                       case)
            rec.record("matches_torch_rule", got == want, f"got {got}, expected {want}", case)
            if len(trainable) < len(params):
                continue  # a frozen parameter in a bucket is its own mistake: caps judged elsewhere
            rec.record("first_bucket_small", bool(got) and got[0] == want[0],
                       f"first bucket {got[0] if got else None}, expected {want[0]}", case)
            if got and all(0 <= i < len(params) for i in flat):
                # the closing rule after the first bucket, along your own order
                rest = _close_by_caps(flat[len(got[0]):], params, [cap * MIB])
                rec.record("later_buckets_use_cap", got[1:] == rest,
                           f"after your first bucket {got[0]}: got {got[1:]}, expected {rest}",
                           case)
