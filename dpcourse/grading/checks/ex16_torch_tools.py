"""Exercise 16: clip gradients that are sharded across ranks, as torch does for DTensor gradients.

The learner writes ``clip_sharded_(shards, max_norm, norm_type=2.0, group=None)``.
Each rank holds, for every parameter, its chunk of the flattened gradient (zero-padded
to ``N`` equal chunks, as lesson 14's FSDP shards its flats); the function scales every
shard in place as ``torch.nn.utils.clip_grad_norm_`` scales the whole gradient in one process and
returns the total norm on every rank. The grader asks torch's ``clip_grad_norm_``
for the expected norm and gradients, and its record of every collective shows
whether one scalar or the gradients crossed the wire.
"""

from __future__ import annotations

import math

import torch

from dpcourse.grading.checks.base import (CaseVerdict, Exercise, begin, describe_ops, events_of,
                                          returned)
from dpcourse.grading.checks.random_inputs import torch_generator
from dpcourse.grading.criteria import Criterion, mismatch, no_deadlock, no_delegation
from dpcourse.grading.shim import COLLECTIVES

RTOL, ATOL = 1e-5, 1e-7
# (label, the criterion it grades, norm_type, total norm / max_norm: > 1 clips)
CASES = (("l2, clipped", "total_norm", 2.0, 4.0), ("l2, below max_norm", "no_clip_below", 2.0, 0.5),
         ("inf, clipped", "inf_norm", math.inf, 3.0))


class ClipSharded(Exercise):
    """``clip_sharded_(shards, max_norm, norm_type=2.0, group=None)``: torch's clipping, sharded."""

    name, exercise, title = "clip_sharded", "16", "Clipping sharded gradients"
    defines = (("main", "clip_sharded_"),)
    world_sizes = (2, 3)
    dist_api = COLLECTIVES
    dist_why = "Clipping needs one all-reduce of a scalar (broadcast and barrier also exist here)."
    criteria = (
        Criterion("total_norm", "the returned norm equals clip_grad_norm_'s total norm of the "
                  "whole gradient, on every rank (2-norm)",
                  "Each rank sees only its shards: their norm is not the whole gradient's. Norms "
                  "do not add up across ranks, their squares do: reduce the sum of squares over "
                  "the ranks, then take the root.", weight=3),
        Criterion("clips_shards", "every shard ends scaled as clip_grad_norm_ scales the whole "
                  "gradient (the same factor max_norm / (norm + 1e-6) on every rank)",
                  "The shards were not scaled by the factor torch uses: every rank must scale by "
                  "the same factor, computed from the total norm, in place.", weight=3,
                  needs=("total_norm",)),
        Criterion("no_clip_below", "with a total norm below max_norm the shards are unchanged",
                  "A gradient whose norm is below max_norm is left as it is: the factor is "
                  "capped at 1, never above.", needs=("total_norm",)),
        Criterion("inf_norm", "norm_type=inf gives the largest absolute value over all ranks' "
                  "shards, and clips by it", "The infinity norm is a maximum: the ranks' partial "
                  "results combine with MAX, not with a sum, and no root is taken."),
        Criterion("one_scalar", "each call sends one all-reduce of one number: the gradients "
                  "never cross the wire", "More than one number crossed the wire: the ranks need "
                  "only each other's partial norm, one scalar, not their shards.",
                  needs=("total_norm",)),
        no_delegation("total_norm"), no_deadlock("total_norm"),
    )
    notes = (f"compared with torch.nn.utils.clip_grad_norm_ on the whole gradient, rtol={RTOL:g}, "
             f"atol={ATOL:g}; world sizes 2 and 3; fresh random gradients and sizes on each run",)

    def make_inputs(self, rng, world_size):
        from dpcourse.grading.oracles import flat_shard

        gen = torch_generator(rng)
        per_rank = [{"cases": []} for _ in range(world_size)]
        for label, crit, norm_type, ratio in CASES:
            sizes = [rng.randrange(1, 40) for _ in range(3)] + [1]  # one smaller than the world
            full = [torch.randn(n, generator=gen) for n in sizes]
            norm = float(torch.linalg.vector_norm(torch.cat(full), norm_type))
            for r in range(world_size):  # each gradient zero-padded to N chunks, as FSDP shards
                per_rank[r]["cases"].append(dict(
                    label=label, crit=crit, norm_type=norm_type, max_norm=norm / ratio,
                    sizes=sizes, shards=[flat_shard([g], world_size, r).clone() for g in full]))
        return per_rank

    @staticmethod
    def rank_run(link, learner, inputs):
        out = []
        for case in inputs["cases"]:
            shards = [s.clone() for s in case["shards"]]
            begin(link, case["label"])
            got = learner["main"](shards, case["max_norm"], case["norm_type"])
            norm = returned(torch.as_tensor(got) if isinstance(got, float) else got)
            out.append({"norm": norm, "shards": shards})
        return out

    def judge(self, ws, inputs, outputs, events):
        from dpcourse.grading.oracles import flat_shard

        recs = []
        for k, case in enumerate(inputs[0]["cases"]):
            label, crit = case["label"], case["crit"]
            full = [torch.cat([inputs[r]["cases"][k]["shards"][j] for r in range(ws)])[:n]
                    for j, n in enumerate(case["sizes"])]
            want_norm, want = torch_clip(full, case["max_norm"], case["norm_type"])
            for r in range(ws):
                got = outputs[r][k]
                recs.append(_norm(got["norm"], want_norm, inputs[r]["cases"][k]["shards"], r,
                                  crit, label))
                bad = next((d for g, w in zip(got["shards"], want)
                            if (d := mismatch(g, flat_shard([w], ws, r), RTOL, ATOL))), "")
                recs.append(CaseVerdict("clips_shards" if crit == "total_norm" else crit, not bad,
                                        f"rank {r}'s shards: {bad}", label))
                sent = [(e["op"], e["nbytes"]) for e in events_of(events[r], label)
                        if "nbytes" in e and e["op"] != "barrier"]
                one = len(sent) == 1 and sent[0][0] == "all_reduce" and sent[0][1] <= 8
                recs.append(CaseVerdict("one_scalar", one, f"rank {r} issued "
                                        f"{describe_ops(sent)}", label))
        return recs


def torch_clip(full, max_norm, norm_type):
    """What torch's clip_grad_norm_ gives in one process: (total norm, clipped gradients)."""
    params = [torch.nn.Parameter(torch.zeros_like(g)) for g in full]
    for p, g in zip(params, full):
        p.grad = g.clone()
    norm = torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type=norm_type)
    return norm, [p.grad for p in params]


def _norm(got, want, mine, rank, crit, label) -> CaseVerdict:
    """The norm's verdict; names a rank that returned its own shards' norm."""
    name = "inf_norm" if crit == "inf_norm" else "total_norm"
    if not isinstance(got, torch.Tensor) or got.numel() != 1:
        return CaseVerdict(name, False, f"rank {rank} returned {got}, expected a 0-d tensor", label)
    if torch.allclose(got.double().reshape(()), want.double(), rtol=RTOL, atol=ATOL):
        return CaseVerdict(name, True, "", label)
    local = torch.cat(mine).abs().max() if crit == "inf_norm" else torch.cat(mine).norm()
    why = " (this rank's own shards' norm)" if torch.allclose(got.reshape(()), local,
                                                               rtol=RTOL) else ""
    return CaseVerdict(name, False, f"rank {rank} returned {got.item():.6g}{why}, torch's "
                       f"clip_grad_norm_ gives {want.item():.6g}", label)
