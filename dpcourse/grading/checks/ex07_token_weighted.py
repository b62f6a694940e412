"""Exercise 07, part 2: one optimizer step over micro-batches of uneven sizes.

The learner writes ``accumulation_step(model, optimizer, micro_batches, loss_fn)``.
The rank hands it a wrapper that behaves like torch DDP (it averages over ranks
at the end of every backward run outside ``no_sync()``, deciding at forward
time), micro-batches whose numbers of rows (tokens) differ within a rank and
between ranks, and ``loss_fn`` returning the mean over a micro-batch's rows. The
step must equal one process taking one SGD step on the concatenated global
batch, which the grader computes.

Each criterion watches a cause, not only the end result:

* zeroing: at the start of every backward call, and at ``optimizer.step()``,
  the rank notes whether ``param.grad`` is empty (stale, erased or right);
* weighting: a hook on every loss ``loss_fn`` returns reads the factor the
  learner's backward applied to it, per micro-batch;
* communication: every all-reduce of a parameter's ``.grad`` (the wrapper's or the
  learner's own) is noted with the parameter, how many backward calls of the step had
  started, whether ``optimizer.step()`` had run, and who issued it.
"""

from __future__ import annotations

import contextlib
import math

import torch
from torch import nn
from torch.autograd import Variable

from dpcourse.grading.checks import ddp_common as d
from dpcourse.grading.checks.base import CaseVerdict, begin, follow_causes
from dpcourse.grading.checks.ex07_no_sync import GradReductions, count_detail
from dpcourse.grading.criteria import Criterion, mismatch, no_deadlock, no_delegation, tolerance
from dpcourse.grading.shim import COLLECTIVES, DistModule

CASES = ("equal micro-batches", "uneven micro-batches", "uneven ranks")


def case_sizes(case: str, rank: int) -> list[int]:
    """Rows per micro-batch on ``rank``."""
    if case == "equal micro-batches":
        return [4, 4, 4]
    if case == "uneven micro-batches":  # every rank holds 16 rows, cut differently
        base = [2, 6, 3, 5]
        return base[rank % 4:] + base[:rank % 4]
    return [1 + 4 * rank, 3 + 2 * rank, 2 + 5 * rank]  # ranks hold different totals


class _LikeDDP(nn.Module):
    """Averages gradients over ranks at the end of each backward whose forward ran outside
    ``no_sync()`` (decided at forward time, as torch DDP does); ``syncing`` while it does."""

    def __init__(self, module, dist):
        super().__init__()
        self.module, self.dist = module, dist
        self.require_backward_grad_sync, self.sync_this_backward = True, True
        self.syncing, self.queued = False, False
        for p in module.parameters():
            p.register_post_accumulate_grad_hook(self._hook)

    def forward(self, *args, **kwargs):
        self.sync_this_backward = self.require_backward_grad_sync
        return self.module(*args, **kwargs)

    def _hook(self, p):
        if self.sync_this_backward and not self.queued:
            self.queued = True
            Variable._execution_engine.queue_callback(self._sync)

    def _sync(self):
        self.queued, self.syncing = False, True
        try:
            for p in self.module.parameters():
                if p.grad is not None:
                    p.grad.div_(self.dist.get_world_size())
                    self.dist.all_reduce(p.grad)
        finally:
            self.syncing = False

    def finish_gradient_synchronization(self):
        """Nothing left to do: the end of a synchronising backward already averaged."""

    @contextlib.contextmanager
    def no_sync(self):
        old, self.require_backward_grad_sync = self.require_backward_grad_sync, False
        try:
            yield
        finally:
            self.require_backward_grad_sync = old


def _fresh(params) -> bool:
    return all(p.grad is None or not bool(p.grad.any()) for p in params)


