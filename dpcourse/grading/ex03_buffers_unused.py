"""Check for exercise 03's transfer task: naive DDP with buffers, unused and frozen parameters.

The check's model has what real models have and the warm-up's MLP lacks:

* a ``BatchNorm1d``, whose running statistics are *buffers* that every rank
  updates from its own shard (torch DDP makes them follow rank 0: broadcast at
  construction and before every forward);
* ``extra``, a layer used depending on the data: in step 0 only on rank 0, in
  step 1 on no rank, in step 2 on every rank;
* ``spare``, a trainable layer the forward never uses;
* ``frozen``, a layer with ``requires_grad=False``.

Everything is compared with ``torch.nn.parallel.DistributedDataParallel``
(``find_unused_parameters=True``) on the same rank, step by step: gradients
(``None`` included), parameters and buffers.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from dpcourse.grading import ddp_harness as h
from dpcourse.grading.criteria import Criterion, mismatch, tolerance
from dpcourse.grading.inprocess import CheckSpec

REFERENCE = tuple(f"dpcourse.ddp.{p}" for p in (
    "naive.DataParallelNaive", "bucketed.DataParallelBucketed", "overlapped.DataParallelOverlapped",
    "base.DataParallelBase", "base.broadcast_module_state", "DataParallelNaive",
    "DataParallelBucketed", "DataParallelOverlapped")) + (
    "dpcourse.comm.naive.all_reduce_per_tensor",)
# Which ranks use ``extra`` in each step: some, none, all.
EXTRA_USED = ({0}, set(), None)


class Branchy(nn.Module):
    """An MLP with batch norm, a data-dependent layer, an unused layer and a frozen one."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(h.IN, h.HIDDEN)
        self.norm = nn.BatchNorm1d(h.HIDDEN)
        self.out = nn.Linear(h.HIDDEN, h.OUT)
        self.extra = nn.Linear(h.HIDDEN, h.OUT)
        self.spare = nn.Linear(h.HIDDEN, h.OUT)
        self.frozen = nn.Linear(h.IN, h.OUT, bias=False).requires_grad_(False)
        self.use_extra = True

    def forward(self, x):
        hidden = torch.relu(self.norm(self.inp(x)))
        y = self.out(hidden) + self.frozen(x)
        return y + self.extra(hidden) if self.use_extra else y


def make_model(rank: int, device) -> Branchy:
    """Return the check's model for ``rank``: its own seed and its own buffer values."""
    torch.manual_seed(100 + rank)
    model = Branchy().to(device)
    with torch.no_grad():  # so that a missing buffer broadcast shows at construction
        model.norm.running_mean.fill_(0.1 * rank)
        model.norm.running_var.fill_(1.0 + rank)
    return model


def train(model: Branchy, wrapped, device) -> dict:
    """Train with ``extra`` used per :data:`EXTRA_USED`; also record the buffers after each step."""
    rank, step = dist.get_rank(), [0]
    buffers = []

    def train_step(m, optimizer, batches, loss_fn):
        used = EXTRA_USED[step[0]]
        model.use_extra = used is None or rank in used
        h.default_train_step(m, optimizer, batches, loss_fn)
        buffers.append(h.snapshot(model.buffers()))
        step[0] += 1

    run = h.train(model, wrapped, train_step=train_step, device=device)
    run["buffers"] = buffers
    return run


