"""Exercise 14: the hooks of one FSDP unit (gather, free, gather again, reduce-scatter, free).

The learner writes ``UnitHooks(unit, flats, group=None)``, which registers the
hooks of one unit. The rank builds a three-unit model (``inp``, ``mid``,
``out``; ``mid`` holds a frozen LayerNorm weight, so it has a trainable and a
frozen flat), cuts every unit into :class:`~dpcourse.fsdp.flat_params.FlatParams`
(35, 55 + 7 and 21 elements: none divisible by 2, most not by 3), hands each
unit to ``UnitHooks`` and trains the shards for 3 steps with SGD (momentum)
and with AdamW. Once backward returns, the loop frees what is still gathered
(frozen flats: no gradient says when their backward is over).

The rank's own hooks, registered after the learner's, note at every unit's
forward start and end, and at its backward start, which flats hold memory and
what the module computes with; they stop a step, with a message, before torch
would read freed memory (which would crash the rank). The grader computes one
process training on the whole batch, the averaged gradient's shards and the
collectives FSDP issues (:mod:`dpcourse.grading.oracles`), and compares with
the outputs and with its own record of every collective (the facts CommTrace
records: op, bytes, order).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from dpcourse.grading.checks.base import Exercise, Record, events_of
from dpcourse.grading.checks.fsdp_watch import BATCH, IN, OUT, RUNS, STEPS, TOL, UNITS, layout, \
    make_model, train
from dpcourse.grading.criteria import Criterion, mismatch, no_deadlock, no_delegation, tolerance
from dpcourse.grading.shim import COLLECTIVES, SHARDED


# -- in the grader: the verdicts ----------------------------------------------------------------
def single_process(seed: int, run: int, batches_per_rank: list) -> dict:
    """One process on the concatenated batch: parameters before and after each step, gradients."""
    name, kwargs = RUNS[run]
    model = make_model(seed)
    params = dict(model.named_parameters())
    opt = (torch.optim.SGD if name == "sgd" else torch.optim.AdamW)(
        [p for p in params.values() if p.requires_grad], **kwargs)
    out = {"before": [], "grads": [], "after": []}
    for step in range(STEPS):
        x = torch.cat([b[step][0] for b in batches_per_rank])
        y = torch.cat([b[step][1] for b in batches_per_rank])
        out["before"].append({n: p.detach().clone() for n, p in params.items()})
        opt.zero_grad(set_to_none=True)
        nn.functional.mse_loss(model(x), y).backward()
        out["grads"].append({n: p.grad.detach().clone() for n, p in params.items()
                             if p.grad is not None})
        opt.step()
        out["after"].append({n: p.detach().clone() for n, p in params.items()})
    return out


def _assemble(outs: list, step: int) -> dict | None:
    """Every parameter rebuilt from the ranks' shards after ``step`` (None if one is missing)."""
    from dpcourse.grading import oracles

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


def _compare_collectives(got: list, groups: list) -> str:
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


