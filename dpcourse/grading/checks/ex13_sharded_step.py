"""Exercise 13: ZeRO-2 with gradient accumulation and a frozen layer.

The learner writes ``zero_step(params, shard_optimizer, last, group=None)``,
which the rank calls after the backward of every micro-batch (``last`` is true
after the last one of an optimizer step). Each backward adds this rank's
micro-batch gradient (its loss divided by the number of micro-batches, as
lesson 07 divides it) to ``param.grad``; the rank built ``shard_optimizer``
(AdamW) over this rank's shards, 1-D views into the parameters
(:func:`dpcourse.zero.shard_range`), the frozen layer's included. After the last
micro-batch every rank must hold what one process holds after stepping AdamW on
the whole batch, and no full-size gradient may outlive a micro-batch (ZeRO-2).

The rank sees only its own rows of each batch and a fresh seed for the model.
It returns, per micro-batch, which parameters still hold a ``.grad`` and, per
step, the parameters, each shard's ``.grad`` as it was when
``shard_optimizer.step()`` began (a pre-step hook), and the name of any other
optimizer that stepped. The grader trains one process on the whole batch
itself, and judges the collectives from its own record of what each rank
issued (op and bytes).
"""

from __future__ import annotations

import torch
from torch import nn

from dpcourse.grading.checks.base import CaseVerdict, Exercise, begin, events_of, follow_causes
from dpcourse.grading.criteria import Criterion, mismatch, no_deadlock, no_delegation
from dpcourse.grading.shim import COLLECTIVES, SHARDED, SHARDED_WHY

STEPS, MICRO, BATCH = 2, 3, 18  # 18 rows: 3 micro-batches of 3 rows on 2 ranks, of 2 on 3
TOL = (1e-4, 3e-5)  # fp32 AdamW over 2 steps: a rounding difference in a tiny gradient moves a
# weight by up to lr x its relative error (lr=1e-2)
SHARDED_OPS = {"reduce_scatter_tensor", "all_gather_into_tensor"}
FROZEN = (2, 3)  # the middle layer's weight and bias: requires_grad=False
VALUES = ("matches_single_process", "frozen_parameters_untouched")  # the parameters after a step


def make_model(seed: int) -> nn.Module:
    """The check's model: trainable parameters of 35, 7, 6 and 2 elements, a frozen 7 -> 3 layer."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3), nn.Tanh(),
                              nn.Linear(3, 2))
    model[2].requires_grad_(False)
    return model


def make_optimizer(params) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)


def micro_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """A micro-batch's loss as lesson 07 accumulates it: its mean, divided by the micro count."""
    return nn.functional.mse_loss(model(x), y) / MICRO


def single_process(seed: int, batches: list, last_rows: list) -> dict:
    """One process on the whole batch: parameters after each step, gradients before it.

    Args:
        seed: the model's seed.
        batches: per step, ``(x, y)`` of the whole batch.
        last_rows: per step, ``(x, y)`` of every rank's last micro-batch, for the diagnosis of
            a shard gradient that holds the last micro-batch's share only.

    Returns:
        ``{"params", "grads", "last"}``: per step, lists over the parameters (``None`` for a
        frozen parameter's gradient).
    """
    model = make_model(seed)
    opt = make_optimizer(model.parameters())
    out: dict = {"params": [], "grads": [], "last": []}
    for (x, y), (xl, yl) in zip(batches, last_rows):
        micro_loss(model, xl, yl).backward()  # the last micro-batches' share, ranks averaged
        out["last"].append([None if p.grad is None else p.grad.clone() for p in model.parameters()])
        model.zero_grad(set_to_none=True)
        nn.functional.mse_loss(model(x), y).backward()
        out["grads"].append([None if p.grad is None else p.grad.clone()
                             for p in model.parameters()])
        opt.step()
        opt.zero_grad(set_to_none=True)
        out["params"].append([p.detach().clone() for p in model.parameters()])
    return out