class TokenWeighted(d.DDPExercise):
    """``accumulation_step(model, optimizer, micro_batches, loss_fn)`` with uneven micro-batches."""

    name, exercise, title = "token_weighted", "07", "Accumulation over uneven micro-batches"
    defines = (("main", "accumulation_step"),)
    criteria = (
        Criterion("zero_grad_once_per_step", "each step starts from empty gradients and keeps "
                  "every micro-batch's gradient until optimizer.step()",
                  "The message says which: gradients left over from the previous step were "
                  "added to this one, or a zeroing between micro-batches (or before the step) "
                  "erased gradients the step needed."),
        Criterion("weights_within_rank", "on each rank, micro-batch i's loss counts in "
                  "proportion to its number of rows",
                  "loss_fn is a mean over the micro-batch's rows, so dividing every loss by the "
                  "number of micro-batches gives a 2-row micro-batch the same say as a 6-row "
                  "one, although it holds a third of the rows.", weight=2),
        Criterion("weights_across_ranks", "the losses of a rank add up to that rank's share of "
                  "the global rows, times the world size (the wrapper averages over ranks)",
                  "The wrapper averages the ranks' gradients, so each rank counts 1/N however "
                  "many rows it holds: a rank with more rows than the others is under-weighted "
                  "unless its losses account for its share of all ranks' rows, which no rank "
                  "knows on its own.", weight=2),
        Criterion("syncs_once_per_step", "each parameter's gradient is all-reduced exactly "
                  "once per optimizer step, after the step's last backward began and before "
                  "optimizer.step()", "Gradients were all-reduced more than once per step: "
                  "every backward whose forward ran outside no_sync() synchronises (the "
                  "wrapper decides at forward time, as torch DDP does)."),
        Criterion("matches_single_process", "the gradient at optimizer.step() and the parameters "
                  "after it equal one process's SGD step on the concatenated global batch",
                  "Check the other criteria first: each names one cause of a wrong gradient.",
                  weight=2),
        no_delegation("matches_single_process"), no_deadlock("matches_single_process"),
    )
    notes = (f"tolerances (rtol, atol) vs one process, float32: "
             f"{tolerance('gloo', torch.float32, 'vs_single')}; fresh random data on each run",)

    def make_inputs(self, rng, world_size):
        seed, per_rank = rng.getrandbits(31), [{"cases": []} for _ in range(world_size)]
        gen = torch.Generator().manual_seed(rng.getrandbits(62))
        for case in CASES:
            for r in range(world_size):
                sizes = case_sizes(case, r)
                steps = [[(torch.randn(n, d.IN, generator=gen), torch.randn(n, d.OUT,
                                                                            generator=gen))
                          for n in sizes] for _ in range(d.STEPS)]
                per_rank[r]["cases"].append({"case": case, "steps": steps})
        for r in range(world_size):
            per_rank[r]["seed"] = seed
        return per_rank

    @staticmethod
    def rank_run(link, learner, inputs):
        dist = DistModule(link, COLLECTIVES, "")
        out = []
        for case in inputs["cases"]:
            model = d.make_model(inputs["seed"])
            params = list(model.parameters())
            wrapped = _LikeDDP(model, dist)
            optimizer = torch.optim.SGD(params, lr=d.LR)
            log, weights = {}, {}

            def at_step(opt, args, kwargs, log=log, params=params):
                log.setdefault("at_step", ([None if p.grad is None else p.grad.detach().clone()
                                            for p in params], _fresh(params)))

            optimizer.register_step_pre_hook(at_step)

            def loss_fn(output, y, weights=weights):
                loss = nn.functional.mse_loss(output, y)
                if loss.requires_grad:
                    j = len(weights)
                    weights[j] = None  # set when a backward reaches this loss
                    loss.register_hook(lambda g, j=j: weights.__setitem__(j, float(g)))
                return loss

            original = torch.autograd.backward

            def watched(*args, log=log, params=params, **kwargs):
                log.setdefault("fresh", []).append(_fresh(params))
                return original(*args, **kwargs)

            def note(owner, log=log, wrapped=wrapped):
                return {"param": owner, "backward": len(log.get("fresh", [])),
                        "stepped": "at_step" in log, "wrapper": wrapped.syncing}

            steps = []
            for s, micro in enumerate(case["steps"]):
                log.clear(), weights.clear()
                label = f"{case['case']}, step {s}"
                begin(link, label)
                torch.autograd.backward = watched
                try:
                    with GradReductions(link, lambda params=params: params, note, label) as watch:
                        learner["main"](wrapped, optimizer, micro, loss_fn)
                finally:
                    torch.autograd.backward = original
                steps.append({"fresh": log.get("fresh", []), "at_step": log.get("at_step"),
                              "weights": [weights.get(j) for j in range(len(weights))],
                              "reduced": watch.by_case.get(label, []),
                              "params": [p.detach().clone() for p in params]})
            out.append(steps)
        return out

    def judge(self, ws, inputs, outputs, events):
        recs = []
        tol = tolerance("gloo", torch.float32, "vs_single")
        names = [n for n, _ in d.make_model(0).named_parameters()]
        causes = {}
        for k, case in enumerate(CASES):
            single = d.make_model(inputs[0]["seed"])
            opt = torch.optim.SGD(single.parameters(), lr=d.LR)
            for s in range(d.STEPS):
                rows = [mb for r in range(ws) for mb in inputs[r]["cases"][k]["steps"][s]]
                opt.zero_grad()
                nn.functional.mse_loss(single(torch.cat([x for x, _ in rows])),
                                       torch.cat([y for _, y in rows])).backward()
                grads = [p.grad.detach().clone() for p in single.parameters()]
                opt.step()
                params = [p.detach().clone() for p in single.parameters()]
                total = sum(len(y) for _, y in rows)
                for r in range(ws):
                    got, label = outputs[r][k][s], f"{case}, step {s}, rank {r}"
                    recs.append(self._zeroing(got, label))
                    recs += self._weights(got["weights"], case_sizes(case, r), ws, total, label)
                    rec, causes[label] = self._syncs(names, got, label)
                    recs.append(rec)
                    if got["at_step"] is None:
                        recs.append(CaseVerdict("matches_single_process", False,
                                           "optimizer.step() was not called", label))
                        continue
                    bad = [(n, "no gradient" if a is None else mismatch(a, b, *tol))
                           for n, a, b in zip(names, got["at_step"][0], grads)]
                    bad += [(n, mismatch(a, b, *tol)) for n, a, b in zip(names, got["params"],
                                                                         params)]
                    bad = [x for x in bad if x[1]]
                    recs.append(CaseVerdict("matches_single_process", not bad,
                                       f"{bad[0][0]}: {bad[0][1]}" if bad else "", label))
        follow_causes(self, recs, lambda rec: _SYNC_HINTS.get(causes.get(rec.case), "")
                      if rec.criterion == "syncs_once_per_step" else "")
        return recs

    @staticmethod
    def _syncs(names, got, label) -> tuple[CaseVerdict, str]:
        """The record of syncs_once_per_step for one step of one rank, and its cause."""
        grads = [x for x in got["reduced"] if x["param"] is not None]
        n = len(got["fresh"])
        detail, cause = count_detail(names, [x["param"] for x in grads])
        if cause == "often" and any(not x["wrapper"] for x in grads):
            cause = "yours"
            detail += (f"; {sum(not x['wrapper'] for x in grads)} of them issued by your code, "
                       f"{sum(x['wrapper'] for x in grads)} by the wrapper")
        elif cause == "often":
            ends = sorted({x["backward"] for x in grads})
            detail += (f"; the wrapper synchronised at the end of backward call(s) "
                       f"{', '.join(map(str, ends))} of {n}")
        elif not detail and any(x["stepped"] for x in grads):
            cause, detail = "after_step", "the gradients were all-reduced after optimizer.step()"
        elif not detail and any(x["backward"] < n for x in grads):
            first = min(x["backward"] for x in grads)
            cause, detail = "early", (f"the gradients were all-reduced once, during backward "
                                      f"call {first} of the step's {n}: the later ones added "
                                      "their gradients after it")
        return CaseVerdict("syncs_once_per_step", not detail, detail, label), cause

    @staticmethod
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

    @staticmethod
    def _weights(got, sizes, ws, total, label) -> list:
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
                       f"{[round(w, 4) for w in rel]}, expected {[round(w, 4) for w in want_rel]}",
                       label),
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
