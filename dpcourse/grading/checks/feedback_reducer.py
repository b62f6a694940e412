"""The rank's side of exercise 11: a reducer's buckets handed to the learner's hook, watched.

:func:`rank_run` plays a reducer: one flat buffer per bucket, refilled with this
rank's gradient every step as a reducer refills its bucket storage, every hook
launched before any result is waited for, and the future's value copied back
with our wrappers' own code (:func:`dpcourse.ddp.comm_hooks.finish_comm_hook`,
as torch's reducer does). It watches what the hook hands to ``all_reduce`` and
returns, per step and bucket, the result, the residual and the tensors sent.
Nothing here knows an expected value.
"""

from __future__ import annotations

import torch

from dpcourse.grading.checks.base import begin

SIZES = (13, 1, 200)   # elements per bucket: odd, and one bucket of a single element
STEPS = 12
DTYPE = torch.bfloat16
TRACKING = 0.5        # the feedback run's drift must stay under this share of torch's hook's


def rank_run(link, learner, inputs) -> dict:
    """Run the learner's hook on each step's buckets; return what it sent, returned and kept."""
    from torch import nn

    from dpcourse.ddp.comm_hooks import launch_comm_hook

    hook, state = learner["main"], {}
    buffers = [torch.zeros(n) for n in SIZES]
    params = [nn.Parameter(torch.zeros(n)) for n in SIZES]
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
            works, per_bucket = [], []
            for i, g in enumerate(grads):
                with torch.no_grad():
                    buffers[i].copy_(g)
                before = len(sent)
                works.append(launch_comm_hook(hook, state, i, buffers[i], [buffers[i]],
                                              [params[i]], i == len(grads) - 1))
                per_bucket.append(before)
            for w in works:
                w.wait()
            bounds = per_bucket + [len(sent)]
            res = [state.get(i) for i in range(len(grads))]
            steps.append({
                "results": [b.detach().clone() for b in buffers],
                "sent": [sent[bounds[i]:bounds[i + 1]] for i in range(len(grads))],
                "residuals": [r.detach().clone() if isinstance(r, torch.Tensor) else None
                              for r in res],
                "residual_types": [type(r).__name__ for r in res]})
    finally:
        link.send = original
    return {"steps": steps}
