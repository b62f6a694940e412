"""Verdicts of exercise 05, part 1: buckets that never hold more than their cap.

The rule (exercise 05's, not lesson 05's): gradients are bucketed in the order
backward produces them (last parameter first), never split; a gradient that
would take the open bucket past the cap closes it and opens the next one; a
gradient larger than the cap is a bucket of its own. Lesson 05's rule, and
torch DDP's ``dist._compute_bucket_assignment_by_size``, keep the gradient that
crosses the cap in the bucket instead; the cases of
:class:`~dpcourse.grading.checks.ex05_bucketing.AssignBuckets` include ones
where the two rules differ (``tests/test_exercise_05_transfer.py`` asks torch).

Only the grader's process imports this module (graded ranks cannot import a
``*_verdicts`` module).
"""

from __future__ import annotations

from dpcourse.grading import oracles
from dpcourse.grading.checks import bucket_cases
from dpcourse.grading.checks.base import CaseVerdict, failed

MIB = 2**20
BYTES = "counts_bytes_not_elements"
_CROSSED = "crossed the cap and stayed in it"
_ALREADY_OVER = "was over the cap before its last gradient joined"
_JOINED_BEFORE = "joined the bucket open before it"
_JOINED_AFTER = "gradients after it joined it"
_EXACT = "to exactly the cap"
_EMPTY = "is empty"
_ELEMENTS = "every element counted as 4 bytes"
_LESSON = "lesson 05's rule, which keeps the gradient that crosses the cap"


def buckets_within_cap(nbytes: list[int], bucket_cap_mb: float,
                       strict: bool = False) -> list[list[int]]:
    """Return the buckets of exercise 05's rule, as indices, last parameter first.

    Args:
        nbytes: each parameter's gradient size in bytes, in registration order.
        bucket_cap_mb: the most a bucket of several gradients may hold, in MiB.
        strict: also refuse a gradient that would fill the bucket to exactly the cap
            (a mistake, computed to recognise it).

    Returns:
        Lists of indices into ``nbytes``, in the order the buckets are complete.
    """
    cap = bucket_cap_mb * MIB
    out: list[list[int]] = []
    current: list[int] = []
    size = 0
    for i in reversed(range(len(nbytes))):
        total = size + nbytes[i]
        if current and (total > cap or (strict and total == cap)):
            out.append(current)  # no room for gradient i: it opens the next bucket
            current, size = [], 0
        current.append(i)
        size += nbytes[i]
    return out + ([current] if current else [])


def _bytes(bucket: list[int], nbytes: list[int]) -> int:
    return sum(nbytes[i] for i in bucket)


def _over_cap(got, nbytes, cap, name) -> CaseVerdict:
    for b in got:
        if len(b) < 2 or any(nbytes[i] > cap for i in b):
            continue  # a single gradient, or one larger than the cap: oversized_alone's cases
        size = _bytes(b, nbytes)
        if size > cap:
            how = (f"its last gradient, {b[-1]} ({nbytes[b[-1]]} bytes), {_CROSSED}"
                   if size - nbytes[b[-1]] <= cap else f"it {_ALREADY_OVER}")
            return CaseVerdict("never_over_cap", False,
                               f"bucket {b} holds {size} bytes, more than the cap of {cap:.0f}: "
                               f"{how}", name)
    return CaseVerdict("never_over_cap", True, f"every bucket of several gradients fits in "
                       f"{cap:.0f} bytes", name)


def _oversized(got, nbytes, cap, name) -> CaseVerdict | None:
    big = [i for i in range(len(nbytes)) if nbytes[i] > cap]
    if not big:
        return None
    for b in got:
        for i in b:
            if i in big and len(b) > 1:
                how = _JOINED_BEFORE if b[-1] == i else _JOINED_AFTER
                return CaseVerdict("oversized_alone", False,
                                   f"gradient {i} ({nbytes[i]} bytes, more than the cap of "
                                   f"{cap:.0f}) shares bucket {b}: {how}", name)
    return CaseVerdict("oversized_alone", True, f"gradients {big} are larger than the cap, each "
                       "alone in its bucket", name)


def _closed_early(got, nbytes, cap, name) -> CaseVerdict:
    for b, after in zip(got, got[1:]):
        if not b or not after:
            continue  # an empty bucket is covers_each_param_once's mistake
        size, nxt = _bytes(b, nbytes), after[0]
        if size + nbytes[nxt] <= cap:
            exact = f" ({_EXACT})" if size + nbytes[nxt] == cap else ""
            return CaseVerdict("fills_up_to_cap", False,
                               f"bucket {b} ({size} bytes) was closed, though the next "
                               f"gradient, {nxt} ({nbytes[nxt]} bytes), fitted: together "
                               f"{size + nbytes[nxt]} of {cap:.0f} bytes{exact}", name)
    return CaseVerdict("fills_up_to_cap", True, "every bucket closed only when the next gradient "
                       "did not fit", name)


