"""The rank's side of exercise 11: a reducer's buckets handed to the learner's hook, watched.

:func:`rank_run` plays a reducer: one flat buffer per bucket of several
parameters, refilled with this rank's gradients every step as a reducer refills
its bucket storage, rebuilt after the first step as torch DDP rebuilds its
buckets in gradient-arrival order (:data:`REBUILT`: the same index then holds
its parameters in another order, so a residual kept by position lands on other
parameters' elements), every hook
launched before any result is waited for, and the future's value copied back
with our wrappers' own code (:func:`dpcourse.ddp.comm_hooks.finish_comm_hook`,
as torch's reducer does). It watches what the hook hands to ``all_reduce`` and
returns, per step and bucket, the result, the residual and the tensors sent.
Nothing here knows an expected value.
"""

from __future__ import annotations

import torch

from dpcourse.grading.checks.base import begin

PARAMS = (7, 1, 5, 2, 1, 81, 120)   # elements per parameter: odd, two of a single element
BUCKETS = ((0, 1, 2), (3, 4), (5, 6))   # the first step's buckets, by parameter
REBUILT = ((2, 1, 0), (4, 3), (6, 5))   # from the second step on: arrival order
SIZES = tuple(sum(PARAMS[p] for p in b) for b in BUCKETS)   # elements per bucket
STEPS = 12
DTYPE = torch.bfloat16
TRACKING = 0.5        # the feedback run's drift must stay under this share of torch's hook's


def layout(step: int) -> tuple:
    """The buckets of ``step`` (0-based), each the tuple of its parameters' indices in order."""
    return BUCKETS if step == 0 else REBUILT


def bucket_grads(grads, step: int) -> list:
    """Per-parameter tensors of one step laid out as its buckets' flat tensors."""
    return [torch.cat([grads[p].reshape(-1) for p in b]) for b in layout(step)]


def per_param(flat, step: int) -> list:
    """The inverse of :func:`bucket_grads`: bucket tensors of ``step`` split back by parameter."""
    out = [None] * len(PARAMS)
    for t, b in zip(flat, layout(step)):
        for p, piece in zip(b, t.split([PARAMS[q] for q in b])):
            out[p] = piece
    return out


def rank_run(link, learner, inputs) -> dict:
    """Run the learner's hook on each step's buckets; return what it sent, returned and kept."""
    from torch import nn

    from dpcourse.ddp.comm_hooks import launch_comm_hook

    hook, state = learner["main"], {}
    params = [nn.Parameter(torch.zeros(n)) for n in PARAMS]
    sent, original = [], link.send

    def watch(header, tensors=()):  # what the hook hands to all_reduce, as sent
        if header.get("t") == "coll" and header.get("op") == "all_reduce" and tensors:
            sent.append(tensors[0].detach().clone())
        return original(header, tensors)

    link.send = watch
    steps = []
    try:
        for s, grads in enumerate(inputs["grads"]):
            begin(link, f"step {s}")
            if s < 2:  # new storage for the first layout and for the rebuilt one
                buffers = [torch.zeros(n) for n in SIZES]
            works, per_bucket = [], []
            for i, (b, g) in enumerate(zip(layout(s), bucket_grads(grads, s))):
                with torch.no_grad():
                    buffers[i].copy_(g)
                before = len(sent)
                views = list(buffers[i].split([PARAMS[p] for p in b]))
                works.append(launch_comm_hook(hook, state, i, buffers[i], views,
                                              [params[p] for p in b], i == len(SIZES) - 1))
                per_bucket.append(before)
            for w in works:
                w.wait()
            bounds = per_bucket + [len(sent)]
            res = [state.get(i) for i in range(len(SIZES))]
            steps.append({
                "results": [b.detach().clone() for b in buffers],
                "sent": [sent[bounds[i]:bounds[i + 1]] for i in range(len(SIZES))],
                "residuals": [r.detach().clone() if isinstance(r, torch.Tensor) else None
                              for r in res],
                "residual_types": [type(r).__name__ for r in res]})
    finally:
        link.send = original
    return {"steps": steps}
