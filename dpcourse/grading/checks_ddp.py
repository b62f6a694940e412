"""Checks for the data-parallel wrappers: naive DDP (03), overlapped buckets (06), no_sync (07).

Each check trains the same small model three ways on every rank (torch DDP,
one process on the whole batch, the learner's wrapper) and compares gradients
and parameters step by step; CommTrace shows how the wrapper communicated.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from dpcourse.comm.trace import CommTrace
from dpcourse.grading import ddp_harness as h
from dpcourse.grading.checks_pure import MIB, expected_buckets
from dpcourse.grading.criteria import Criterion, mismatch, tolerance
from dpcourse.grading.runner import CheckSpec

# The wrappers being taught. assign_buckets stays allowed here: exercise 05 checks it on its own.
REFERENCE = tuple(f"dpcourse.ddp.{p}" for p in (
    "naive.DataParallelNaive", "bucketed.DataParallelBucketed", "overlapped.DataParallelOverlapped",
    "base.DataParallelBase", "base.broadcast_module_state", "DataParallelNaive",
    "DataParallelBucketed", "DataParallelOverlapped")) + (
    "dpcourse.comm.naive.all_reduce_per_tensor",)

C_BROADCAST = Criterion(
    "initial_broadcast", "after construction every rank holds rank 0's parameters",
    "Every rank builds its model from its own random seed. In __init__, copy rank 0's values "
    "into every replica: dist.broadcast(p.data, src=0) for each parameter (and buffer).")
C_AVERAGED = Criterion(
    "grads_averaged", "after backward + sync, param.grad equals torch DDP's gradient (the mean "
    "over ranks)", "dist.all_reduce sums; DDP averages. Divide every gradient by world_size "
    "(before or after the sum). A ratio equal to the world size in the message means the divide "
    "is missing.")
C_DDP = Criterion(
    "matches_torch_ddp", "parameters after each of 3 SGD steps equal torch DDP's",
    "Check the other criteria first: a missing broadcast or a wrong average both show up here.")
C_SINGLE = Criterion(
    "matches_single_process", "parameters after 3 steps equal one process training on the whole "
    "global batch", "Data parallelism is exact: the mean of the ranks' mean-loss gradients is "
    "the gradient of the global mean loss.")
TOL_NOTE = (f"tolerances (rtol, atol), float32 on gloo: vs torch DDP "
            f"{tolerance('gloo', torch.float32, 'vs_ddp')}, vs one process "
            f"{tolerance('gloo', torch.float32, 'vs_single')}; on nccl "
            f"{tolerance('nccl', torch.float32, 'vs_ddp')} and "
            f"{tolerance('nccl', torch.float32, 'vs_single')}")


def _step_events(trace, run, step, op="all_reduce"):
    lo, hi = run["steps"][step]
    return [e for e in trace.events if e.op == op and lo <= e.start <= hi]


class _DDPCheck(CheckSpec):
    forbidden = REFERENCE
    timeout = 45.0
    accumulation = 1
    notes = (TOL_NOTE,)

    def prepare(self, rec):
        return h.references(self.accumulation)

    def _train(self, rec, cls, kwargs=None, train_step=None, case="training"):
        """Construct the learner's wrapper and train; return (run, trace, names)."""
        from dpcourse.device import rank_device

        device, rank = rank_device(), dist.get_rank()
        model = h.make_model(100 + rank, device)
        names = [n for n, _ in model.named_parameters()]
        with rec.case(C_BROADCAST.name, case):
            wrapped = cls(model, **(kwargs or {}))
        init = h.snapshot(h.make_model(100, device).parameters())  # rank 0's starting point
        diff = [(n, m) for n, got, want in zip(names, h.snapshot(model.parameters()), init)
                if (m := mismatch(got, want, 0, 0))]
        rec.record(C_BROADCAST.name, not diff, f"rank {rank}, {diff[0][0]}: {diff[0][1]}"
                   if diff else "", case)
        with CommTrace() as trace:
            self._instrument(model, wrapped, trace)
            with rec.case(C_DDP.name, case):
                run = h.train(model, wrapped, self.accumulation, train_step, trace, device)
        return run, trace, names

    def _instrument(self, model, wrapped, trace) -> None:
        """Mark when backward reaches the first layer (before its gradients exist)."""
        def on_grad(grad):
            trace.mark("first_layer_backward")  # returns None: the gradient is left unchanged

        def mark(module, inputs, output):
            if output.requires_grad:
                output.register_hook(on_grad)
        model[0].register_forward_hook(mark)

    def _compare(self, rec, run, ref, names, case="training", grads_crit=C_AVERAGED.name):
        rank, backend = dist.get_rank(), dist.get_backend()
        tol_ddp, tol_one = (tolerance(backend, torch.float32, k) for k in ("vs_ddp", "vs_single"))
        g = run["grads"][0]
        bad = [(n, "no gradient" if a is None else mismatch(a, b, *tol_ddp))
               for n, a, b in zip(names, g, ref["ddp"]["grads"][0])]
        bad = [x for x in bad if x[1]]
        rec.record(grads_crit, not bad, f"rank {rank}, step 0, {bad[0][0]}.grad: {bad[0][1]}"
                   if bad else "", case)
        for step in range(h.STEPS):
            bad = [(n, m) for n, a, b in zip(names, run["params"][step], ref["ddp"]["params"][step])
                   if (m := mismatch(a, b, *tol_ddp))]
            rec.record(C_DDP.name, not bad, f"rank {rank}, after step {step}, {bad[0][0]}: "
                       f"{bad[0][1]}" if bad else "", case)
        bad = [(n, m) for n, a, b in zip(names, run["params"][-1], ref["single"]["params"][-1])
               if (m := mismatch(a, b, *tol_one))]
        rec.record(C_SINGLE.name, not bad, f"rank {rank}, after step {h.STEPS - 1}, {bad[0][0]}: "
                   f"{bad[0][1]}" if bad else "", case)