# The causes a shard gradient can be wrong for, each with the hint that follows from it.
CAUSES = {
    "no .grad": "shard_optimizer.step() found no .grad on a trainable shard: after the last "
                "micro-batch, every trainable shard must hold its accumulated gradient.",
    "summed over the ranks": "reduce_scatter_tensor sums the ranks' chunks; the whole batch's "
                             "gradient is their average: divide by N (before or after).",
    "divided by the micro-batch count twice": "Each micro-batch's loss was already divided by "
        "the number of micro-batches before backward (lesson 07's rule): the sum over "
        "micro-batches is the average. Divide by N only.",
    "the last micro-batch's share only": "The earlier micro-batches' shares were lost: once "
        "p.grad is freed, the shard's .grad is the only place a micro-batch's reduced chunk "
        "survives, so add each reduce-scatter's result to it instead of replacing it.",
    "another range of the gradient": "The shard is elements shard_range(numel, N, rank) of "
        "the flattened gradient: chunk r of a copy padded to N * chunk_size(numel, N) elements, "
        "chunk_size = ceil(numel / N).",
}
FROZEN_HINT = ("A frozen parameter (requires_grad=False) has no .grad, on every rank: leave it "
               "out of the reduce-scatters and the all-gathers, and leave its shard's .grad None. "
               "A zero gradient is not no gradient: AdamW skips a parameter whose .grad is None, "
               "but applies weight decay to one whose .grad is zeros.")


def shard_cause(got: torch.Tensor, want: torch.Tensor, last: torch.Tensor, full: torch.Tensor,
                world_size: int) -> str:
    """Name why a trainable shard's gradient ``got`` is not ``want`` (``""`` when it is)."""
    if not mismatch(got, want, *TOL):
        return ""
    if got.shape == want.shape:
        for cause, scaled in (("summed over the ranks", got / world_size),
                              ("divided by the micro-batch count twice", got * MICRO)):
            if not mismatch(scaled, want, *TOL):
                return cause
        if not mismatch(got, last, *TOL):
            return "the last micro-batch's share only"
        n, padded = got.numel(), torch.cat([full, full.new_zeros(world_size)])  # as sent
        if any(not mismatch(got, padded[i:i + n], *TOL) for i in range(padded.numel() - n + 1)):
            return "another range of the gradient"
    return ""


def cause_hint(rec: CaseVerdict) -> str:
    """The hint for the cause a failing record names in its detail."""
    if rec.criterion == "frozen_parameters_untouched":
        return FROZEN_HINT
    return next((hint for cause, hint in CAUSES.items() if f"({cause})" in rec.detail), "")


