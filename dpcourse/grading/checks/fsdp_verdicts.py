"""The grader's verdicts on exercise 14, and the references they compare with.

:func:`single_process` trains the check's model in one process on the whole
batch; :func:`judge` rebuilds every parameter from the ranks' shards and
compares it, each shard's gradient and what the rank's hooks saw at every
unit's forward and backward (:class:`~dpcourse.grading.checks.ex14_fsdp_hooks.Watch`) with
it, and the grader's record of every collective with the ones FSDP issues
(:mod:`dpcourse.grading.oracles`). Grader-only: graded ranks cannot import this
module (see :mod:`dpcourse.grading.rank`).
"""

from __future__ import annotations

import math
from functools import partial

import torch

from dpcourse.grading import oracles
from dpcourse.grading.checks.base import CaseVerdict, compare, events_of
from dpcourse.grading.checks.ex14_fsdp_hooks import (RUNS, STEPS, TOL, UNITS, layout,
                                                     make_model, make_optimizer)
from dpcourse.grading.criteria import mismatch, tolerance


def single_process(seed: int, run: int, batches_per_rank: list) -> dict:
    """One process on the concatenated batch: per step, gradients and parameters after it.

    Returns:
        ``{"init", "grads", "after"}``, each a ``{name: tensor}`` (per step for the last two).
    """
    batches = [[[b[step]] for b in batches_per_rank] for step in range(STEPS)]
    ref = oracles.train_one_process(make_model, seed, oracles.whole_batch(batches),
                                    partial(make_optimizer, run))
    names = [n for n, _ in make_model(0).named_parameters()]
    return {"init": dict(zip(names, ref["init"])),
            "grads": [dict(zip(names, g)) for g in ref["grads"]],
            "after": [dict(zip(names, p)) for p in ref["params"]]}


def _assemble(outs: list, step: int) -> dict | None:
    """Every parameter rebuilt from the ranks' shards after ``step`` (None if one is missing)."""
    if any(step >= len(o["steps"]) or "shards" not in o["steps"][step] for o in outs):
        return None
    full = {}
    for i, (names, shapes, _) in enumerate(f for u in layout() for f in u):
        try:
            tensors = oracles.unflatten([o["steps"][step]["shards"][i] for o in outs], shapes)
        except (RuntimeError, IndexError, TypeError):
            return None
        full.update(zip(names, tensors))
    return full


def _describe(group) -> str:
    return ", ".join(f"{op}({n // 4} elements)" for op, n in group) or "nothing"


def compare_collectives(got: list, groups: list) -> str:
    """``""`` when ``got`` is the groups one after the other (any order within a group)."""
    pos = 0
    for i, group in enumerate(groups):
        part = got[pos:pos + len(group)]
        if sorted(part) != sorted(group):
            before = f" after {_describe([x for g in groups[:i] for x in g][-2:])}" if i else ""
            return f"expected {_describe(group)}{before}, got {_describe(part)}"
        pos += len(group)
    if pos < len(got):
        return f"expected nothing more, got {_describe(got[pos:pos + 3])}"
    return ""


def judge(ws, inputs, outputs, events) -> list[CaseVerdict]:
    """Compare every rank's outputs and collectives with one process and FSDP; one world size."""
    recs = []
    for run in range(len(RUNS)):
        ref = single_process(inputs[0]["seed"], run, [i["batches"] for i in inputs])
        outs = [outputs[r][run] for r in range(ws)]
        # What the shards held when each step began: the gathers are judged against
        # these, so that a wrong gradient is not blamed on the gathers of the next step.
        held = [ref["init"]] + [_assemble(outs, s) for s in range(STEPS - 1)]
        for r in range(ws):
            recs += _judge_rank(ws, r, run, held, ref, outs[r], events[r])
        for step in range(STEPS):
            full = _assemble(outs, step)
            if full is None:
                break
            recs.append(compare("matches_single_process", list(full), list(full.values()),
                                [ref["after"][step][n] for n in full], TOL,
                                f"{RUNS[run][0]}, world size {ws}, after step {step}"))
    return recs


