"""Exercise 11: a bf16 compression communication hook with error feedback.

The learner writes ``error_feedback_hook(state, bucket)`` with torch's hook
signature: it compresses each bucket as torch's ``bf16_compress_hook`` does, after
adding the residual the previous step left, and keeps what this step's compression
lost as the new residual in ``state[bucket.index()]`` (float32).

The rank plays a reducer: one flat buffer per bucket, refilled every step, rebuilt
after the first step in another parameter order (as torch DDP rebuilds its buckets,
so a residual kept by position lands on other elements), every hook launched before
any result is waited for and its future's value copied back by
:func:`dpcourse.ddp.comm_hooks.launch_comm_hook`. It returns, per step and bucket, the
result, the residual and the tensors handed to ``all_reduce``; the verdicts are
:mod:`~dpcourse.grading.checks.feedback_verdicts`.
"""

from __future__ import annotations

import torch

from dpcourse.grading.checks.base import Exercise, begin, clone_all
from dpcourse.grading.checks.random_inputs import torch_generator
from dpcourse.grading.criteria import Criterion, no_deadlock, no_delegation
from dpcourse.grading.shim import COLLECTIVES

PARAMS = (7, 1, 5, 2, 1, 81, 120)   # elements per parameter: odd, two of a single element
BUCKETS = ((0, 1, 2), (3, 4), (5, 6))   # the first step's buckets, by parameter
REBUILT = ((2, 1, 0), (4, 3), (6, 5))   # from the second step on: arrival order
SIZES = tuple(sum(PARAMS[p] for p in b) for b in BUCKETS)   # elements per bucket
STEPS = 12
DTYPE = torch.bfloat16
TRACKING = 0.5        # the feedback run's drift must stay under this share of torch's hook's
EMPTY_STATE_HINT = ("state starts empty: on a bucket's first step there is no residual yet, so it "
                    "starts from zeros of the bucket's size.")


def bucket_layout(step: int) -> tuple:
    """The buckets of ``step`` (0-based), each the tuple of its parameters' indices in order."""
    return BUCKETS if step == 0 else REBUILT


def bucket_grads(grads, step: int) -> list:
    """Per-parameter tensors of one step laid out as its buckets' flat tensors."""
    return [torch.cat([grads[p].reshape(-1) for p in b]) for b in bucket_layout(step)]


def per_param(flat, step: int) -> list:
    """The inverse of :func:`bucket_grads`: bucket tensors of ``step`` split back by parameter."""
    out = [None] * len(PARAMS)
    for t, b in zip(flat, bucket_layout(step)):
        for p, piece in zip(b, t.split([PARAMS[q] for q in b])):
            out[p] = piece
    return out


def run_hook_as_reducer(link, learner, inputs) -> dict:
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
            for i, (b, g) in enumerate(zip(bucket_layout(s), bucket_grads(grads, s))):
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
                "results": clone_all(buffers),
                "sent": [sent[bounds[i]:bounds[i + 1]] for i in range(len(SIZES))],
                "residuals": clone_all(res),
                "residual_types": [type(r).__name__ for r in res]})
    finally:
        link.send = original
    return {"steps": steps}