class FSDPHooks(Exercise):
    """``UnitHooks(unit, flats, group=None)``: one FSDP unit's gather, free and reduce-scatter."""

    name, exercise, title = "fsdp_hooks", "14", "The hooks of an FSDP unit"
    defines = (("main", "UnitHooks"),)
    world_sizes = (2, 3)
    dist_api = SHARDED + COLLECTIVES
    dist_why = ("FSDP needs only all_gather_into_tensor and reduce_scatter_tensor (all_reduce, "
                "broadcast and barrier also exist here).")
    allowed_imports = {"dpcourse.fsdp.flat_params": {"FlatParams", "gathered"}}
    timeout = 60.0
    criteria = (
        Criterion("gathers_before_forward", "when a unit's forward starts, every parameter of "
                  "it is a view into its flat's gathered buffer and holds the full weight",
                  "When the unit's forward started, its weights were not the full weights, or "
                  "not views into its flats' full buffers. Before a unit computes, each of its "
                  "flats is gathered from every rank's shard into the buffer that allocate "
                  "hands out, and the module is pointed at views of it: through gathered for a "
                  "trainable flat (autograd's only path back to the shard), at the full buffer "
                  "itself for a frozen one. A copy instead of a view keeps memory that freeing "
                  "does not release."),
        Criterion("frees_after_forward", "when a unit's forward ends, none of its flats holds "
                  "memory", "A unit still held gathered weights after its forward had ended. "
                  "Its forward no longer needs them and its backward gathers them again: "
                  "keeping them adds up every unit's full weights over the forward.",
                  needs=("gathers_before_forward",)),
        Criterion("gathers_before_backward", "when a unit's backward starts, its flats are "
                  "gathered again, into the same buffers autograd saved views of",
                  "A unit's backward started with its weights freed, or gathered into a buffer "
                  "autograd never saw. The backward needs the weights the forward used, and "
                  "autograd saved views of each flat's full buffer: those same buffers must be "
                  "gathered again by a hook that runs when the unit's output gradient is known, "
                  "one registered on the output while the unit's forward ends.", weight=2),
        Criterion("frees_after_backward", "once a unit's gradient is reduce-scattered its "
                  "trainable flats hold no memory (checked when the next unit's backward "
                  "starts, and when backward returns)",
                  "A unit's trainable weights were still gathered after its gradient had been "
                  "reduce-scattered. Its backward is over at that moment; keeping them means "
                  "holding every unit's full weights by the end of backward.",
                  needs=("gathers_before_backward",)),
        Criterion("reduce_scatters_gradients", "at optimizer.step(), each trainable shard's "
                  ".grad is this rank's chunk of the gradient averaged over the ranks; frozen "
                  "shards have none",
                  "The shard's gradient was not this rank's chunk of the gradient averaged over "
                  "the ranks. The gradient hook receives this rank's own gradient of the whole "
                  "flat, and a reduce-scatter leaves each rank the sum of its chunk over all "
                  "ranks. A ratio equal to the world size means the sum was never divided; no "
                  "gradient at all means nothing was stored on the shard.", weight=2),
        Criterion("collectives_as_fsdp", "each step issues exactly: forward, one all-gather "
                  "per flat, unit by unit; backward, in reverse unit order, the unit's "
                  "all-gathers again, then one reduce-scatter per trainable flat; sizes N x "
                  "chunk", "The collectives differ from FSDP's. An all-reduce of the gradient "
                  "leaves every rank the whole gradient, which sharding exists to avoid, and "
                  "moves twice the bytes of a reduce-scatter; an extra or missing gather shows "
                  "a hook that runs too often, or never.",
                  weight=2, needs=("gathers_before_forward",)),
        Criterion("matches_single_process", "after each of 3 steps (SGD with momentum, and "
                  "AdamW), the parameters assembled from the ranks' shards equal one process "
                  "training on the whole batch (the frozen weight unchanged)",
                  "Check the other criteria first: each names one part of the step.", weight=2),
        no_delegation("matches_single_process"), no_deadlock("matches_single_process"),
    )
    notes = (f"model: units inp (35 elements), mid (55 trainable + 7 frozen), out (21); world "
             f"sizes 2 and 3; parameters compared with one process to atol={TOL[1]:g}, "
             f"gradients to (rtol, atol) {tolerance('gloo', torch.float32, 'vs_single')}; fresh "
             "random seeds and batches on each run",)

    def make_inputs(self, rng, world_size):
        seed = rng.getrandbits(31)
        gen = torch.Generator().manual_seed(rng.getrandbits(62))
        return [{"seed": seed, "batches": [(torch.randn(BATCH, IN, generator=gen),
                                            torch.randn(BATCH, OUT, generator=gen))
                                           for _ in range(STEPS)]}
                for _ in range(world_size)]

    @staticmethod
    def rank_run(link, learner, inputs):
        return [train(link, learner["main"], inputs, run) for run in range(len(RUNS))]

    def judge(self, ws, inputs, outputs, events):
        recs = []
        for run in range(len(RUNS)):
            ref = single_process(inputs[0]["seed"], run, [i["batches"] for i in inputs])
            outs = [outputs[r][run] for r in range(ws)]
            # What the shards held when each step began: the gathers are judged against
            # these, so that a wrong gradient is not blamed on the gathers of the next step.
            held = [ref["before"][0]] + [_assemble(outs, s) for s in range(STEPS - 1)]
            for r in range(ws):
                recs += self._judge_rank(ws, r, run, held, ref, outs[r], events[r])
            for step in range(STEPS):
                full = _assemble(outs, step)
                if full is None:
                    break
                bad = next((f"{n}: {m}" for n, t in full.items()
                            if (m := mismatch(t, ref["after"][step][n], *TOL))), "")
                recs.append(Record("matches_single_process", not bad, bad,
                                   f"{RUNS[run][0]}, world size {ws}, after step {step}"))
        return recs

    def _judge_rank(self, ws, r, run, held, ref, out, events) -> list:
        from dpcourse.grading import oracles

        name, recs, units = RUNS[run][0], [], layout()
        tol_g = tolerance("gloo", torch.float32, "vs_single")
        flats = [f for u in units for f in u]
        expected = oracles.fsdp_step_collectives(
            [[(sum(math.prod(s) for s in shapes), k) for _, shapes, k in u] for u in units], ws)
        construction = [e for e in events_of(events, f"{name}: construction")
                        if e["op"] not in ("mark", "wait")]
        if construction:
            recs.append(Record("collectives_as_fsdp", False, f"rank {r}: UnitHooks(...) issued "
                               f"{construction[0]['op']} at construction; nothing is gathered "
                               "before the first forward", name))
        for step, rec in enumerate(out["steps"]):
            label = f"{name}, world size {ws}, rank {r}, step {step}"
            if held[step] is not None:
                recs += self._forward(rec["log"], units, held[step], label)
                recs += self._backward(rec, units, held[step], label)
            last = step == len(out["steps"]) - 1
            if last and out["stopped"]:
                recs.append(Record(out["stopped_criterion"], False, out["stopped"], label))
            for phase in ("forward", "backward"):
                got = [(e["op"], e["nbytes"]) for e in events_of(
                    events, f"{name}, step {step}: {phase}") if e["op"] not in ("mark", "wait")]
                if phase == "backward" and "after_backward" not in rec:
                    continue  # the step was stopped
                why = _compare_collectives(got, expected[phase])
                recs.append(Record("collectives_as_fsdp", not why, f"{phase}: {why}", label))
            later = [e for e in events_of(events, f"{name}, step {step}: optimizer step")
                     if e["op"] not in ("mark", "wait")]
            if later:
                recs.append(Record("collectives_as_fsdp", False, f"{later[0]['op']} after "
                                   "backward had returned", label))
            if "grads" not in rec:
                continue
            for (names, _, k), g in zip(flats, rec["grads"]):
                if not k:
                    recs.append(Record("reduce_scatters_gradients", g is None, "the frozen "
                                       "flat's shard has a gradient", label))
                    continue
                want = oracles.flat_shard([ref["grads"][step][n] for n in names], ws, r)
                bad = "no gradient" if g is None else mismatch(g, want, *tol_g)
                recs.append(Record("reduce_scatters_gradients", not bad,
                                   f"{names[0].split('.')[0]}'s shard .grad: {bad}", label))
        if out["stopped"]:
            recs.append(Record("matches_single_process", False,
                               f"rank {r}: training stopped in step {len(out['steps']) - 1}"
                               f": {out['stopped']}", name))
        return recs

    @staticmethod
    def _forward(log, units, before, label) -> list:
        recs = []
        for e in log:
            k = e["unit"]
            unit = UNITS[k]
            if e["at"] == "forward_start":
                detail = ""
                if not all(e["allocated"][k]):
                    detail = f"unit '{unit}' started its forward with a flat not gathered"
                else:
                    names = [n for n, _, _ in units[k]]
                    for n, w in zip([x for ns in names for x in ns], e["weights"]):
                        if not w["view_of_full"]:
                            detail = (f"{n} is not a view into its flat's full buffer (a "
                                      "copy: freeing the buffer would not free it)")
                        elif (bad := mismatch(w["value"], before[n], *TOL)):
                            detail = f"{n} at the start of the forward: {bad}"
                        if detail:
                            break
                recs.append(Record("gathers_before_forward", not detail, detail, label))
            elif e["at"] == "forward_end":
                kept = [f"'{UNITS[j]}'" for j, a in enumerate(e["allocated"]) if any(a)]
                recs.append(Record("frees_after_forward", not kept, f"when unit '{unit}' "
                                   f"ended its forward, unit(s) {', '.join(kept)} still held "
                                   "gathered weights", label))
        return recs

    @staticmethod
    def _backward(rec, units, before, label) -> list:
        recs, seen = [], []
        log = [e for e in rec["log"] if e["at"] == "backward_start"]
        for e in log:
            k = e["unit"]
            seen.append(k)
            detail = ""
            if not all(e["allocated"][k]):
                detail = f"unit '{UNITS[k]}' started its backward with its weights freed"
            else:
                names = [x for ns, _, _ in units[k] for x in ns]
                for n, w in zip(names, e["weights"]):
                    if (bad := mismatch(w["value"], before[n], *TOL)):
                        detail = f"{n} at the start of the backward: {bad}"
                        break
            recs.append(Record("gathers_before_backward", not detail, detail, label))
            kept = [f"'{UNITS[j]}'" for j in range(k + 1, len(UNITS))
                    if any(a and t for a, (_, _, t) in zip(e["allocated"][j], units[j]))]
            recs.append(Record("frees_after_backward", not kept, f"when unit '{UNITS[k]}' "
                               f"started its backward, unit(s) {', '.join(kept)} still held "
                               "gathered trainable weights", label))
        if "after_backward" in rec:
            kept = [f"'{UNITS[j]}'" for j, a in enumerate(rec["after_backward"])
                    if any(x and t for x, (_, _, t) in zip(a, units[j]))]
            recs.append(Record("frees_after_backward", not kept, "when backward returned, "
                               f"unit(s) {', '.join(kept)} still held gathered trainable "
                               "weights", label))
        return recs

    def explain(self, text):
        if "SIGSEGV" in text or "SIGBUS" in text:
            return ("A rank crashed inside torch: something read or wrote a tensor whose memory "
                    "had been freed. A flat's buffer may be freed only after the last use of its "
                    "weights, and must be allocated and gathered again before anything reads it.")
        if "has no memory" in text:
            return ("A collective touched a buffer that held no memory: it was not allocated "
                    "before the gather, or it was freed before the collective had finished.")
        if "not available to graded code" in text:
            return self.dist_why
        return ""
