"""Exercise 07, part 2: one optimizer step over micro-batches of uneven sizes.

The learner writes ``accumulation_step(model, optimizer, micro_batches, loss_fn)``.
The rank hands it a wrapper that behaves like torch DDP (it averages over ranks
at the end of every backward run outside ``no_sync()``, deciding at forward
time), micro-batches whose numbers of rows (tokens) differ within a rank and
between ranks, and ``loss_fn`` returning the mean over a micro-batch's rows. The
step must equal one process taking one SGD step on the concatenated global
batch, which the grader computes
(:mod:`~dpcourse.grading.checks.token_weighted_verdicts`, which ranks cannot import).

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

import torch
from torch import nn
from torch.autograd import Variable

from dpcourse.grading.checks import ddp_common as d
from dpcourse.grading.checks.base import begin
from dpcourse.grading.checks.grad_reductions import GradReductions
from dpcourse.grading.criteria import Criterion, no_deadlock, no_delegation, tolerance
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
    verdicts = "dpcourse.grading.checks.token_weighted_verdicts"

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
            optimizer = d.sgd(params)
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
