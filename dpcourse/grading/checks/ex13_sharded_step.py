"""Check for exercise 13: one ZeRO-1 optimizer step over shards of uneven parameters.

The learner writes ``zero_step(params, shard_optimizer, group=None)``. Every
rank's ``param.grad`` holds the gradient of its own batch's mean loss; the
check built ``shard_optimizer`` (AdamW) over this rank's shards, 1-D views into
the parameters (:func:`dpcourse.zero.shard_range`). After the call every rank
must hold what one process holds after stepping AdamW on the whole batch.

Each criterion watches a cause:

* at ``shard_optimizer.step()`` (a pre-step hook) each shard's ``.grad`` must be
  the averaged gradient's slice for that shard;
* ``CommTrace`` sees the collectives: only reduce-scatters and all-gathers,
  moving no more than DDP's all-reduce;
* a global optimizer hook sees any other optimizer stepping (a full-size one
  would hold the unsharded state ZeRO avoids).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.optim.optimizer import register_optimizer_step_pre_hook

from dpcourse.grading.criteria import Criterion, mismatch
from dpcourse.grading.inprocess import CheckSpec

STEPS, BATCH = 2, 12
TOL = (1e-4, 3e-5)  # fp32 AdamW over 2 steps: a rounding difference in a tiny gradient moves a
# weight by up to lr x its relative error (lr=1e-2)


def _model() -> nn.Module:
    torch.manual_seed(13)  # sizes 35, 7, 7, 1: uneven, and one smaller than the world size
    return nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 1))


def _batch(step: int):
    g = torch.Generator().manual_seed(1300 + step)
    return torch.randn(BATCH, 5, generator=g), torch.randn(BATCH, 1, generator=g)


def _optimizer(params) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)


def single_process() -> tuple[list[list[torch.Tensor]], list[list[torch.Tensor]]]:
    """Parameters after each step of one process on the whole batch, and the averaged gradients."""
    model = _model()
    opt = _optimizer(model.parameters())
    params, grads = [], []
    for step in range(STEPS):
        x, y = _batch(step)
        nn.functional.mse_loss(model(x), y).backward()
        grads.append([p.grad.detach().clone() for p in model.parameters() if p.grad is not None])
        opt.step()
        opt.zero_grad()
        params.append([p.detach().clone() for p in model.parameters()])
    return params, grads


class ShardedStep(CheckSpec):
    """``zero_step(params, shard_optimizer, group=None)``: reduce-scatter, shard step, all-gather."""

    name, exercise, title = "sharded_step", "13", "The sharded optimizer step (ZeRO-1)"
    # The lesson's layout helpers, which the notebook imports (the grader's scan allows them).
    allowed_imports = {"dpcourse.zero": {"chunk_size", "shard_range"}}
    world_sizes = (3,)  # odd, and the 1-element bias leaves two ranks an empty shard
    timeout = 60.0
    forbidden = ("dpcourse.zero.ShardedOptimizer", "dpcourse.zero.optimizer.ShardedOptimizer")
    criteria = (
        Criterion("shard_gradients_averaged", "at shard_optimizer.step(), each shard's .grad is "
                  "its slice of the gradient averaged over the ranks",
                  "Reduce-scatter a padded copy of each gradient (N chunks of chunk_size(numel, "
                  "N)); rank r receives the sum of chunk r. Divide by N, and cut the padding "
                  "off so that .grad has the shard's shape."),
        Criterion("matches_single_process", "after each of 2 AdamW steps every rank holds the "
                  "parameters one process holds after stepping on the whole batch",
                  "The shard optimizer updated only your chunk, in place. All-gather every "
                  "rank's updated chunk (padded to chunk_size) and copy the first numel "
                  "elements back into the parameter."),
        Criterion("same_bytes_as_ddp", "only reduce-scatters and all-gathers, sending no more "
                  "bytes than DDP's all-reduce of the gradients (padding aside)",
                  "An all-reduce sends the whole gradient twice over; ZeRO needs only its two "
                  "halves: dist.reduce_scatter_tensor, then dist.all_gather_into_tensor."),
        Criterion("only_the_shard_optimizer_steps", "no optimizer other than shard_optimizer "
                  "steps (no full-size optimizer state)",
                  "Stepping a full-size optimizer holds the whole AdamW state on every rank, "
                  "which is what ZeRO removes: step shard_optimizer only."),
    )
    notes = (f"AdamW, {STEPS} steps, parameters of 35, 7, 7 and 1 elements, compared with one "
             f"process, rtol={TOL[0]:g}, atol={TOL[1]:g} (float32)",)

    def prepare(self, rec):
        return single_process()

    def run(self, rec, zero_step, extras, reference):
        from dpcourse.comm import CommTrace
        from dpcourse.data import shard_batch
        from dpcourse.zero import shard_range, trace_wire_bytes

        ws, rank = dist.get_world_size(), dist.get_rank()
        model = _model()
        params = list(model.parameters())
        shards = [p.detach().view(-1)[slice(*shard_range(p.numel(), ws, rank))] for p in params]
        shard_opt = _optimizer(shards)
        want_params, want_grads = reference.get()
        seen: dict = {}

        def at_step(opt, args, kwargs):
            if opt is shard_opt:
                seen["grads"] = [None if s.grad is None else s.grad.detach().clone()
                                 for s in shards]
            else:
                seen["other"] = type(opt).__name__

        hook = register_optimizer_step_pre_hook(at_step)
        try:
            for step in range(STEPS):
                case = f"step {step}"
                x, y = _batch(step)
                nn.functional.mse_loss(model(shard_batch(x)), shard_batch(y)).backward()
                seen.clear()
                with CommTrace() as trace, rec.case("matches_single_process", case):
                    zero_step(params, shard_opt)
                self._judge(rec, seen, shards, params, want_grads[step], want_params[step],
                            trace, ws, rank, case)
                model.zero_grad()
                for s in shards:
                    s.grad = None
        finally:
            hook.remove()

    @staticmethod
    def _judge(rec, seen, shards, params, grads, want, trace, ws, rank, case) -> None:
        from dpcourse.zero import shard_range, trace_wire_bytes

        bad = ""
        if "grads" not in seen:
            bad = "shard_optimizer.step() was not called"
        else:
            for k, (g, full) in enumerate(zip(seen["grads"], grads)):
                lo, hi = shard_range(full.numel(), ws, rank)
                diff = ("no gradient" if g is None else mismatch(g, full.reshape(-1)[lo:hi], *TOL))
                if diff:
                    bad = f"rank {rank}, parameter {k} (shard [{lo}, {hi})): {diff}"
                    break
        rec.record("shard_gradients_averaged", not bad, bad, case)
        bad = next((f"rank {rank}, parameter {k}: {d}" for k, (p, w) in enumerate(zip(params, want))
                    if (d := mismatch(p.detach(), w, *TOL))), "")
        rec.record("matches_single_process", not bad, bad, case)
        ops = trace.collective_ops() | {e.op for e in trace.events if e.op in ("send", "isend")}
        allowed = {"reduce_scatter_tensor", "all_gather_into_tensor"}
        sent = trace_wire_bytes(trace.to_records(), ws)
        ddp = 2 * (ws - 1) / ws * sum(4 * p.numel() for p in params)
        padding = 2 * 4 * ws * len(params)
        ok = bool(ops) and ops <= allowed and sent <= ddp + padding
        rec.record("same_bytes_as_ddp", ok, f"collectives {sorted(ops)}, {sent:.0f} bytes sent; "
                   f"DDP sends {ddp:.0f}", case)
        rec.record("only_the_shard_optimizer_steps", "other" not in seen,
                   f"a {seen.get('other')} stepped besides shard_optimizer", case)