def _covers(got, n, name) -> CaseVerdict:
    flat = [i for b in got for i in b]
    if [] in got:
        return CaseVerdict("covers_each_param_once", False,
                           f"bucket {got.index([])} of {got} {_EMPTY}", name)
    return CaseVerdict("covers_each_param_once", sorted(flat) == list(range(n)),
                       f"buckets hold {sorted(flat)}, parameters are 0..{n - 1}", name)


def judge(ws, inputs, outputs, events) -> list[CaseVerdict]:
    """Judge every case: the float32 ones by the rule's parts, the others by bytes."""
    recs, later = [], []
    for case, got in zip(inputs[0]["cases"], outputs[0]):
        nbytes, cap = bucket_cases.case_nbytes(case), case["cap"] * MIB
        n = len(nbytes)
        name = f"{n} {case['dtype']} gradients of {case['sizes']} elements, cap {cap:.0f} bytes"
        if (wrong := bucket_cases.not_index_lists(got, case["crit"], name)) is not None:
            recs.append(wrong)
            continue
        if case["dtype"] != "float32":
            want = buckets_within_cap(nbytes, case["cap"])
            detail = f"got {got}, expected {want}"
            if got != want and got == buckets_within_cap([4 * s for s in case["sizes"]],
                                                         case["cap"]):
                detail += f" (the buckets of this rule with {_ELEMENTS})"
            elif got != want and got == oracles.buckets(nbytes, case["cap"]):
                detail += f" (the buckets of {_LESSON})"
            later.append(CaseVerdict(BYTES, got == want, detail, name))
            continue
        flat = [i for b in got for i in b]
        recs.append(CaseVerdict("reverse_order", bool(flat) and flat == sorted(flat, reverse=True),
                                f"indices in the order {flat}", name))
        recs.append(_covers(got, n, name))
        if not all(0 <= i < n for i in flat):
            continue  # sizes of indices that do not exist: the covering verdict says so
        recs.append(_over_cap(got, nbytes, cap, name))
        if (big := _oversized(got, nbytes, cap, name)) is not None:
            recs.append(big)
        recs.append(_closed_early(got, nbytes, cap, name))
    return recs + later  # bytes last: their hint depends on what the float32 cases showed


HINTS = {
    _CROSSED: ("A bucket holds more than the cap: the gradient that crossed the cap stayed in "
               "it, as in lesson 05 and torch DDP. Here the buffer has no room for it, so it "
               "opens the next bucket."),
    _LESSON: ("The float16 and float64 models got lesson 05's buckets: the gradient that "
              "crossed the cap stayed in its bucket. Here the buffer has no room for it, so it "
              "opens the next bucket."),
    _ALREADY_OVER: ("A bucket went on taking gradients after it was over the cap: the size "
                    "that decides whether a gradient fits is the bucket's bytes so far plus "
                    "that gradient's."),
    _JOINED_BEFORE: ("A gradient larger than the cap shares a bucket with the ones before it, "
                     "as lesson 05's rule would put it: it fits in no buffer, so it cannot "
                     "share one. It is all-reduced alone, and the bucket open before it closes."),
    _JOINED_AFTER: ("Gradients joined a bucket that holds a gradient larger than the cap: that "
                    "bucket is over the cap already, so nothing more fits in it."),
    _EXACT: ("A bucket was closed though the next gradient would fill it to exactly the cap: "
             "the buffer holds bucket_cap_mb MiB, so that gradient fits."),
    _EMPTY: ("An empty bucket: a gradient larger than the cap arrived while the open bucket was "
             "still empty (the first gradient, or any with a cap of 0), and that empty bucket "
             "was closed anyway. Only a bucket that holds something can be full."),
    _ELEMENTS: ("Only the float16 and float64 models fail: sizes were counted in elements of 4 "
                "bytes, but the cap is in bytes, and an element's bytes depend on the dtype."),
}


def cause(spec, ws: int, rec: CaseVerdict) -> str:
    """The hint for the cause of a failing record (see ``follow_causes``)."""
    if rec.criterion == BYTES:
        if any(failed(spec, c) for c in ("never_over_cap", "oversized_alone", "fills_up_to_cap",
                                         "covers_each_param_once", "reverse_order")):
            return ("The float16 and float64 models fail for the reason the float32 ones show "
                    "(the criteria above): fix those first.")
        return next((HINTS[m] for m in (_ELEMENTS, _LESSON) if m in rec.detail), "")
    return next((hint for marker, hint in HINTS.items() if marker in rec.detail), "")