def _judge_rank(ws, r, run, held, ref, out, events) -> list:
    name, recs, units = RUNS[run][0], [], layout()
    tol_g = tolerance("gloo", torch.float32, "vs_single")
    flats = [f for u in units for f in u]
    expected = oracles.fsdp_step_collectives(
        [[(sum(math.prod(s) for s in shapes), k) for _, shapes, k in u] for u in units], ws)
    construction = [e for e in events_of(events, f"{name}: construction")
                    if e["op"] not in ("mark", "wait")]
    if construction:
        recs.append(CaseVerdict("collectives_as_fsdp", False, f"rank {r}: UnitHooks(...) issued "
                           f"{construction[0]['op']} at construction; nothing is gathered "
                           "before the first forward", name))
    for step, rec in enumerate(out["steps"]):
        label = f"{name}, world size {ws}, rank {r}, step {step}"
        if held[step] is not None:
            recs += _watched(rec, units, held[step], label)
        last = step == len(out["steps"]) - 1
        if last and out["stopped"]:
            recs.append(CaseVerdict(out["stopped_criterion"], False, out["stopped"], label))
        for phase in ("forward", "backward"):
            got = [(e["op"], e["nbytes"]) for e in events_of(
                events, f"{name}, step {step}: {phase}") if e["op"] not in ("mark", "wait")]
            if phase == "backward" and "after_backward" not in rec:
                # The step was stopped before its backward collectives: no evidence, no credit.
                recs.append(CaseVerdict("collectives_as_fsdp", False, "backward: not checked, the "
                                   "step stopped before its collectives ran", label))
                continue
            why = compare_collectives(got, expected[phase])
            recs.append(CaseVerdict("collectives_as_fsdp", not why, f"{phase}: {why}", label))
        later = [e for e in events_of(events, f"{name}, step {step}: optimizer step")
                 if e["op"] not in ("mark", "wait")]
        if later:
            recs.append(CaseVerdict("collectives_as_fsdp", False, f"{later[0]['op']} after "
                               "backward had returned", label))
        if "grads" not in rec:
            continue
        for (names, _, k), g in zip(flats, rec["grads"]):
            if not k:
                recs.append(CaseVerdict("reduce_scatters_gradients", g is None, "the frozen "
                                   "flat's shard has a gradient", label))
                continue
            want = oracles.flat_shard([ref["grads"][step][n] for n in names], ws, r)
            bad = "no gradient" if g is None else mismatch(g, want, *tol_g)
            recs.append(CaseVerdict("reduce_scatters_gradients", not bad,
                               f"{names[0].split('.')[0]}'s shard .grad: {bad}", label))
    if out["stopped"]:
        recs.append(CaseVerdict("matches_single_process", False,
                           f"rank {r}: training stopped in step {len(out['steps']) - 1}"
                           f": {out['stopped']}", name))
    return recs


def _watched(rec, units, before, label) -> list:
    """Verdicts on what the rank's hooks saw at each unit's forward start and end and
    backward start, and when backward returned."""
    recs = []
    for e in rec["log"]:
        k, moment = e["unit"], e["at"].split("_")[0]
        if e["at"] == "forward_end":
            kept = _kept(e["allocated"], units, range(len(UNITS)), trainable_only=False)
            recs.append(CaseVerdict("frees_after_forward", not kept, f"when unit '{UNITS[k]}' "
                                    f"ended its forward, unit(s) {kept} still held gathered "
                                    "weights", label))
            continue
        detail = f"unit '{UNITS[k]}' started its {moment} with its weights not gathered" \
            if not all(e["allocated"][k]) else ""
        for n, w in zip([x for ns, _, _ in units[k] for x in ns], e["weights"]):
            if detail:
                break
            if moment == "forward" and not w["view_of_full"]:
                detail = (f"{n} is not a view into its flat's full buffer (a copy: freeing the "
                          "buffer would not free it)")
            elif (bad := mismatch(w["value"], before[n], *TOL)):
                detail = f"{n} at the start of the {moment}: {bad}"
        recs.append(CaseVerdict(f"gathers_before_{moment}", not detail, detail, label))
        if moment == "backward":
            kept = _kept(e["allocated"], units, range(k + 1, len(UNITS)))
            recs.append(CaseVerdict("frees_after_backward", not kept, f"when unit '{UNITS[k]}' "
                                    f"started its backward, unit(s) {kept} still held gathered "
                                    "trainable weights", label))
    if "after_backward" in rec:
        kept = _kept(rec["after_backward"], units, range(len(UNITS)))
        recs.append(CaseVerdict("frees_after_backward", not kept, "when backward returned, "
                                f"unit(s) {kept} still held gathered trainable weights", label))
    return recs


def _kept(allocated, units, among, trainable_only=True) -> str:
    """The units of ``among`` that hold a gathered flat (trainable ones only, by default)."""
    return ", ".join(f"'{UNITS[j]}'" for j in among if any(
        a and (t or not trainable_only) for a, (_, _, t) in zip(allocated[j], units[j])))
