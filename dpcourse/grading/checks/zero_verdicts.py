"""The grader's verdicts on exercise 13, and the one-process reference they compare with.

:func:`single_process` steps AdamW in one process on the whole batch; :func:`judge`
compares each rank's shard gradients (as they were when ``shard_optimizer.step()``
began) and parameters with it, step by step, and the grader's record of what each
rank issued with the bytes ZeRO-2 needs. A wrong shard gradient is named by its
cause (:func:`shard_cause`), and :func:`cause` gives the criterion the hint for it.
Grader-only: graded ranks cannot import this module (see :mod:`dpcourse.grading.rank`).
"""

from __future__ import annotations

import torch

from dpcourse.grading import oracles
from dpcourse.grading.checks.base import CaseVerdict, clone_all, events_of
from dpcourse.grading.checks.ex13_sharded_step import (FROZEN, FROZEN_HINT, MICRO, STEPS, TOL,
                                                       make_model, make_optimizer, micro_loss)
from dpcourse.grading.criteria import mismatch
from dpcourse.zero import chunk_size, shard_range

SHARDED_OPS = {"reduce_scatter_tensor", "all_gather_into_tensor"}
VALUES = ("matches_single_process", "frozen_parameters_untouched")  # the parameters after a step


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
    ref = oracles.train_one_process(make_model, seed, [[[xy]] for xy in batches],
                                    make_optimizer)
    model, last = make_model(seed), []
    for params, (x, y) in zip([ref["init"]] + ref["params"], last_rows):
        with torch.no_grad():  # the parameters the step began with
            for p, v in zip(model.parameters(), params):
                p.copy_(v)
        model.zero_grad(set_to_none=True)
        micro_loss(model, x, y).backward()  # the last micro-batches' share, ranks averaged
        last.append(clone_all(p.grad for p in model.parameters()))
    return {"params": ref["params"], "grads": ref["grads"], "last": last}


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


def shard_cause(got: torch.Tensor, want: torch.Tensor, last: torch.Tensor, full: torch.Tensor,
                world_size: int) -> str:
    """Name why a trainable shard's gradient ``got`` is not ``want`` (``""`` when it is)."""
    if not mismatch(got, want, *TOL):
        return ""
    if got.shape == want.shape:
        for named, scaled in (("summed over the ranks", got / world_size),
                              ("divided by the micro-batch count twice", got * MICRO)):
            if not mismatch(scaled, want, *TOL):
                return named
        if not mismatch(got, last, *TOL):
            return "the last micro-batch's share only"
        n, padded = got.numel(), torch.cat([full, full.new_zeros(world_size)])  # as sent
        if any(not mismatch(got, padded[i:i + n], *TOL) for i in range(padded.numel() - n + 1)):
            return "another range of the gradient"
    return ""


def cause(spec, ws: int, rec: CaseVerdict) -> str:
    """The hint for the cause a failing record names in its detail."""
    if rec.criterion == "frozen_parameters_untouched":
        return FROZEN_HINT
    return next((hint for named, hint in CAUSES.items() if f"({named})" in rec.detail), "")


def judge(ws, inputs, outputs, events) -> list[CaseVerdict]:
    """Every criterion's records, step by step and, within a step, rank by rank."""
    last_rows = [(torch.cat([i["batches"][s][0].chunk(MICRO)[-1] for i in inputs]),
                  torch.cat([i["batches"][s][1].chunk(MICRO)[-1] for i in inputs]))
                 for s in range(STEPS)]
    batches = [(torch.cat([i["batches"][s][0] for i in inputs]),
                torch.cat([i["batches"][s][1] for i in inputs])) for s in range(STEPS)]
    want = single_process(inputs[0]["seed"], batches, last_rows)
    start = clone_all(make_model(inputs[0]["seed"]).parameters())
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
                recs.append(CaseVerdict("shard_gradients_averaged", *_shard_grads(
                    ws, r, got["grads"], want["grads"][s], want["last"][s]), case))
                bad = next((f"rank {r}, parameter {k}: {d}" for k, (p, w) in
                            enumerate(zip(got["params"], want["params"][s]))
                            if k not in FROZEN and (d := mismatch(p, w, *TOL))), "")
                recs.append(CaseVerdict("matches_single_process", not bad, bad, case))
            kept = [f"micro-batch {m}: parameters {k}" for m, k in enumerate(got["kept"]) if k]
            recs.append(CaseVerdict("full_gradients_freed", not kept, f"rank {r} still held "
                                    f"a full .grad after {'; '.join(kept)}", case))
            recs.append(CaseVerdict("frozen_parameters_untouched",
                                    *_frozen(r, got, start), case))
            recs.append(CaseVerdict("sharded_collectives_only",
                                    *_bytes(ws, r, s, start, events[r]), case))
            recs.append(CaseVerdict("only_the_shard_optimizer_steps", not got["other"],
                                    f"a {got['other']} stepped besides shard_optimizer",
                                    case))
    return recs


def _shard_grads(ws, r, grads, want, last) -> tuple[bool, str]:
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
            why = shard_cause(g, flat[lo:hi], part.reshape(-1)[lo:hi], flat, ws)
            return False, f"{where}: {diff}" + (f" ({why})" if why else "")
    return True, ""


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


def _bytes(ws, r, s, start, rank_events) -> tuple[bool, str]:
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