class NaiveDDP(_DDPCheck):
    """``NaiveDDP(module)``: broadcast at start, one all-reduce per parameter, averaged."""

    name, exercise, title = "naive_ddp", "03", "Naive data parallelism"
    criteria = (C_BROADCAST, C_AVERAGED, C_DDP, C_SINGLE, Criterion(
        "one_all_reduce_per_parameter", "each step all-reduces every parameter's gradient once",
        "Loop over the trainable parameters and call dist.all_reduce(p.grad) once for each, in "
        "finish_gradient_synchronization()."))

    def run(self, rec, cls, extras, reference):
        run, trace, names = self._train(rec, cls)
        self._compare(rec, run, reference.get(), names)
        sizes = sorted(p.numel() * 4 for p in h.make_model(0, "cpu").parameters())
        for step in range(h.STEPS):
            got = sorted(e.nbytes for e in _step_events(trace, run, step))
            rec.record("one_all_reduce_per_parameter", got == sizes, f"step {step}: all-reduces "
                       f"of {got} bytes, parameters have {sizes} bytes", f"step {step}")


class OverlappedDDP(_DDPCheck):
    """``OverlappedDDP(module, bucket_cap_mb=...)``: bucketed all-reduces started from hooks."""

    name, exercise, title = "overlapped_ddp", "06", "Overlapped bucketed data parallelism"
    CAPS = (500 / MIB, 0.0)  # two buckets, then one per parameter
    criteria = (C_BROADCAST, C_AVERAGED, C_DDP, C_SINGLE,
                Criterion("one_all_reduce_per_bucket", "each step issues exactly one all-reduce "
                          "per bucket (bucket_cap_mb = 500 bytes and 0)",
                          "Flatten each bucket's gradients into one buffer and all-reduce the "
                          "buffer once, when the bucket's last gradient arrives."),
                Criterion("buckets_in_reverse_order", "buckets follow DDP's rule (reverse "
                          "parameter order, close at the cap) and go out in the order they fill",
                          "Gradients arrive last layer first: assign buckets from the last "
                          "parameter to the first, and launch each bucket as soon as it is full."),
                Criterion("starts_during_backward", "the first all-reduce of a step starts "
                          "before backward reaches the first layer",
                          "Launch a bucket's all-reduce from the gradient hook "
                          "(register_post_accumulate_grad_hook) of its last parameter, not after "
                          "loss.backward() returns."),
                Criterion("no_serialising_wait", "every bucket's all-reduce is issued "
                          "(async_op=True) before the first wait", "Keep the work handles and "
                          "wait for them all in finish_gradient_synchronization(); a wait (or a "
                          "blocking all-reduce) inside the hook stalls backward until the "
                          "communication is done, which is exactly what overlap avoids."))

    def run(self, rec, cls, extras, reference):
        for i, cap in enumerate(self.CAPS):
            case = f"bucket_cap_mb={cap:g} ({cap * MIB:g} bytes)"
            run, trace, names = self._train(rec, cls, {"bucket_cap_mb": cap}, case=case)
            if i == 0:
                self._compare(rec, run, reference.get(), names, case)
            params = list(h.make_model(0, "cpu").parameters())
            want = [sum(params[j].numel() * 4 for j in b) for b in expected_buckets(params, cap)]
            for step in range(h.STEPS):
                self._structure(rec, trace, run, step, want, f"{case}, step {step}")

    @staticmethod
    def _structure(rec, trace, run, step, want, case) -> None:
        events = _step_events(trace, run, step)
        got = [e.nbytes for e in events]
        rec.record("one_all_reduce_per_bucket", len(got) == len(want),
                   f"{len(got)} all-reduces, expected {len(want)} buckets", case)
        rec.record("buckets_in_reverse_order", got == want,
                   f"all-reduce sizes in issue order {got} bytes, expected {want}", case)
        lo, hi = run["steps"][step]
        marks = [t for label, t in trace.marks if label == "first_layer_backward" and lo <= t <= hi]
        first = events[0].start if events else None
        rec.record("starts_during_backward", first is not None and marks and first < marks[-1],
                   "no all-reduce was issued before backward reached the first layer", case)
        if len(events) >= 2:
            ends = [e.end for e in events]
            blocking = [e for e in events if not e.async_op]
            detail = ""
            if blocking:
                detail = f"{len(blocking)} all-reduce(s) were blocking (async_op=False)"
            elif None in ends:
                detail = "a work handle was never waited on"
            elif max(e.start for e in events) > min(ends):
                detail = ("a bucket was waited on before the next bucket was issued: the waits "
                          "serialise communication with backward")
            rec.record("no_serialising_wait", not detail, detail, case)