class ErrorFeedbackHook(Exercise):
    """``error_feedback_hook(state, bucket)``: bf16 compression with the residual fed back."""

    name, exercise, title = "error_feedback_hook", "11", "Compression hook with error feedback"
    defines = (("main", "error_feedback_hook"),)
    world_sizes = (2, 3)
    dist_api = COLLECTIVES
    dist_why = "A communication hook reduces its bucket with dist.all_reduce."
    timeout = 45.0
    criteria = (
        Criterion("first_step_is_torchs_hook", "with no residual yet, every rank's bucket after "
                  "the first step equals torch's bf16_compress_hook on the same gradients",
                  "With an empty residual the hook must do what torch's bf16 hook does: cast the "
                  "bucket to bfloat16, divide by the world size in bfloat16, all-reduce the sum "
                  "(divide before summing, so N values add up in one gradient's range), and "
                  "return it cast back to the bucket's dtype.", weight=2),
        Criterion("sends_bf16", "each bucket crosses the wire once per step, in bfloat16 "
                  "(2 bytes per element)",
                  "All-reduce the compressed tensor, not the float32 buffer, and only once per "
                  "bucket: the point of the hook is half the bytes."),
        Criterion("keeps_residual", "after every step, state[bucket.index()] holds the bucket's "
                  "residual as a float32 tensor of the bucket's size",
                  "Keep what compression lost, per bucket, in the state dict under the bucket's "
                  "index, in the gradient's dtype (float32) and as a tensor of its own: a "
                  "bfloat16 residual rounds away the small values it exists to keep, and a view "
                  "of the bucket's buffer is overwritten by the next step's gradient."),
        Criterion("compresses_corrected_gradient", "what a rank sends is the bf16 compression of "
                  "its gradient plus the previous step's residual, added once, each parameter's "
                  "own also after the buckets are rebuilt",
                  "Before compressing, add the residual from the previous step to the gradient, "
                  "exactly once per step; the first step starts from a zero residual. When the "
                  "buckets are rebuilt (after the first step) the same index holds its "
                  "parameters in another order: each parameter's residual must be added to that "
                  "parameter's elements, so keep it with its parameter, not by position.",
                  weight=2),
        Criterion("residual_is_what_was_lost", "transmitted + new residual == gradient + old "
                  "residual, on every rank, to float32 rounding",
                  "The residual is everything the rank's contribution lost: (gradient + old "
                  "residual) minus what was sent, cast back to float32 and multiplied by the world "
                  "size. Take it after the division, which rounds too when the world size is not "
                  "a power of two, and compute it in float32.", weight=2),
        Criterion("returns_reduced", "the future's value is the all-reduced bf16 sum, cast back "
                  "to the bucket's dtype", "Return a future whose value is the reduced tensor "
                  "decompressed (cast to float32), nothing added to it: the residual is kept "
                  "locally, never applied to the averaged gradient."),
        Criterion("tracks_uncompressed", f"over {STEPS} steps, the sum of what each rank "
                  "transmitted (sent x world size) drifts from the sum of its gradients by under "
                  f"{TRACKING:g}x what torch's hook without feedback drifts",
                  "Error feedback makes the rounding errors cancel over steps instead of adding "
                  "up: check the criteria about the residual.", weight=2),
        no_delegation("first_step_is_torchs_hook"), no_deadlock("first_step_is_torchs_hook"),
    )
    notes = ("exact (bitwise) comparisons with torch's bf16 arithmetic; the residual identity to "
             "float32 rounding; fresh random gradients on each run",)
    error_hints = ((("'NoneType' object",), EMPTY_STATE_HINT), (("KeyError",), EMPTY_STATE_HINT),
                   (("must return a torch.futures.Future",),
                    "A hook returns the future of its asynchronous all-reduce, chained with a "
                    "callback that decompresses the result, not a tensor."))

    def make_inputs(self, rng, world_size):
        gen = torch_generator(rng)
        out = []
        for _ in range(world_size):
            # Magnitudes over three decades; steady gradients (step-to-step noise under bf16's
            # resolution), where rounding without feedback drifts the same way every step.
            scale = [10 ** (-3 * torch.rand(n, generator=gen)) for n in PARAMS]
            base = [torch.randn(n, generator=gen) * s for n, s in zip(PARAMS, scale)]
            grads = [[b + 1e-3 * s * torch.randn(len(b), generator=gen)
                      for b, s in zip(base, scale)] for _ in range(STEPS)]
            out.append({"grads": grads})
        return out

    rank_run = staticmethod(run_hook_as_reducer)
    verdicts = "dpcourse.grading.checks.feedback_verdicts"