class ShardedStep(Exercise):
    """``zero_step(params, shard_optimizer, last, group=None)``: ZeRO-2 over micro-batches."""

    name, exercise, title = ("sharded_step", "13",
                             "ZeRO-2 with gradient accumulation and a frozen layer")
    defines = (("main", "zero_step"),)
    world_sizes = (2, 3)  # odd lengths on both; the 2-element bias leaves rank 2 of 3 no element
    dist_api, dist_why = SHARDED + COLLECTIVES, SHARDED_WHY
    # The lesson's layout helpers, which the notebook imports (the grader's scan allows them).
    allowed_imports = {"dpcourse.zero": {"chunk_size", "shard_range"}}
    timeout = 60.0
    criteria = (
        Criterion("shard_gradients_averaged", "at shard_optimizer.step(), each trainable shard's "
                  ".grad is its slice of the whole batch's gradient (every micro-batch, averaged "
                  "over the ranks)",
                  "Reduce-scatter each micro-batch's gradient into this rank's chunk and add the "
                  "chunks of all micro-batches; the report's why-line names what differs.",
                  weight=2),
        Criterion("full_gradients_freed", "after every micro-batch, no parameter keeps a "
                  "full-size .grad (ZeRO-2 holds only this rank's gradient shard)",
                  "A full-size .grad outlived its micro-batch: lesson 13's zero1 step keeps the "
                  "full gradients until step() and reduce-scatters once, which is ZeRO-1's "
                  "memory. ZeRO-2 reduce-scatters each micro-batch's gradient right after its "
                  "backward, keeps the chunk in the shard's .grad and sets p.grad = None.",
                  weight=2, needs=("shard_gradients_averaged",)),
        Criterion("matches_single_process", "after each of 2 AdamW steps every rank holds the "
                  "trainable parameters one process holds after stepping on the whole batch",
                  "The shard optimizer updated only your chunk, in place: every rank needs "
                  "every rank's updated chunk. All-gather the chunks (padded to chunk_size) and "
                  "copy the first numel elements back into the parameter.", weight=2,
                  # AdamW barely feels a gradient's scale: right parameters count only with
                  # right gradients.
                  needs=("shard_gradients_averaged",)),
        Criterion("frozen_parameters_untouched", "the frozen layer's shards get no .grad and its "
                  "parameters stay exactly as they were", FROZEN_HINT,
                  needs=("shard_gradients_averaged",)),
        Criterion("sharded_collectives_only", "only reduce-scatters and all-gathers: per step, one "
                  "reduce-scatter of the trainable gradients per micro-batch and one all-gather "
                  "of the trainable parameters, nothing for the frozen layer",
                  "More bytes than ZeRO-2 needs went out: an all-reduce sends the whole gradient "
                  "twice over where a reduce-scatter sends it once, and a frozen parameter is the "
                  "same on every rank, so it needs no collective at all.",
                  needs=("matches_single_process",)),
        Criterion("only_the_shard_optimizer_steps", "no optimizer other than shard_optimizer "
                  "steps (no full-size optimizer state)",
                  "Stepping a full-size optimizer holds the whole AdamW state on every rank, "
                  "which is what ZeRO removes: step shard_optimizer only.",
                  needs=("matches_single_process",)),
        no_delegation("matches_single_process"), no_deadlock("matches_single_process"),
    )
    notes = (f"AdamW, {STEPS} steps of {MICRO} micro-batches, trainable parameters of 35, 7, 6 "
             f"and 2 elements and a frozen layer, on 2 and 3 ranks, compared with one process, "
             f"rtol={TOL[0]:g}, atol={TOL[1]:g} (float32); fresh random model and batches on "
             "each run",)

    def make_inputs(self, rng, world_size):
        seed = rng.getrandbits(31)
        gen = torch.Generator().manual_seed(rng.getrandbits(62))
        batches = [(torch.randn(BATCH, 5, generator=gen), torch.randn(BATCH, 2, generator=gen))
                   for _ in range(STEPS)]
        rows = BATCH // world_size
        return [{"seed": seed, "batches": [(x[r * rows:(r + 1) * rows], y[r * rows:(r + 1) * rows])
                                           for x, y in batches]} for r in range(world_size)]

    @staticmethod
    def rank_run(link, learner, inputs):
        from torch.optim.optimizer import register_optimizer_step_pre_hook

        from dpcourse.zero import shard_range

        model = make_model(inputs["seed"])
        params = list(model.parameters())
        shards = [p.detach().view(-1)[slice(*shard_range(p.numel(), link.world_size, link.rank))]
                  for p in params]
        shard_opt = make_optimizer(shards)
        seen: dict = {}

        def at_step(opt, args, kwargs):
            if opt is shard_opt and "grads" not in seen:
                seen["grads"] = [None if s.grad is None else s.grad.detach().clone()
                                 for s in shards]
            elif opt is not shard_opt:
                seen["other"] = type(opt).__name__

        hook = register_optimizer_step_pre_hook(at_step)
        out = []
        try:
            for step, (x, y) in enumerate(inputs["batches"]):
                seen.clear()
                kept = []
                for m, (xm, ym) in enumerate(zip(x.chunk(MICRO), y.chunk(MICRO))):
                    begin(link, f"step {step}, micro-batch {m}")
                    micro_loss(model, xm, ym).backward()
                    learner["main"](params, shard_opt, m == MICRO - 1)
                    kept.append([k for k, p in enumerate(params) if p.grad is not None])
                out.append({"grads": seen.get("grads"), "other": seen.get("other", ""),
                            "kept": kept, "params": [p.detach().clone() for p in params]})
                model.zero_grad(set_to_none=True)
                for s in shards:  # what zero_grad does to the shard optimizer's parameters
                    s.grad = None
        finally:
            hook.remove()
        return out

    def judge(self, ws, inputs, outputs, events):
        last_rows = [(torch.cat([i["batches"][s][0].chunk(MICRO)[-1] for i in inputs]),
                      torch.cat([i["batches"][s][1].chunk(MICRO)[-1] for i in inputs]))
                     for s in range(STEPS)]
        batches = [(torch.cat([i["batches"][s][0] for i in inputs]),
                    torch.cat([i["batches"][s][1] for i in inputs])) for s in range(STEPS)]
        want = single_process(inputs[0]["seed"], batches, last_rows)
        start = [p.detach().clone() for p in make_model(inputs[0]["seed"]).parameters()]
        recs: list[CaseVerdict] = []
        # Step by step, every rank: a wrong step 0 on one rank is reported before what it
        # causes in step 1 on all of them.
        for s in range(STEPS):
            # Gradients taken at wrong parameters (trainable or frozen) say nothing about how
            # they were reduced, nor do the parameters they step to: once a step left wrong
            # parameters, the later steps' values are not judged.
            judged = not any(not r.passed and r.criterion in VALUES for r in recs)
            for r, got in enumerate(out[s] for out in outputs):
                case = f"{ws} ranks, step {s}"
                if judged:
                    recs.append(CaseVerdict("shard_gradients_averaged", *self._shard_grads(
                        ws, r, got["grads"], want["grads"][s], want["last"][s]), case))
                    bad = next((f"rank {r}, parameter {k}: {d}" for k, (p, w) in
                                enumerate(zip(got["params"], want["params"][s]))
                                if k not in FROZEN and (d := mismatch(p, w, *TOL))), "")
                    recs.append(CaseVerdict("matches_single_process", not bad, bad, case))
                kept = [f"micro-batch {m}: parameters {k}" for m, k in enumerate(got["kept"]) if k]
                recs.append(CaseVerdict("full_gradients_freed", not kept, f"rank {r} still held "
                                        f"a full .grad after {'; '.join(kept)}", case))
                recs.append(CaseVerdict("frozen_parameters_untouched",
                                        *self._frozen(r, got, start), case))
                recs.append(CaseVerdict("sharded_collectives_only",
                                        *self._bytes(ws, r, s, start, events[r]), case))
                recs.append(CaseVerdict("only_the_shard_optimizer_steps", not got["other"],
                                        f"a {got['other']} stepped besides shard_optimizer",
                                        case))
        follow_causes(self, recs, cause_hint)
        return recs

    @staticmethod
    def _shard_grads(ws, r, grads, want, last) -> tuple[bool, str]:
        from dpcourse.zero import shard_range

        if grads is None:
            return False, f"rank {r}: shard_optimizer.step() was not called"
        for k, (g, full, part) in enumerate(zip(grads, want, last)):
            if k in FROZEN:
                continue
            lo, hi = shard_range(full.numel(), ws, r)
            flat = full.reshape(-1)
            where = f"rank {r}, parameter {k} (shard [{lo}, {hi}) of {full.numel()})"
            if g is None:
                if hi > lo:
                    return False, f"{where}: no gradient (no .grad)"
                continue
            diff = mismatch(g, flat[lo:hi], *TOL)
            if diff:
                cause = shard_cause(g, flat[lo:hi], part.reshape(-1)[lo:hi], flat, ws)
                return False, f"{where}: {diff}" + (f" ({cause})" if cause else "")
        return True, ""

    @staticmethod
    def _frozen(r, got, start) -> tuple[bool, str]:
        for k in FROZEN:
            if got["grads"] is not None and got["grads"][k] is not None:
                g = got["grads"][k]
                what = "zeros" if not g.any() else "values"
                return False, f"rank {r}, frozen parameter {k}: its shard had a .grad of {what}"
            if not torch.equal(got["params"][k], start[k]):
                moved = (got["params"][k] - start[k]).abs().max().item()
                return False, f"rank {r}, frozen parameter {k} moved by up to {moved:.3g}"
        return True, ""

    @staticmethod
    def _bytes(ws, r, s, start, rank_events) -> tuple[bool, str]:
        from dpcourse.zero import chunk_size

        mine = [e for m in range(MICRO) for e in events_of(rank_events, f"step {s}, micro-batch {m}")
                if e["op"] not in ("recv", "delivered", "wait", "mark", "barrier")]
        ops = {e["op"] for e in mine}
        sent = sum((ws - 1) / ws * e["nbytes"] if e["op"] in SHARDED_OPS
                   else 2 * (ws - 1) / ws * e["nbytes"] if e["op"] == "all_reduce"
                   else e["nbytes"] for e in mine)
        # Per parameter: one padded reduce-scatter per micro-batch, one padded all-gather per step.
        padded = sum(ws * chunk_size(p.numel(), ws) * 4 for k, p in enumerate(start)
                     if k not in FROZEN)
        budget = (MICRO + 1) * (ws - 1) / ws * padded
        ok = bool(ops) and ops <= SHARDED_OPS and sent <= budget + 0.5
        return ok, (f"rank {r}: collectives {sorted(ops)}, {sent:.0f} bytes sent in the step; "
                    f"ZeRO-2 needs {budget:.0f}")

    def explain(self, text):
        if "'NoneType' object has no attribute" in text:
            return FROZEN_HINT
        return ""
