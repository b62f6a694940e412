"""Exercise 13: one ZeRO-1 optimizer step over shards of uneven parameters.

The learner writes ``zero_step(params, shard_optimizer, group=None)``. Every
rank's ``param.grad`` holds the gradient of its own rows' mean loss; the rank
built ``shard_optimizer`` (AdamW) over this rank's shards, 1-D views into the
parameters (:func:`dpcourse.zero.shard_range`). After the call every rank must
hold what one process holds after stepping AdamW on the whole batch.

The rank sees only its own rows of each batch and a fresh seed for the model.
It returns, per step, the parameters, each shard's ``.grad`` as it was when
``shard_optimizer.step()`` began (a pre-step hook), and the name of any other
optimizer that stepped. The grader trains one process on the whole batch
itself, and judges the collectives from its own record of what each rank
issued (op and bytes).
"""

from __future__ import annotations

import torch
from torch import nn

from dpcourse.grading.checks.base import CaseVerdict, Exercise, begin, events_of
from dpcourse.grading.criteria import Criterion, mismatch, no_deadlock, no_delegation
from dpcourse.grading.shim import COLLECTIVES, SHARDED, SHARDED_WHY

STEPS, BATCH = 2, 12
TOL = (1e-4, 3e-5)  # fp32 AdamW over 2 steps: a rounding difference in a tiny gradient moves a
# weight by up to lr x its relative error (lr=1e-2)
SHARDED_OPS = {"reduce_scatter_tensor", "all_gather_into_tensor"}


