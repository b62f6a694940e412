"""The grader's verdicts on exercise 11, with the references they compute.

:func:`judge` compares what each rank's hook sent, returned and kept
(:func:`~dpcourse.grading.checks.ex11_error_feedback.run_hook_as_reducer`) with torch's
``bf16_compress_hook`` (:func:`dpcourse.grading.oracles.compress_hook`), with
the compression of gradient + previous residual, and with the uncompressed sum
over all steps. Grader-only: graded ranks cannot import this module (see
:mod:`dpcourse.grading.rank`).
"""

from __future__ import annotations

import torch

from dpcourse.grading import oracles
from dpcourse.grading.checks.base import CaseVerdict, compare, describe_ops, events_of
from dpcourse.grading.checks.ex11_error_feedback import (DTYPE, PARAMS, SIZES, STEPS, TRACKING,
                                                      bucket_grads, bucket_layout, per_param)
from dpcourse.grading.criteria import mismatch


def judge(ws, inputs, outputs, events) -> list[CaseVerdict]:
    """Compare every rank's buckets, residuals and bytes sent with the references."""
    recs, label = [], f"world size {ws}"
    # each step's gradients laid out as that step's buckets (rebuilt after the first step)
    grads = [[[g.float() for g in bucket_grads(step, s)] for s, step in
              enumerate(inputs[r]["grads"])] for r in range(ws)]
    steps = [outputs[r]["steps"] for r in range(ws)]
    # First step: torch's hook on the same gradients.
    for i, n in enumerate(SIZES):
        want = oracles.compress_hook([grads[r][0][i] for r in range(ws)], DTYPE)
        recs.append(compare("first_step_is_torchs_hook",
                            [f"rank {r}, bucket of {n}" for r in range(ws)],
                            [steps[r][0]["results"][i] for r in range(ws)], [want] * ws, (0, 0),
                            label))
    for r in range(ws):
        for s in range(STEPS):
            recs.append(_bytes(events[r], s, f"{label}, rank {r}, step {s}"))
    for s in range(STEPS):
        for i, n in enumerate(SIZES):
            where = f"{label}, step {s}, bucket of {n}"
            recs += _step(ws, grads, steps, s, i, where)
    recs.append(_tracking(ws, grads, steps, label))
    return recs


def _bytes(events, s, where) -> CaseVerdict:
    """Every collective of step ``s`` (barriers aside): one bf16 all-reduce per bucket, no more."""
    got = sorted((e["op"], e["nbytes"]) for e in events_of(events, f"step {s}")
                 if "nbytes" in e and e["op"] != "barrier")
    want = sorted(("all_reduce", 2 * n) for n in SIZES)
    return CaseVerdict("sends_bf16", got == want, f"sent {describe_ops(got)}; expected "
                       f"{describe_ops(want)} (one bfloat16 all-reduce per bucket)", where)


def cause(spec, ws, rec) -> str:
    """The hint for a collective besides the bucket's all-reduce; else the criterion's own."""
    if rec.criterion == "sends_bf16" and "broadcast" in rec.detail.split(";")[0]:
        return ("A broadcast crossed the wire besides the all-reduce: the all-reduce already "
                "leaves the same sum on every rank, so nothing else needs to be sent to make "
                "the ranks agree; every extra collective adds the bucket's bytes again.")
    return ""


