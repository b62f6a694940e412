"""Check for exercise 06's transfer task: buckets built from the order gradients arrived in.

The model of this check registers its layers in a different order from the one
its forward pass uses them in (``out``, ``mid``, ``inp``, used as
inp -> mid -> out), so reverse registration order is *not* the order backward
produces gradients. The learner's wrapper must watch the first step, then
bucket in the order it saw, as torch DDP's reducer does when it rebuilds its
buckets after the first iteration. From the second step on, the check traces
one all-reduce per bucket, in arrival order, the first one issued before
backward reaches the first layer; every step is compared with torch DDP and
with one process on the whole batch.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from dpcourse.comm.trace import CommTrace
from dpcourse.grading import ddp_harness as h
from dpcourse.grading.criteria import Criterion, mismatch, tolerance
from dpcourse.grading.inprocess import CheckSpec

MIB = 2**20
REFERENCE = tuple(f"dpcourse.ddp.{p}" for p in (
    "naive.DataParallelNaive", "bucketed.DataParallelBucketed", "overlapped.DataParallelOverlapped",
    "base.DataParallelBase", "DataParallelNaive", "DataParallelBucketed",
    "DataParallelOverlapped", "bucket_order.assign_buckets_in_order",
    "bucket_order.agree_on_order"))


class Permuted(nn.Module):
    """An MLP whose layers are registered out, mid, inp but run inp -> mid -> out."""

    def __init__(self):
        super().__init__()
        self.out = nn.Linear(h.MID, h.OUT)
        self.mid = nn.Linear(h.HIDDEN, h.MID)
        self.inp = nn.Linear(h.IN, h.HIDDEN)

    def forward(self, x):
        return self.out(torch.relu(self.mid(torch.relu(self.inp(x)))))


def make_model(seed: int, device) -> Permuted:
    """Return the check's model built from ``seed``."""
    torch.manual_seed(seed)
    return Permuted().to(device)


def arrival_order(device) -> list[int]:
    """Return parameter indices (registration order) in the order backward fills their grads."""
    model, order = make_model(0, device), []
    params = list(model.parameters())
    for i, p in enumerate(params):
        p.register_post_accumulate_grad_hook(lambda p, i=i: order.append(i))
    x, y = h.micro_batches(0, 0, 1, 1, device)[0]
    h.loss_fn(model(x), y).backward()
    return order


def arrival_buckets(order, params, bucket_cap_mb: float) -> list[list[int]]:
    """Fill buckets along ``order``; a bucket closes once it holds >= the cap (bytes)."""
    cap, buckets, current, size = bucket_cap_mb * MIB, [], [], 0
    for i in order:
        current.append(i)
        size += params[i].numel() * params[i].element_size()
        if size >= cap:
            buckets.append(current)
            current, size = [], 0
    return buckets + ([current] if current else [])


