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
optimizer that stepped. The verdicts, against one process on the whole batch and
the grader's own record of what each rank issued (op and bytes), are
:mod:`~dpcourse.grading.checks.zero_verdicts`.
"""

from __future__ import annotations

import torch
from torch import nn

from dpcourse.grading.checks.base import Exercise, begin, clone_all
from dpcourse.grading.checks.random_inputs import regression_batches, torch_generator
from dpcourse.grading.criteria import Criterion, no_deadlock, no_delegation
from dpcourse.grading.shim import COLLECTIVES, SHARDED, SHARDED_WHY

STEPS, MICRO, BATCH = 2, 3, 18  # 18 rows: 3 micro-batches of 3 rows on 2 ranks, of 2 on 3
TOL = (1e-4, 3e-5)  # fp32 AdamW over 2 steps: a rounding difference in a tiny gradient moves a
# weight by up to lr x its relative error (lr=1e-2)
FROZEN = (2, 3)  # the middle layer's weight and bias: requires_grad=False


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


FROZEN_HINT = ("A frozen parameter (requires_grad=False) has no .grad, on every rank: leave it "
               "out of the reduce-scatters and the all-gathers, and leave its shard's .grad None. "
               "A zero gradient is not no gradient: AdamW skips a parameter whose .grad is None, "
               "but applies weight decay to one whose .grad is zeros.")


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
    error_hints = ((("'NoneType' object has no attribute",), FROZEN_HINT),)

    def make_inputs(self, rng, world_size):
        seed = rng.getrandbits(31)
        batches = regression_batches(torch_generator(rng), STEPS, BATCH, 5, 2)
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
                seen["grads"] = clone_all(s.grad for s in shards)
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
                            "kept": kept, "params": clone_all(params)})
                model.zero_grad(set_to_none=True)
                for s in shards:  # what zero_grad does to the shard optimizer's parameters
                    s.grad = None
        finally:
            hook.remove()
        return out

    verdicts = "dpcourse.grading.checks.zero_verdicts"