def _step(ws, grads, steps, s, i, where) -> list[CaseVerdict]:
    n, recs = SIZES[i], []
    for r in range(ws):
        here = f"{where}, rank {r}"
        got = steps[r][s]
        res = got["residuals"][i]
        recs.append(_residual_kept(res, got["residual_types"][i], n, here))
        old = torch.zeros(n) if s == 0 else steps[r][s - 1]["residuals"][i]
        old = torch.zeros(n) if old is None or old.numel() != n else old.float()
        # each parameter's residual on its own elements in this step's layout; where the
        # buckets were rebuilt, the residual as it lay (by position) is the mistake to name
        moved = _moved(old, i, s)
        mine = [t for t in got["sent"][i] if t.numel() == n]
        if len(mine) != 1:
            detail = (f"{len(got['sent'][i])} all-reduce(s) during the hook, "
                      f"{len(mine)} of the bucket's size; expected exactly one")
            recs += [CaseVerdict(c, False, detail, here) for c in
                     ("compresses_corrected_gradient", "residual_is_what_was_lost")]
            continue
        sent, g = mine[0], grads[r][s][i]
        recs.append(_compressed(sent, g, moved, old, ws, here))
        recs.append(_lost(sent, res, g, moved, old, ws, here))
    sents = [[t for t in steps[r][s]["sent"][i] if t.numel() == n] for r in range(ws)]
    if s > 0 and all(len(x) == 1 and x[0].dtype == sents[0][0].dtype for x in sents):
        total = sents[0][0].clone()
        for x in sents[1:]:
            total += x[0]
        recs.append(compare("returns_reduced", [f"rank {r}" for r in range(ws)],
                            [steps[r][s]["results"][i] for r in range(ws)], [total.float()] * ws,
                            (0, 0), where))
    return recs


def _residual_kept(res, kind, n, where) -> CaseVerdict:
    if res is None:
        detail = (f"state[bucket.index()] holds {kind} after the step, not a tensor"
                  if kind != "NoneType" else "nothing stored in state[bucket.index()]")
    elif res.dtype != torch.float32:
        detail = f"the residual is kept in {str(res.dtype).replace('torch.', '')}, not float32"
    elif res.numel() != n:
        detail = f"the residual has {res.numel()} elements, the bucket {n}"
    else:
        detail = ""
    return CaseVerdict("keeps_residual", not detail, detail, where)


REBUILT_DETAIL = ("the previous residual was added where it lay before the buckets were rebuilt: "
                  "under the same bucket index the parameters now come in another order, so "
                  "each parameter's residual landed on another parameter's elements")


def _moved(old, i, s):
    """Bucket ``i``'s residual of step ``s - 1`` with each parameter's part in step ``s``'s order."""
    if s == 0 or bucket_layout(s) == bucket_layout(s - 1):
        return old
    before, after = bucket_layout(s - 1)[i], bucket_layout(s)[i]
    parts = dict(zip(before, old.split([PARAMS[p] for p in before])))
    return torch.cat([parts[p] for p in after])


def _compressed(sent, g, old, positional, ws, where) -> CaseVerdict:
    def compress(x):
        return x.to(DTYPE).div_(ws)

    if sent.dtype != DTYPE:
        return CaseVerdict("compresses_corrected_gradient", False, f"sent "
                      f"{str(sent.dtype).replace('torch.', '')}, not bfloat16", where)
    if torch.equal(sent, compress(g + old)):
        return CaseVerdict("compresses_corrected_gradient", True, "", where)
    detail = mismatch(sent.float(), compress(g + old).float(), 0, 0)
    if not torch.equal(positional, old) and torch.equal(sent, compress(g + positional)):
        detail = REBUILT_DETAIL
    elif old.any() and torch.equal(sent, compress(g)):
        detail = "what was sent is the gradient alone: the stored residual was never added"
    elif old.any() and torch.equal(sent, compress(g + 2 * old)):
        detail = "what was sent holds the previous residual twice: it was added twice"
    elif torch.equal(sent, (g + old).div(ws).to(DTYPE)):
        detail = ("divided in float32 before casting: torch's hook casts to bfloat16 first, "
                  "then divides in bfloat16")
    elif torch.equal(sent, (g + old).to(DTYPE)):
        detail = "not divided by the world size before the all-reduce"
    return CaseVerdict("compresses_corrected_gradient", False, detail, where)