class NoSync(_DDPCheck):
    """Gradient accumulation: ``no_sync()`` on the learner's wrapper, and the accumulation loop."""

    name, exercise, title = "no_sync", "07", "Gradient accumulation with no_sync"
    accumulation = 4
    criteria = (
        Criterion("no_collective_inside_no_sync", "no all-reduce is issued inside no_sync()",
                  "Inside no_sync() the hooks must not communicate: set a flag (e.g. "
                  "self.require_backward_grad_sync = False) in no_sync and check it in the hook; "
                  "restore it in a finally block."),
        Criterion("syncs_once_per_step", "each gradient is all-reduced exactly once per "
                  "optimizer step (on the last micro-batch)", "Run every micro-batch but the "
                  "last inside model.no_sync(); the last backward syncs the accumulated sum."),
        C_DDP, C_SINGLE,
        Criterion("grads_averaged_over_micro_batches", "the accumulated gradient equals torch "
                  "DDP's (mean over ranks and micro-batches)", "Divide each micro-batch's loss by "
                  "the number of micro-batches, so the accumulated sum is a mean.",
                  requires="train_step"),
    )

    def _instrument(self, model, wrapped, trace) -> None:
        super()._instrument(model, wrapped, trace)
        original = getattr(wrapped, "no_sync", None)
        if not callable(original):
            return

        class Marked:  # mark the window on the trace's clock without changing the behaviour
            def __enter__(self):
                self.inner = original()
                trace.mark("no_sync_enter")
                return self.inner.__enter__()

            def __exit__(self, *exc):
                trace.mark("no_sync_exit")
                return self.inner.__exit__(*exc)

        wrapped.no_sync = Marked

    def run(self, rec, cls, extras, reference):
        train_step = extras.get("train_step")
        run, trace, names = self._train(rec, cls, train_step=train_step)
        crit = "grads_averaged_over_micro_batches" if train_step else "_grads"
        self._compare(rec, run, reference.get(), names, grads_crit=crit)
        enter = [t for label, t in trace.marks if label == "no_sync_enter"]
        leave = [t for label, t in trace.marks if label == "no_sync_exit"]
        total = sum(p.numel() * 4 for p in h.make_model(0, "cpu").parameters())
        for step in range(h.STEPS):
            events = _step_events(trace, run, step)
            lo, hi = run["steps"][step]
            windows = [(a, b) for a, b in zip(enter, leave) if lo <= a <= hi]
            inside = [e for e in events if any(a <= e.start <= b for a, b in windows)]
            detail = (f"step {step}: {len(inside)} all-reduce(s) inside no_sync" if windows
                      else f"step {step}: no_sync() was never entered")
            rec.record("no_collective_inside_no_sync", windows and not inside, detail)
            got = sum(e.nbytes for e in events)
            rec.record("syncs_once_per_step", got == total, f"step {step}: all-reduced {got} "
                       f"bytes of gradients, the model has {total}")
