"""The grader's verdicts of exercise 16 (clipping sharded gradients); ranks cannot import this module.

The expected norm and gradients come from torch: :func:`torch_clip` runs
``torch.nn.utils.clip_grad_norm_`` on the whole gradients, assembled from every
rank's chunks, in the grader's process.
"""

from __future__ import annotations

import torch

from dpcourse.grading import oracles
from dpcourse.grading.checks.base import CaseVerdict, events_of
from dpcourse.grading.checks.ex16_torch_tools import ATOL, RTOL
from dpcourse.grading.criteria import mismatch


def torch_clip(full, max_norm, norm_type):
    """What torch's clip_grad_norm_ gives in one process: (total norm, clipped gradients)."""
    params = [torch.nn.Parameter(torch.zeros_like(g)) for g in full]
    for p, g in zip(params, full):
        p.grad = g.clone()
    norm = torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type=norm_type)
    return norm, [p.grad for p in params]


def judge(ws, inputs, outputs, events):
    """Judge every case on every rank: the norm, the clipped shards, the bytes sent."""
    recs = []
    for k, case in enumerate(inputs[0]["cases"]):
        label, crit = case["label"], case["crit"]
        full = [torch.cat([inputs[r]["cases"][k]["shards"][j] for r in range(ws)])[:n]
                for j, n in enumerate(case["sizes"])]
        want_norm, want = torch_clip(full, case["max_norm"], case["norm_type"])
        for r in range(ws):
            got = outputs[r][k]
            recs.append(_norm(got["norm"], want_norm, inputs[r]["cases"][k]["shards"], r, crit, label))
            expect = [oracles.flat_shard([w], ws, r) for w in want]
            diffs = [mismatch(g, e, RTOL, ATOL) for g, e in zip(got["shards"], expect)]
            bad = next((d for d in diffs if d), "")
            shard_crit = "clips_shards" if crit == "total_norm" else crit
            recs.append(CaseVerdict(shard_crit, not bad, f"rank {r}'s shards: {bad}", label))
            sent = [e for e in events_of(events[r], label) if "nbytes" in e and e["op"] != "barrier"]
            one = len(sent) == 1 and sent[0]["op"] == "all_reduce" and sent[0]["nbytes"] <= 8
            recs.append(CaseVerdict("one_scalar", one, f"rank {r} issued " + ", ".join(
                f"{e['op']} of {e['nbytes']} bytes" for e in sent) if sent else "nothing", label))
    return recs


def _norm(got, want, mine, rank, crit, label) -> CaseVerdict:
    """The norm's verdict; names a rank that returned its own shards' norm."""
    name = "inf_norm" if crit == "inf_norm" else "total_norm"
    if not isinstance(got, torch.Tensor) or got.numel() != 1:
        return CaseVerdict(name, False, f"rank {rank} returned {got}, expected a 0-d tensor", label)
    if torch.allclose(got.double().reshape(()), want.double(), rtol=RTOL, atol=ATOL):
        return CaseVerdict(name, True, "", label)
    local = torch.cat(mine).abs().max() if crit == "inf_norm" else torch.cat(mine).norm()
    why = " (this rank's own shards' norm)" if torch.allclose(got.reshape(()), local, rtol=RTOL) else ""
    return CaseVerdict(name, False, f"rank {rank} returned {got.item():.6g}{why}, torch's "
                       f"clip_grad_norm_ gives {want.item():.6g}", label)