def _lost(sent, res, g, old, positional, ws, where) -> CaseVerdict:
    if res is None or res.numel() != g.numel():
        return CaseVerdict("residual_is_what_was_lost", False, "no residual of the bucket's size "
                      "to compare", where)
    corrected = g + old
    want = corrected - sent.float() * ws
    # float32 rounding of the two operations above, relative to the bucket's scale
    tol = 4 * torch.finfo(torch.float32).eps * float(corrected.abs().max())
    if mismatch(res.float(), want, 0, tol) == "":
        return CaseVerdict("residual_is_what_was_lost", True, "", where)
    detail = mismatch(res.float(), want, 0, tol)
    if not torch.equal(positional, old) and \
            mismatch(res.float(), g + positional - sent.float() * ws, 0, tol) == "":
        detail = REBUILT_DETAIL
    elif not res.any() and want.any():
        detail = "the residual is all zeros although compression lost something"
    elif mismatch(res.float(), corrected - corrected.to(DTYPE).float(), 0, tol) == "":
        detail = ("the residual was taken before the division by the world size: it misses "
                  "what the division in bfloat16 rounded away")
    elif old.any() and mismatch(res.float(), want + old, 0, tol) == "":
        detail = ("the residual counts the previous residual twice (transmitted + new "
                  "residual exceeds gradient + old residual by the old residual)")
    elif res.dtype != torch.float32 or \
            mismatch(res.float(), want.to(res.dtype).float(), 0, tol) == "":
        detail = f"the residual was rounded to {str(res.dtype).replace('torch.', '')}: {detail}"
    return CaseVerdict("residual_is_what_was_lost", False, detail, where)


def _tracking(ws, grads, steps, label) -> CaseVerdict:
    """Drift of the summed contributions, and (reported only) of the applied updates.

    Feedback bounds each rank's drift by its last residual; the bf16 sum inside the
    all-reduce rounds again, unseen by any rank, so the applied update keeps that error.
    """
    drift, plain = [], []
    exact = torch.zeros(sum(PARAMS), dtype=torch.float64)
    applied, applied_plain = torch.zeros_like(exact), torch.zeros_like(exact)
    for r in range(ws):
        mine, theirs = torch.zeros_like(exact), torch.zeros_like(exact)
        for s in range(STEPS):
            # per parameter, in one order for all steps: the buckets are rebuilt after step 0
            g = _flat(grads[r][s], s).double()
            sent = [[t for t in x if t.numel() == n] for x, n in
                    zip(steps[r][s]["sent"], SIZES)]
            if any(len(x) != 1 for x in sent):
                return CaseVerdict("tracks_uncompressed", False, "not one all-reduce of the "
                              "bucket's size per bucket and step", label)
            mine += _flat([x[0] for x in sent], s).double() * ws - g
            theirs += _flat(grads[r][s], s).to(DTYPE).div_(ws).double() * ws - g
        drift.append(mine), plain.append(theirs)
    for s in range(STEPS):
        per_rank = [_flat(grads[r][s], s) for r in range(ws)]
        exact += sum(g.double() for g in per_rank) / ws
        applied += _flat(steps[0][s]["results"], s).double()
        applied_plain += oracles.compress_hook(per_rank, DTYPE).double()
    ours, theirs = float(torch.cat(drift).norm()), float(torch.cat(plain).norm())
    return CaseVerdict("tracks_uncompressed", ours <= TRACKING * theirs,
                  f"after {STEPS} steps, |sum of transmitted - sum of gradients| over the "
                  f"ranks: {ours:.3g} with your hook, {theirs:.3g} with torch's hook (ratio "
                  f"{ours / theirs:.2f}, must be <= {TRACKING:g}); the applied updates drift "
                  f"{float((applied - exact).norm()):.3g} vs "
                  f"{float((applied_plain - exact).norm()):.3g} (the bf16 sum rounds too)",
                  label)


def _flat(buckets, s) -> torch.Tensor:
    """Step ``s``'s bucket tensors as one flat tensor in parameter order."""
    return torch.cat(per_param(buckets, s))