def make_model(seed: int) -> nn.Module:
    """The check's model: parameters of 35, 7, 7 and 1 elements (one smaller than the world)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 1))


def make_optimizer(params) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)


def single_process(seed: int, batches: list) -> tuple[list, list]:
    """Parameters after each step of one process on the whole batch, and its gradients."""
    model = make_model(seed)
    opt = make_optimizer(model.parameters())
    params, grads = [], []
    for x, y in batches:
        nn.functional.mse_loss(model(x), y).backward()
        grads.append([p.grad.detach().clone() for p in model.parameters()])
        opt.step()
        opt.zero_grad()
        params.append([p.detach().clone() for p in model.parameters()])
    return params, grads


class ShardedStep(Exercise):
    """``zero_step(params, shard_optimizer, group=None)``: reduce-scatter, step, all-gather."""

    name, exercise, title = "sharded_step", "13", "The sharded optimizer step (ZeRO-1)"
    defines = (("main", "zero_step"),)
    world_sizes = (3,)  # odd, and the 1-element bias leaves two ranks an empty shard
    dist_api, dist_why = SHARDED + COLLECTIVES, SHARDED_WHY
    # The lesson's layout helpers, which the notebook imports (the grader's scan allows them).
    allowed_imports = {"dpcourse.zero": {"chunk_size", "shard_range"}}
    timeout = 60.0
    criteria = (
        Criterion("shard_gradients_averaged", "at shard_optimizer.step(), each shard's .grad is "
                  "its slice of the gradient averaged over the ranks",
                  "Reduce-scatter a padded copy of each gradient (N chunks of chunk_size(numel, "
                  "N)); rank r receives the sum of chunk r. Divide by N, and cut the padding "
                  "off so that .grad has the shard's shape.", weight=2),
        Criterion("matches_single_process", "after each of 2 AdamW steps every rank holds the "
                  "parameters one process holds after stepping on the whole batch",
                  "The shard optimizer updated only your chunk, in place. All-gather every "
                  "rank's updated chunk (padded to chunk_size) and copy the first numel "
                  "elements back into the parameter.", weight=2,
                  # AdamW barely feels a gradient's scale: right parameters count only with
                  # right gradients.
                  needs=("shard_gradients_averaged",)),
        Criterion("same_bytes_as_ddp", "only reduce-scatters and all-gathers, sending no more "
                  "bytes than DDP's all-reduce of the gradients (padding aside)",
                  "An all-reduce sends the whole gradient twice over; ZeRO needs only its two "
                  "halves: dist.reduce_scatter_tensor, then dist.all_gather_into_tensor.",
                  needs=("matches_single_process",)),
        Criterion("only_the_shard_optimizer_steps", "no optimizer other than shard_optimizer "
                  "steps (no full-size optimizer state)",
                  "Stepping a full-size optimizer holds the whole AdamW state on every rank, "
                  "which is what ZeRO removes: step shard_optimizer only.",
                  needs=("matches_single_process",)),
        no_delegation("matches_single_process"), no_deadlock("matches_single_process"),
    )
    notes = (f"AdamW, {STEPS} steps, parameters of 35, 7, 7 and 1 elements, compared with one "
             f"process, rtol={TOL[0]:g}, atol={TOL[1]:g} (float32); fresh random model and "
             "batches on each run",)

    def make_inputs(self, rng, world_size):
        seed = rng.getrandbits(31)
        gen = torch.Generator().manual_seed(rng.getrandbits(62))
        batches = [(torch.randn(BATCH, 5, generator=gen), torch.randn(BATCH, 1, generator=gen))
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
                begin(link, f"step {step}")
                nn.functional.mse_loss(model(x), y).backward()
                seen.clear()
                learner["main"](params, shard_opt)
                out.append({"grads": seen.get("grads"), "other": seen.get("other", ""),
                            "params": [p.detach().clone() for p in params]})
                model.zero_grad()
                for s in shards:
                    s.grad = None
        finally:
            hook.remove()
        return out

    def judge(self, ws, inputs, outputs, events):
        from dpcourse.zero import shard_range

        batches = [(torch.cat([i["batches"][s][0] for i in inputs]),
                    torch.cat([i["batches"][s][1] for i in inputs])) for s in range(STEPS)]
        want_params, want_grads = single_process(inputs[0]["seed"], batches)
        numels = [p.numel() for p in want_params[0]]
        ddp = 2 * (ws - 1) / ws * 4 * sum(numels)
        padding = 2 * 4 * ws * len(numels)
        recs = []
        for r, steps in enumerate(outputs):
            for s, got in enumerate(steps):
                case = f"step {s}"
                bad = "" if got["grads"] is not None else "shard_optimizer.step() was not called"
                for k, (g, full) in enumerate(zip(got["grads"] or [], want_grads[s])):
                    lo, hi = shard_range(full.numel(), ws, r)
                    diff = "no gradient" if g is None else mismatch(g, full.reshape(-1)[lo:hi],
                                                                    *TOL)
                    if diff:
                        bad = f"rank {r}, parameter {k} (shard [{lo}, {hi})): {diff}"
                        break
                recs.append(CaseVerdict("shard_gradients_averaged", not bad, bad, case))
                bad = next((f"rank {r}, parameter {k}: {d}" for k, (p, w) in
                            enumerate(zip(got["params"], want_params[s]))
                            if (d := mismatch(p, w, *TOL))), "")
                recs.append(CaseVerdict("matches_single_process", not bad, bad, case))
                mine = [e for e in events_of(events[r], case)
                        if e["op"] not in ("recv", "delivered", "wait", "mark", "barrier")]
                ops = {e["op"] for e in mine}
                sent = sum((ws - 1) / ws * e["nbytes"] if e["op"] in SHARDED_OPS
                           else 2 * (ws - 1) / ws * e["nbytes"] if e["op"] == "all_reduce"
                           else e["nbytes"] for e in mine)
                ok = bool(ops) and ops <= SHARDED_OPS and sent <= ddp + padding
                recs.append(CaseVerdict("same_bytes_as_ddp", ok, f"rank {r}: collectives "
                                        f"{sorted(ops)}, {sent:.0f} bytes sent; DDP sends "
                                        f"{ddp:.0f}", case))
                recs.append(CaseVerdict("only_the_shard_optimizer_steps", not got["other"],
                                        f"a {got['other']} stepped besides shard_optimizer",
                                        case))
        return recs
