"""The grader's verdicts on exercise 10, and the reference they compare with.

:func:`join_reference` computes what torch DDP under ``Join`` leaves (the tests
hold it against ``DistributedDataParallel`` + ``Join`` on gloo); :func:`judge`
compares the ranks' outputs and the grader's record of their collectives with
it. Grader-only: graded ranks cannot import this module (see
:mod:`dpcourse.grading.rank`).
"""

from __future__ import annotations

from functools import partial

import torch

from dpcourse.grading import oracles
from dpcourse.grading.checks.base import CaseVerdict, compare, describe_ops, events_of
from dpcourse.grading.checks.ex10_join import CASES, LR, make_model
from dpcourse.grading.criteria import first_mismatch, mismatch, tolerance


def join_reference(seed0: int, batches: list, divide_by_initial_world_size: bool) -> dict:
    """What torch DDP under ``Join`` computes, in one process.

    Args:
        seed0: rank 0's seed (DDP starts every replica from rank 0's parameters).
        batches: ``batches[rank]`` is that rank's list of ``(x, y)``; the lengths differ.
        divide_by_initial_world_size: as ``Join``'s keyword.

    Returns:
        ``{"grads": [step][trainable parameter], "params": [parameter]}``: at step s, the
        ranks that still have a batch each divide their gradient by the world size (or by
        how many they are) and the sum goes to every one of them; a joined rank adds zeros.
        After ``Join`` every rank holds the parameters of a rank that joined last.
    """
    steps = max(len(b) for b in batches)
    ref = oracles.train_one_process(
        make_model, seed0, [[b[step:step + 1] for b in batches] for step in range(steps)],
        partial(torch.optim.SGD, lr=LR),
        divide_by_initial_world_size=divide_by_initial_world_size)
    trainable = [p.requires_grad for p in make_model(0).parameters()]
    return {"grads": [[g for g, k in zip(grads, trainable) if k] for grads in ref["grads"]],
            "params": ref["params"][-1]}


def judge(ws, inputs, outputs, events) -> list[CaseVerdict]:
    """Compare every rank's outputs and collectives with torch DDP + ``Join``'s; one world size."""
    recs = []
    names = [n for n, _ in make_model(0).named_parameters()]
    trainable = [n for n, p in make_model(0).named_parameters() if p.requires_grad]
    tol = tolerance("gloo", torch.float32, "vs_ddp")
    for k, (case, counts, divide) in enumerate(CASES[ws]):
        label = f"world size {ws}, {case} (batches per rank {list(counts)})"
        batches = [inputs[r]["cases"][k]["batches"] for r in range(ws)]
        ref = join_reference(inputs[0]["seed"], batches, divide)
        other = join_reference(inputs[0]["seed"], batches, not divide)
        for r in range(ws):
            got = outputs[r][k]
            recs.append(_interface(got, r, label))
            recs.append(_shadow(events[r], counts, r, case, label, events))
            crit = "average_over_world" if divide else "average_over_ranks_with_data"
            recs.append(_grads(crit, got, ref, other, trainable, counts, r, ws, divide,
                               tol, label))
            recs.append(_agree(got, outputs, k, counts, r, label))
            recs.append(compare("matches_torch_join", names, got["params"], ref["params"], tol,
                                label, f"rank {r}, "))
    return recs


def _interface(got, r, label) -> CaseVerdict:
    detail = ("join_hook returned an object without main_hook and post_hook"
              if not got["hook_ok"] else
              f"join_device is {got['device']}, the parameters are on cpu"
              if got["device"] != "cpu" else
              "join_process_group is not dist.group.WORLD" if not got["group_ok"] else "")
    return CaseVerdict("join_interface", not detail, f"rank {r}: {detail}" if detail else "",
                  label)


def _shadow(mine, counts, r, case, label, events) -> CaseVerdict:
    """Compare the all-reduces of each main_hook call with a rank-with-data's same step."""
    def sizes_between(evs, start, end):
        out, inside = [], []
        for e in evs:
            if e["op"] == "mark" and e["label"] == start:
                inside = []
            elif e["op"] == "mark" and e["label"] == end:
                out.append(inside)
                inside = None
            elif inside is not None and e["op"] in ("all_reduce", "broadcast", "barrier"):
                inside.append((e["op"], e.get("nbytes", 0)))
        return out

    training = events_of(mine, f"{case}: training")
    shadows = sizes_between(training, "main_hook", "main_hook_end")
    last = max(counts)
    if len(shadows) != last - counts[r]:
        return CaseVerdict("shadows_each_step", False, f"rank {r} ran out of data after "
                      f"{counts[r]} step(s) of {last}; Join called main_hook "
                      f"{len(shadows)} time(s)", label)
    longest = counts.index(last)
    theirs = sizes_between(events_of(events[longest], f"{case}: training"), "finish",
                           "finish_end")
    for i, got in enumerate(shadows):
        want = theirs[counts[r] + i]
        if got != want:
            none = "no collective"
            return CaseVerdict("shadows_each_step", False, f"rank {r}, step {counts[r] + i}: "
                               f"main_hook issued {describe_ops(got, none)}; rank {longest}, "
                               f"which had data, issued {describe_ops(want, none)} to "
                               "synchronise its gradients", label)
    return CaseVerdict("shadows_each_step", True, "", label)


def _grads(crit, got, ref, other, trainable, counts, r, ws, divide, tol, label) -> CaseVerdict:
    if len(got["grads"]) != counts[r]:
        return CaseVerdict(crit, False, f"rank {r} trained {len(got['grads'])} step(s), "
                      f"expected {counts[r]}", label)
    for step, (mine, want, alt) in enumerate(zip(got["grads"], ref["grads"],
                                                other["grads"])):
        bad = first_mismatch(trainable, mine, want, tol, ".grad")
        if not bad:
            continue
        active = sum(c > step for c in counts)
        detail = f"rank {r}, step {step} ({active} of {ws} ranks with data), {bad}"
        if all(a is not None and not mismatch(a, b, *tol) for a, b in zip(mine, alt)):
            detail += (f" — this is the sum divided by {active if divide else ws}; with "
                       f"divide_by_initial_world_size={divide} torch divides by "
                       f"{ws if divide else active}")
        return CaseVerdict(crit, False, detail, label)
    return CaseVerdict(crit, True, "", label)


def _agree(got, outputs, k, counts, r, label) -> CaseVerdict:
    """Every rank ends with the parameters a last joiner had before the post-hooks ran."""
    last = [q for q, c in enumerate(counts) if c == max(counts)]
    sources = [outputs[q][k]["last_own"] for q in last]
    if any(all(torch.equal(a, b) for a, b in zip(got["params"], src)) for src in sources):
        return CaseVerdict("ranks_agree_at_exit", True, "", label)
    if r not in last and all(torch.equal(a, b) for a, b in zip(got["params"],
                                                                got["last_own"])):
        detail = (f"rank {r} ran out of data after {counts[r]} of {max(counts)} steps and "
                  "still holds its own parameters: post_hook copied nothing onto it")
    elif r in last:
        detail = (f"rank {r} trained to the end, and post_hook replaced its parameters "
                  "with those of a rank that joined earlier")
    else:
        detail = (f"rank {r} holds parameters that no rank that joined last (rank(s) "
                  f"{', '.join(map(str, last))}) had at the end of training")
    return CaseVerdict("ranks_agree_at_exit", False, detail, label)