class BuffersUnused(CheckSpec):
    """``NaiveDDP(module)`` that also keeps buffers in step and copes with unused parameters."""

    name, exercise, title = "naive_ddp_complete", "03", "Naive DDP with buffers and unused layers"
    forbidden = REFERENCE
    timeout = 45.0
    criteria = (
        Criterion("initial_broadcast", "after construction every rank holds rank 0's parameters "
                  "and buffers", "The ranks start from different parameters and different batch "
                  "norm statistics: broadcast every parameter and every buffer "
                  "(module.buffers()) from rank 0."),
        Criterion("buffers_follow_rank_0", "after each step the buffers equal torch DDP's on "
                  "the same rank", "Each rank updates the running statistics from its own shard, "
                  "so they drift apart; torch DDP copies rank 0's buffers to every rank at the "
                  "start of every forward. Do that in forward()."),
        Criterion("grads_averaged", "every gradient equals torch DDP's (the mean over ranks)",
                  "All-reduce (sum) every gradient and divide by the world size."),
        Criterion("partly_used_parameter", "a parameter used on some ranks only gets the mean "
                  "over all ranks, zeros counted for the others, on every rank",
                  "A rank on which a layer was unused has p.grad None, yet its peers all-reduce "
                  "that layer: every rank must take part in the same all-reduces, in the same "
                  "order. Contribute zeros where you have no gradient."),
        Criterion("unused_parameter_keeps_no_grad", "a parameter no rank used keeps grad None, "
                  "as with torch DDP", "Only you can tell that no rank used a parameter: the "
                  "ranks have to agree on it (e.g. all-reduce a flag per parameter) before "
                  "deciding. A zero gradient is not the same as none: optimizers with momentum "
                  "or weight decay would still move the parameter."),
        Criterion("frozen_parameter_untouched", "a parameter with requires_grad=False gets no "
                  "gradient and stays rank 0's value", "Skip parameters that do not require "
                  "gradients in the synchronisation (they are broadcast once, like the others)."),
        Criterion("matches_torch_ddp", "parameters after each of 3 SGD steps equal torch DDP's",
                  "Check the other criteria first: each names one cause of a difference."),
    )
    notes = (f"tolerances (rtol, atol), float32 on gloo: vs torch DDP "
             f"{tolerance('gloo', torch.float32, 'vs_ddp')}; torch DDP runs with "
             "find_unused_parameters=True",)

    def prepare(self, rec):
        from dpcourse.device import rank_device

        device, rank = rank_device(), dist.get_rank()
        model = make_model(rank, device)
        ddp = nn.parallel.DistributedDataParallel(
            model, device_ids=[device.index] if device.type == "cuda" else None,
            find_unused_parameters=True)
        state = {"params": h.snapshot(model.parameters()), "buffers": h.snapshot(model.buffers())}
        return {"run": train(model, ddp, device), "init": state}

    def run(self, rec, cls, extras, reference):
        from dpcourse.device import rank_device

        device, rank = rank_device(), dist.get_rank()
        tol = tolerance(dist.get_backend(), torch.float32, "vs_ddp")
        model = make_model(rank, device)
        with rec.case("initial_broadcast", "construction"):
            wrapped = cls(model)
        ref = reference.get()
        self._same(rec, "initial_broadcast", model.named_parameters(), ref["init"]["params"],
                   (0, 0), "construction")
        self._same(rec, "initial_broadcast", model.named_buffers(), ref["init"]["buffers"],
                   (0, 0), "construction")
        with rec.case("matches_torch_ddp", "training; in step 0 extra is used on rank 0 only"):
            run = train(model, wrapped, device)
        want = ref["run"]
        names = [n for n, _ in model.named_parameters()]
        for step, used in enumerate(EXTRA_USED):
            case = f"step {step}, extra used on " + (
                "every rank" if used is None else f"rank(s) {sorted(used)}" if used else "no rank")
            self._same(rec, "buffers_follow_rank_0", model.named_buffers(),
                       want["buffers"][step], tol, case, got=run["buffers"][step])
            for n, got, exp in zip(names, run["grads"][step], want["grads"][step]):
                crit = ("frozen_parameter_untouched" if n.startswith("frozen")
                        else "unused_parameter_keeps_no_grad" if exp is None
                        else "partly_used_parameter" if n.startswith("extra") and used
                        else "grads_averaged")
                if exp is None or got is None:
                    ok = got is None and exp is None
                    detail = (f"rank {rank}, {n}.grad is {'None' if got is None else 'a tensor'}"
                              f", torch DDP's is {'None' if exp is None else 'a tensor'}")
                else:
                    detail = mismatch(got, exp, *tol)
                    ok = not detail
                    detail = f"rank {rank}, {n}.grad: {detail}"
                rec.record(crit, ok, detail, case)
            self._same(rec, "matches_torch_ddp", model.named_parameters(), want["params"][step],
                       tol, case, got=run["params"][step])
        self._same(rec, "frozen_parameter_untouched", model.named_parameters(),
                   ref["init"]["params"], (0, 0), "after training", only="frozen")

    @staticmethod
    def _same(rec, crit, named, want, tol, case, got=None, only="") -> None:
        named = list(named)
        values = got if got is not None else h.snapshot(t for _, t in named)
        bad = [(n, m) for (n, _), a, b in zip(named, values, want)
               if n.startswith(only) and (m := mismatch(a.double(), b.double(), *tol))]
        rec.record(crit, not bad, f"rank {dist.get_rank()}, {bad[0][0]}: {bad[0][1]}"
                   if bad else "", case)
