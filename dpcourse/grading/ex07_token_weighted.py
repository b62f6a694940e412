"""Check for exercise 07: one optimizer step over micro-batches of uneven sizes.

The learner writes ``accumulation_step(model, optimizer, micro_batches, loss_fn)``.
The check hands it a data-parallel wrapper that behaves like torch DDP (it
averages over ranks at the end of every backward run outside ``no_sync()``,
deciding at forward time), micro-batches whose numbers of rows (tokens)
differ within a rank and between ranks, and ``loss_fn`` returning the mean over
a micro-batch's rows. The step must equal one process taking one SGD step on
the concatenated global batch.

Each criterion watches a cause, not only the end result:

* zeroing: at the start of every backward call, and at ``optimizer.step()``,
  the check looks at what ``param.grad`` holds (stale, erased or right);
* weighting: a hook on every loss ``loss_fn`` returns reads the factor the
  learner's backward applied to it (the gradient of the backward's root with
  respect to that loss), per micro-batch;
* communication: the wrapper all-reduces through a counting function.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from dpcourse.grading import ddp_harness as h
from dpcourse.grading.criteria import Criterion, mismatch, tolerance
from dpcourse.grading.inprocess import CheckSpec

CASES = ("equal micro-batches", "uneven micro-batches", "uneven ranks")


def case_sizes(case: str, rank: int) -> list[int]:
    """Rows per micro-batch on ``rank`` (the same every step)."""
    if case == "equal micro-batches":
        return [4, 4, 4]
    if case == "uneven micro-batches":  # every rank holds 16 rows, cut differently
        base = [2, 6, 3, 5]
        return base[rank % 4:] + base[:rank % 4]
    return [1 + 4 * rank, 3 + 2 * rank, 2 + 5 * rank]  # ranks hold different totals


def global_batch(case: str, step: int, world_size: int, device):
    """Return the step's global ``(x, y)`` and each rank's micro-batches, in rank order."""
    sizes = [case_sizes(case, r) for r in range(world_size)]
    g = torch.Generator().manual_seed(900 + 10 * CASES.index(case) + step)
    n = sum(map(sum, sizes))
    x = torch.randn(n, h.IN, generator=g).to(device)
    y = torch.randn(n, h.OUT, generator=g).to(device)
    per_rank, start = [], 0
    for s in sizes:
        rows = list(zip(x[start:start + sum(s)].split(s), y[start:start + sum(s)].split(s)))
        per_rank.append(rows)
        start += sum(s)
    return (x, y), per_rank


def _fresh(params) -> bool:
    return all(p.grad is None or not bool(p.grad.any()) for p in params)


class TokenWeighted(CheckSpec):
    """``accumulation_step(model, optimizer, micro_batches, loss_fn)`` with uneven micro-batches."""

    name, exercise, title = "token_weighted", "07", "Accumulation over uneven micro-batches"
    world_sizes = (2,)
    timeout = 45.0
    criteria = (
        Criterion("zero_grad_once_per_step", "each step starts from empty gradients and keeps "
                  "every micro-batch's gradient until optimizer.step()",
                  "Zero the gradients once per optimizer step: before the first micro-batch's "
                  "backward (or right after optimizer.step()), never between two micro-batches "
                  "and never between the last backward and the step."),
        Criterion("weights_within_rank", "on each rank, micro-batch i's loss counts in "
                  "proportion to its number of rows",
                  "loss_fn is a mean over the micro-batch's rows, so dividing every loss by the "
                  "number of micro-batches gives a 2-row micro-batch the same say as a 6-row "
                  "one. Scale each loss by its micro-batch's share of the rows instead."),
        Criterion("weights_across_ranks", "the losses of a rank add up to that rank's share of "
                  "the global rows, times the world size (the wrapper averages over ranks)",
                  "The wrapper averages the ranks' gradients, so each rank counts 1/N however "
                  "many rows it holds. A rank's losses must then add up to N x its share of all "
                  "rows; the total number of rows over all ranks takes one all-reduce of a "
                  "count, before the backward passes."),
        Criterion("syncs_once_per_step", "each gradient is all-reduced exactly once per "
                  "optimizer step", "Run every backward but the last inside model.no_sync() "
                  "(forward included: the wrapper decides at forward time, as torch DDP does)."),
        Criterion("matches_single_process", "the gradient at optimizer.step() and the parameters "
                  "after it equal one process's SGD step on the concatenated global batch",
                  "Check the other criteria first: each names one cause of a wrong gradient."),
    )
    notes = (f"tolerances (rtol, atol) vs one process, float32 on gloo: "
             f"{tolerance('gloo', torch.float32, 'vs_single')}",)

    def prepare(self, rec):
        from dpcourse.device import rank_device

        device, ws, out = rank_device(), dist.get_world_size(), {}
        for case in CASES:
            model = h.make_model(100, device)
            opt = torch.optim.SGD(model.parameters(), lr=h.LR)
            run = {"grads": [], "params": []}
            for step in range(h.STEPS):
                (x, y), _ = global_batch(case, step, ws, device)
                opt.zero_grad()
                h.loss_fn(model(x), y).backward()
                run["grads"].append(h.snapshot(p.grad for p in model.parameters()))
                opt.step()
                run["params"].append(h.snapshot(model.parameters()))
            out[case] = run
        return out

    def run(self, rec, accumulation_step, extras, reference):
        for case in CASES:
            self._case(rec, accumulation_step, reference, case)

    def _case(self, rec, accumulation_step, reference, case) -> None:
        from dpcourse.ddp.overlapped import DataParallelOverlapped
        from dpcourse.device import rank_device

        device, rank, ws = rank_device(), dist.get_rank(), dist.get_world_size()
        model = h.make_model(100 + rank, device)
        params = list(model.parameters())
        reduced: list[int] = []

        def counting_all_reduce(tensor, group=None):
            reduced.append(tensor.numel())
            dist.all_reduce(tensor, group=group)

        wrapped = DataParallelOverlapped(model, bucket_cap_mb=0, all_reduce=counting_all_reduce)
        optimizer = torch.optim.SGD(params, lr=h.LR)
        log: dict = {}

        def at_step(opt, args, kwargs):  # the gradient the step is about to use
            log.setdefault("at_step", (h.snapshot(p.grad for p in params), _fresh(params)))

        optimizer.register_step_pre_hook(at_step)
        weights: dict[int, float] = {}

        def loss_fn(output, y):
            loss = h.loss_fn(output, y)
            if loss.requires_grad:
                j = len(weights)
                weights[j] = None  # set when a backward reaches this loss
                loss.register_hook(lambda g, j=j: weights.__setitem__(j, float(g)))
            return loss

        original = torch.autograd.backward

        def watched_backward(*args, **kwargs):  # what param.grad holds as each backward starts
            log.setdefault("fresh", []).append(_fresh(params))
            return original(*args, **kwargs)

        want = reference.get()[case]
        tol = tolerance(dist.get_backend(), torch.float32, "vs_single")
        names = [n for n, _ in model.named_parameters()]
        for step in range(h.STEPS):
            _, per_rank = global_batch(case, step, ws, device)
            label = f"{case}, step {step}"
            log.clear(), weights.clear(), reduced.clear()
            torch.autograd.backward = watched_backward
            try:
                with rec.case("matches_single_process", label):
                    accumulation_step(wrapped, optimizer, per_rank[rank], loss_fn)
            finally:
                torch.autograd.backward = original
            self._zeroing(rec, log, label)
            self._weights(rec, weights, case, rank, ws, label)
            got = sorted(reduced)
            expected = sorted(p.numel() for p in params)
            rec.record("syncs_once_per_step", got == expected, f"rank {rank}: all-reduced "
                       f"gradients of {got} elements, the parameters have {expected}", label)
            grads = log.get("at_step", ([None] * len(params), True))[0]
            bad = [(n, "no gradient" if a is None else mismatch(a, b, *tol))
                   for n, a, b in zip(names, grads, want["grads"][step])]
            bad += [(n, m) for n, a, b in zip(names, h.snapshot(params), want["params"][step])
                    if (m := mismatch(a, b, *tol))]
            bad = [x for x in bad if x[1]]
            if "at_step" not in log:
                bad = [("optimizer", "optimizer.step() was not called")]
            rec.record("matches_single_process", not bad,
                       f"rank {rank}, {bad[0][0]}: {bad[0][1]}" if bad else "", label)

    @staticmethod
    def _zeroing(rec, log, label) -> None:
        fresh = log.get("fresh", [])
        detail = ""
        if fresh and not fresh[0]:
            detail = "the first backward of the step started with the previous step's gradients"
        elif any(fresh[1:]):
            detail = ("a later micro-batch's backward started from empty gradients: the earlier "
                      "micro-batches' gradients were erased")
        elif "at_step" in log and log["at_step"][1]:
            detail = "the gradients were empty at optimizer.step()"
        rec.record("zero_grad_once_per_step", not detail, detail, label)

    @staticmethod
    def _weights(rec, weights, case, rank, ws, label) -> None:
        sizes = case_sizes(case, rank)
        total = sum(sum(case_sizes(case, r)) for r in range(ws))
        got = [weights.get(j) for j in range(len(sizes))]
        if len(weights) < len(sizes) or any(w is None for w in got):
            for crit in ("weights_within_rank", "weights_across_ranks"):
                rec.record(crit, False, f"rank {rank}: {len(weights)} losses from loss_fn reached "
                           f"a backward, for {len(sizes)} micro-batches", label)
            return
        got = got[:len(sizes)]
        share = sum(got)
        rel = [w / share if share else math.nan for w in got]
        want_rel = [n / sum(sizes) for n in sizes]
        ok = all(math.isclose(a, b, rel_tol=1e-5) for a, b in zip(rel, want_rel))
        rec.record("weights_within_rank", ok, f"rank {rank}, micro-batches of {sizes} rows: "
                   f"relative weights {[round(w, 4) for w in rel]}, expected "
                   f"{[round(w, 4) for w in want_rel]}", label)
        want_sum = ws * sum(sizes) / total
        rec.record("weights_across_ranks", math.isclose(share, want_sum, rel_tol=1e-5),
                   f"rank {rank} ({sum(sizes)} of {total} rows): its loss weights add up to "
                   f"{share:.4g}, expected {want_sum:.4g}", label)