class ArrivalOrderDDP(CheckSpec):
    """``ArrivalOrderDDP(module, bucket_cap_mb=...)``: buckets rebuilt in step 1's arrival order."""

    name, exercise, title = "arrival_order", "06", "Buckets in the order gradients arrive"
    forbidden = REFERENCE + ("dpcourse.comm.naive.all_reduce_per_tensor",)
    timeout = 45.0
    CAPS = (700 / MIB, 0.0)
    criteria = (
        Criterion("matches_torch_ddp", "parameters after each of 3 SGD steps equal torch DDP's, "
                  "the first step included", "Every step must average every gradient, the first "
                  "one too (while you are still learning the order): all-reduce, divide by the "
                  "world size, write back into param.grad."),
        Criterion("matches_single_process", "parameters after 3 steps equal one process "
                  "training on the whole global batch", "Check matches_torch_ddp first."),
        Criterion("buckets_follow_arrival", "from the second step on, the all-reduces carry the "
                  "buckets of the arrival order (caps 700 B and 0), issued in that order",
                  "Registration order is not the order gradients arrive in this model. Record "
                  "the order your hook is called in during the first backward, and build the "
                  "buckets from that order before the second backward."),
        Criterion("starts_during_backward", "from the second step on, the first all-reduce "
                  "starts before backward reaches the first layer",
                  "Launch a bucket from the hook of the gradient that completes it, as soon as "
                  "it is complete, not from finish_gradient_synchronization()."),
        Criterion("no_serialising_wait", "from the second step on, every bucket is issued "
                  "(async_op=True) before the first wait",
                  "Keep the work handles and wait in finish_gradient_synchronization(); waiting "
                  "in the hook stalls backward."),
    )
    notes = (f"tolerances (rtol, atol), float32 on gloo: vs torch DDP "
             f"{tolerance('gloo', torch.float32, 'vs_ddp')}, vs one process "
             f"{tolerance('gloo', torch.float32, 'vs_single')}",)

    def prepare(self, rec):
        from dpcourse.device import rank_device

        device, rank = rank_device(), dist.get_rank()
        model = make_model(100 + rank, device)
        ddp = nn.parallel.DistributedDataParallel(
            model, device_ids=[device.index] if device.type == "cuda" else None)
        one = make_model(100, device)
        return {"ddp": h.train(model, ddp, device=device),
                "single": h.train(one, one, device=device, single=True),
                "order": arrival_order(device)}

    def run(self, rec, cls, extras, reference):
        from dpcourse.device import rank_device

        device, rank = rank_device(), dist.get_rank()
        ref = reference.get()
        for cap in self.CAPS:
            case = f"bucket_cap_mb={cap:g} ({cap * MIB:g} bytes)"
            model = make_model(100 + rank, device)
            with rec.case("matches_torch_ddp", case):
                wrapped = cls(model, bucket_cap_mb=cap)
            with CommTrace() as trace:
                def on_grad(grad):  # backward reached the first layer; the gradient is unchanged
                    trace.mark("first_layer_backward")

                def mark(module, inputs, output):
                    if output.requires_grad:
                        output.register_hook(on_grad)
                model.inp.register_forward_hook(mark)
                with rec.case("matches_torch_ddp", case):
                    run = h.train(model, wrapped, trace=trace, device=device)
            self._compare(rec, run, ref, case)
            params = list(model.parameters())
            want = [sum(params[i].numel() * params[i].element_size() for i in b)
                    for b in arrival_buckets(ref["order"], params, cap)]
            for step in range(1, h.STEPS):
                self._structure(rec, trace, run, step, want, f"{case}, step {step}")

    @staticmethod
    def _compare(rec, run, ref, case) -> None:
        backend, rank = dist.get_backend(), dist.get_rank()
        names = [n for n, _ in make_model(0, "cpu").named_parameters()]
        tol_ddp, tol_one = (tolerance(backend, torch.float32, k) for k in ("vs_ddp", "vs_single"))
        for step in range(h.STEPS):
            bad = [(n, m) for n, a, b in zip(names, run["params"][step], ref["ddp"]["params"][step])
                   if (m := mismatch(a, b, *tol_ddp))]
            rec.record("matches_torch_ddp", not bad, f"rank {rank}, after step {step}, "
                       f"{bad[0][0]}: {bad[0][1]}" if bad else "", case)
        bad = [(n, m) for n, a, b in zip(names, run["params"][-1], ref["single"]["params"][-1])
               if (m := mismatch(a, b, *tol_one))]
        rec.record("matches_single_process", not bad, f"rank {rank}, {bad[0][0]}: {bad[0][1]}"
                   if bad else "", case)

    @staticmethod
    def _structure(rec, trace, run, step, want, case) -> None:
        lo, hi = run["steps"][step]
        events = [e for e in trace.events if e.op == "all_reduce" and lo <= e.start <= hi]
        got = [e.nbytes for e in events]
        rec.record("buckets_follow_arrival", got == want,
                   f"all-reduce sizes in issue order {got} bytes, the arrival order's buckets "
                   f"are {want}", case)
        marks = [t for label, t in trace.marks if label == "first_layer_backward" and lo <= t <= hi]
        rec.record("starts_during_backward", bool(events and marks and events[0].start < marks[-1]),
                   "no all-reduce was issued before backward reached the first layer", case)
        ends = [e.end for e in events]
        detail = ""
        if any(not e.async_op for e in events):
            detail = "an all-reduce was blocking (async_op=False)"
        elif None in ends:
            detail = "a work handle was never waited on"
        elif len(events) > 1 and max(e.start for e in events) > min(ends):
            detail = "a bucket was waited on before the next bucket was issued"
        rec.record("no_serialising_wait", not detail, detail, case)
