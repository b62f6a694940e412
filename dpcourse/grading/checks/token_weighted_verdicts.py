"""The grader's side of exercise 07's ``token_weighted``: one process's SGD step on the global
batch, and the verdicts on each rank's step.

Imported only by the grader (ranks cannot import it): it computes the expected gradients and
parameters in the grader's process from the same inputs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from dpcourse.grading import oracles
from dpcourse.grading.checks import ddp_common as d
from dpcourse.grading.checks.base import CaseVerdict, compare
from dpcourse.grading.checks.ex07_token_weighted import CASES, case_sizes
from dpcourse.grading.checks.grad_reductions import count_detail
from dpcourse.grading.criteria import tolerance


@dataclass
class _SyncVerdict(CaseVerdict):
    """A record of syncs_once_per_step that keeps its cause, for :func:`cause`."""

    cause: str = ""


def judge(ws, inputs, outputs, events) -> list[CaseVerdict]:
    """Judge every rank's steps against one process's SGD step on the concatenated batch."""
    recs: list[CaseVerdict] = []
    tol = tolerance("gloo", torch.float32, "vs_single")
    names = [n for n, _ in d.make_model(0).named_parameters()]
    for k, case in enumerate(CASES):
        batches = [[inputs[r]["cases"][k]["steps"][s] for r in range(ws)]
                   for s in range(d.STEPS)]
        single = oracles.train_one_process(d.make_model, inputs[0]["seed"],
                                           oracles.whole_batch(batches), d.sgd)
        for s in range(d.STEPS):
            grads, params = single["grads"][s], single["params"][s]
            total = sum(len(y) for micro in batches[s] for _, y in micro)
            for r in range(ws):
                got, label = outputs[r][k][s], f"{case}, step {s}, rank {r}"
                recs.append(_zeroing(got, label))
                recs += _weights(got["weights"], case_sizes(case, r), ws, total, label)
                recs.append(_syncs(names, got, label))
                if got["at_step"] is None:
                    recs.append(CaseVerdict("matches_single_process", False,
                                            "optimizer.step() was not called", label))
                    continue
                recs.append(compare("matches_single_process", names + names,
                                    got["at_step"][0] + got["params"], grads + params, tol,
                                    label))
    return recs


def cause(spec, ws: int, rec: CaseVerdict) -> str:
    """The hint for the cause of a failing record (see :func:`~.base.follow_causes`)."""
    return _SYNC_HINTS.get(getattr(rec, "cause", ""), "")


def _syncs(names, got, label) -> _SyncVerdict:
    """The record of syncs_once_per_step for one step of one rank, with its cause."""
    grads = [x for x in got["reduced"] if x["param"] is not None]
    n = len(got["fresh"])
    detail, why = count_detail(names, [x["param"] for x in grads])
    if why == "often" and any(not x["wrapper"] for x in grads):
        why = "yours"
        detail += (f"; {sum(not x['wrapper'] for x in grads)} of them issued by your code, "
                   f"{sum(x['wrapper'] for x in grads)} by the wrapper")
    elif why == "often":
        ends = sorted({x["backward"] for x in grads})
        detail += (f"; the wrapper synchronised at the end of backward call(s) "
                   f"{', '.join(map(str, ends))} of {n}")
    elif not detail and any(x["stepped"] for x in grads):
        why, detail = "after_step", "the gradients were all-reduced after optimizer.step()"
    elif not detail and any(x["backward"] < n for x in grads):
        first = min(x["backward"] for x in grads)
        why, detail = "early", (f"the gradients were all-reduced once, during backward "
                                f"call {first} of the step's {n}: the later ones added "
                                "their gradients after it")
    return _SyncVerdict("syncs_once_per_step", not detail, detail, label, cause=why)


def _zeroing(got, label) -> CaseVerdict:
    fresh, detail = got["fresh"], ""
    if fresh and not fresh[0]:
        detail = "the first backward of the step started with the previous step's gradients"
    elif any(fresh[1:]):
        detail = ("a later micro-batch's backward started from empty gradients: the earlier "
                  "micro-batches' gradients were erased")
    elif got["at_step"] is not None and got["at_step"][1]:
        detail = "the gradients were empty at optimizer.step()"
    return CaseVerdict("zero_grad_once_per_step", not detail, detail, label)


def _weights(got, sizes, ws, total, label) -> list[CaseVerdict]:
    if len(got) < len(sizes) or any(w is None for w in got[:len(sizes)]):
        detail = (f"{sum(w is not None for w in got)} losses from loss_fn reached a backward, "
                  f"for {len(sizes)} micro-batches")
        return [CaseVerdict(c, False, detail, label)
                for c in ("weights_within_rank", "weights_across_ranks")]
    got = got[:len(sizes)]
    share = sum(got)
    rel = [w / share if share else math.nan for w in got]
    want_rel = [n / sum(sizes) for n in sizes]
    want_sum = ws * sum(sizes) / total
    return [CaseVerdict("weights_within_rank",
                        all(math.isclose(a, b, rel_tol=1e-5) for a, b in zip(rel, want_rel)),
                        f"micro-batches of {sizes} rows: relative weights "
                        f"{[round(w, 4) for w in rel]}, expected "
                        f"{[round(w, 4) for w in want_rel]}", label),
            CaseVerdict("weights_across_ranks", math.isclose(share, want_sum, rel_tol=1e-5),
                        f"{sum(sizes)} of {total} rows: its loss weights add up to {share:.4g}, "
                        f"expected {want_sum:.4g}", label)]


_SYNC_HINTS = {
    "never": "No backward synchronised the gradients: the wrapper averages only at the end of a "
             "backward whose forward ran outside no_sync() (it decides at forward time), and "
             "its finish_gradient_synchronization adds nothing.",
    "yours": "Your code all-reduced param.grad on top of the wrapper: the wrapper had already "
             "averaged it at the end of the backward whose forward ran outside no_sync().",
    "early": "The backward that synchronised was not the step's last: the wrapper averages what "
             "param.grad holds at the end of that backward, and what the later backwards add "
             "stays this rank's own.",
    "after_step": "The optimizer's step ran before the all-reduce, on this rank's own gradients.",
}
