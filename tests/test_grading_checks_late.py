"""Checks of exercises 11 and 15 count what crosses the wire, not only the values that arrive.

Each planted submission returns the right values but sends more than the exercise's
rule allows (a broadcast besides the bucket's all-reduce; fixes written with one
broadcast per rank): it loses the criteria about that traffic (and what is credited
only once they pass), each with the hint of its cause, while the solution keeps full
marks under the same checks.
"""

import pathlib

import nbformat
import pytest

from dpcourse.grading.checks import get_spec
from dpcourse.grading.runner import run_check
from dpcourse.grading.submission import extract

ROOT = pathlib.Path(__file__).resolve().parent.parent

# Exercise 11: the solution's hook, then rank 0's result broadcast "so that every rank agrees".
HOOK_THEN_BROADCAST = '''
import torch
import torch.distributed as dist


def error_feedback_hook(state, bucket):
    buffer, index, world = bucket.buffer(), bucket.index(), dist.get_world_size()
    order = [id(p) for p in bucket.parameters()]
    residual = state.get(index)
    if residual is None:
        residual = torch.zeros_like(buffer)
    elif state[("order", index)] != order:
        old = dict(zip(state[("order", index)], residual.split(state[("sizes", index)])))
        residual = torch.cat([old[id(p)].view(-1) for p in bucket.parameters()])
    state[("order", index)] = order
    state[("sizes", index)] = [p.numel() for p in bucket.parameters()]
    corrected = buffer + residual
    compressed = corrected.to(torch.bfloat16).div_(world)
    state[index] = corrected - compressed.float() * world
    dist.all_reduce(compressed)
    result = compressed.float()
    dist.broadcast(result, 0)
    fut = torch.futures.Future()
    fut.set_result(buffer.copy_(result))
    return fut
'''

# Exercise 15: each fix gives the right answer, through one broadcast per rank.
FIXES_BY_BROADCAST = '''
def global_histogram(labels, num_classes, group=None):
    mine, total = torch.bincount(labels, minlength=num_classes), None
    for src in range(dist.get_world_size(group)):
        theirs = mine.clone()
        dist.broadcast(theirs, src, group=group)
        total = theirs if total is None else total + theirs
    return total


def pass_to_the_right(tensor, group=None):
    rank, n = dist.get_rank(group), dist.get_world_size(group)
    out = None
    for src in range(n):
        buf = tensor.clone()
        dist.broadcast(buf, src, group=group)
        if src == (rank - 1) % n:
            out = buf
    return out


def should_stop(flag, group=None):
    stop = False
    for src in range(dist.get_world_size(group)):
        t = torch.tensor([float(flag)])
        dist.broadcast(t, src, group=group)
        stop = stop or bool(t.item())
    return stop
'''


def _grade(check: str, notebook: str, planted: str | None, world_sizes=None):
    """Grade the solution notebook's code cells, with ``planted`` defined after them."""
    nb = nbformat.read(ROOT / "solutions" / notebook, as_version=4)
    sources = [(f"<cell {i}>", c.source) for i, c in enumerate(nb.cells) if c.cell_type == "code"]
    if planted:
        sources.append(("<planted>", planted))
    cells, _ = extract(sources)
    spec = get_spec(check)
    if world_sizes:
        spec.world_sizes = world_sizes
    return run_check(spec, cells, spec.roles)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("planted", [None, FIXES_BY_BROADCAST], ids=["solution", "broadcasts"])
def test_exercise_15_fixes_are_judged_by_what_crossed_the_wire(planted):
    result = _grade("debugging", "15_debugging.ipynb", planted)
    report = {c.name: (c.detail, c.hint) for c in result.criteria if not c.passed}
    if planted is None:
        assert report == {} and result.score == 1.0
        return
    traffic = {"histogram_sums", "exchange_completes", "stop_agrees"}
    assert set(result.failed()) - traffic <= {"no_delegation", "no_deadlock"}, report
    assert traffic <= set(result.failed()), report
    for name in set(result.failed()) - traffic:  # credited once histogram_sums passes
        assert result.criterion(name).detail.startswith("not credited"), report
    hints = {"histogram_sums": "one all-reduce sums them", "exchange_completes": "rank + 1",
             "stop_agrees": "one all-reduce of one number"}
    for name in traffic:
        crit = result.criterion(name)
        assert "right value" in crit.detail and "broadcast of" in crit.detail, crit.detail
        assert hints[name] in crit.hint, crit.hint
    assert 0 < result.points < result.max_points


@pytest.mark.timeout(300)
@pytest.mark.parametrize("planted", [None, HOOK_THEN_BROADCAST], ids=["solution", "broadcast"])
def test_exercise_11_counts_every_collective_of_a_step(planted):
    result = _grade("error_feedback_hook", "11_inside_the_reducer.ipynb", planted, (2,))
    report = {c.name: (c.detail, c.hint) for c in result.criteria if not c.passed}
    if planted is None:
        assert report == {} and result.score == 1.0
        return
    assert set(result.failed()) == {"sends_bf16"}, report
    crit = result.criterion("sends_bf16")
    assert "broadcast of" in crit.detail and "all_reduce of" in crit.detail, crit.detail
    assert "A broadcast crossed the wire" in crit.hint
    assert 0 < result.points < result.max_points


@pytest.mark.parametrize("world_size", [2, 3])
def test_exercise_15_mixed_flag_case_sets_exactly_one_flag(world_size):
    """should_stop's third case has one rank that wants to stop: a fix that reduces only on
    that rank then hangs on every run, not on some."""
    import random

    spec = get_spec("debugging")
    for seed in range(200):
        inputs = spec.make_inputs(random.Random(seed), world_size)
        flags = [[i["flags"][k] for i in inputs] for k in range(3)]
        assert flags[:2] == [[False] * world_size, [True] * world_size]
        assert sum(flags[2]) == 1, (seed, flags)
