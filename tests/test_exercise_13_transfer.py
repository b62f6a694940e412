"""Exercise 13 asks for a transfer: ZeRO-2 over micro-batches, with a frozen layer.

Lesson 13 steps ZeRO-1 once per step from full gradients; the exercise must free
every full gradient after its micro-batch, accumulate in the shards, and leave a
frozen layer out. The solution scores full marks, the generated exercise zero,
each planted mistake (tests/planted/zero_bugs.py) loses the criterion of its
cause with the hint for that cause, and the check's single-process reference is
what torch's DDP with ``no_sync`` and ``ZeroRedundancyOptimizer`` compute.
"""

import json
import os
import pathlib
import subprocess
import sys

import pytest
import torch

from dpcourse.grading import check
from dpcourse.grading.checks import get_spec
from dpcourse.grading.checks import ex13_sharded_step as ex
from dpcourse.grading.checks import zero_verdicts
from dpcourse.grading.runner import run_check
from dpcourse.grading.submission import extract
from notebook_helpers import notebook_module
from planted import zero_bugs

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _assert_all_passed(result):
    assert result.failed() == [], {c.name: c.detail for c in result.criteria if not c.passed}


def _planted(fn, sizes=(3,)):
    """Grade a planted answer on ``sizes`` ranks (3 shows every mistake below)."""
    spec = get_spec("sharded_step")
    spec.world_sizes = sizes
    cells, _ = extract([("<planted>", pathlib.Path(zero_bugs.__file__).read_text())])
    return run_check(spec, cells, dict(spec.roles, main=fn.__name__), timeout=60)


# -- torch itself ------------------------------------------------------------------------------

def test_adamw_decays_a_zero_gradient_and_skips_none():
    """What the frozen-layer hint says: .grad None is skipped, .grad zeros is decayed."""
    none, zeros = (torch.nn.Parameter(torch.ones(3)) for _ in range(2))
    zeros.grad = torch.zeros(3)
    torch.optim.AdamW([none, zeros], lr=1e-2, weight_decay=0.1).step()
    assert torch.equal(none.detach(), torch.ones(3))
    assert (zeros.detach() < 1).all()  # decoupled weight decay: p -= lr * wd * p
    torch.testing.assert_close(zeros.detach(), torch.full((3,), 1 - 1e-2 * 0.1))


def _torch_zero_no_sync(seed, per_rank):
    """Torch's own answer: DDP with no_sync over the micro-batches, ZeroRedundancyOptimizer."""
    import torch.distributed as dist
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel

    model = ex.make_model(seed)
    ddp = DistributedDataParallel(model)
    opt = ZeroRedundancyOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-2,
                                  weight_decay=0.1)
    out = []
    for x, y in per_rank[dist.get_rank()]:
        for m, (xm, ym) in enumerate(zip(x.chunk(ex.MICRO), y.chunk(ex.MICRO))):
            if m < ex.MICRO - 1:
                with ddp.no_sync():
                    ex.micro_loss(ddp, xm, ym).backward()
            else:
                ex.micro_loss(ddp, xm, ym).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        out.append([p.detach().clone() for p in model.parameters()])
    return out


@pytest.mark.parametrize("world_size", [2, 3])
def test_the_checks_reference_is_what_torch_computes(world_size):
    import random

    import dpcourse

    spec = get_spec("sharded_step")
    inputs = spec.make_inputs(random.Random(world_size), world_size)
    batches = [(torch.cat([i["batches"][s][0] for i in inputs]),
                torch.cat([i["batches"][s][1] for i in inputs])) for s in range(ex.STEPS)]
    want = zero_verdicts.single_process(inputs[0]["seed"], batches, batches)["params"]
    per_rank = [i["batches"] for i in inputs]
    for got in dpcourse.run(_torch_zero_no_sync, inputs[0]["seed"], per_rank,
                            world_size=world_size, device="cpu"):
        for step in range(ex.STEPS):
            for a, b in zip(got[step], want[step]):
                torch.testing.assert_close(a, b, rtol=ex.TOL[0], atol=ex.TOL[1])
    start = list(ex.make_model(inputs[0]["seed"]).parameters())
    for k in ex.FROZEN:  # the frozen layer stays as it was in torch's run too
        assert not start[k].requires_grad and torch.equal(want[-1][k], start[k].detach())


# -- the solution and the generated exercise -------------------------------------------------

def test_solution_scores_full_marks_on_2_and_3_ranks(tmp_path):
    sol = notebook_module(ROOT / "solutions" / "13_zero.ipynb", tmp_path / "solution_13x.py")
    try:
        result = check("sharded_step", sol.zero_step, quiet=True)
    finally:
        del sys.modules["solution_13x"]
    assert get_spec("sharded_step").world_sizes == (2, 3)
    _assert_all_passed(result)
    assert result.points == 10


@pytest.mark.timeout(600)
def test_generated_exercise_scores_zero_with_status_ok(tmp_path):
    folder, tmp = tmp_path / "subs" / "learner", tmp_path / "tmp"
    folder.mkdir(parents=True)
    tmp.mkdir()
    (folder / "13_zero.ipynb").write_text((ROOT / "exercises" / "13_zero.ipynb").read_text())
    out = tmp_path / "report.json"
    proc = subprocess.run([sys.executable, "-m", "dpcourse.cli", "grade", str(tmp_path / "subs"),
                           "--json", str(out)], capture_output=True, text=True, timeout=560,
                          env=dict(os.environ, TMPDIR=str(tmp), PYTHONPATH=str(ROOT)))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads(out.read_text())
    [nb] = report["notebooks"]
    assert nb["status"] == "ok", nb
    [row] = [r for r in report["results"] if r["check"] == "sharded_step"]
    assert row["points"] == 0 and row["total"] > 0
    assert any("not implemented yet" in n for n in row["notes"]), row["notes"]


# -- planted mistakes: each loses the criterion of its cause, with that cause's hint ----------

WRONG_SHARD = {"shard_gradients_averaged", "matches_single_process", "sharded_collectives_only"}


@pytest.mark.parametrize("bug, first, judged_failed, hint", [
    # the lesson's recipe, transcribed: right numbers, ZeRO-1's memory
    ("zero1_transcribed", "full_gradients_freed", {"full_gradients_freed"},
     "lesson 13's zero1 step keeps the full"),
    ("summed_not_averaged", "shard_gradients_averaged", WRONG_SHARD, "divide by N"),
    ("divided_by_micro_count_again", "shard_gradients_averaged", WRONG_SHARD, "Divide by N only"),
    ("overwrites_shard_grad", "shard_gradients_averaged", WRONG_SHARD,
     "add each reduce-scatter's result"),
    ("floor_chunk", "shard_gradients_averaged", WRONG_SHARD, "chunk_size = ceil(numel / N)"),
    ("zeros_for_frozen", "frozen_parameters_untouched",
     {"frozen_parameters_untouched", "sharded_collectives_only"},
     "A zero gradient is not no gradient"),
    ("all_reduce_then_slice", "sharded_collectives_only", {"sharded_collectives_only"},
     "an all-reduce sends the whole"),
    ("no_gather", "matches_single_process", {"matches_single_process"}, "All-gather the chunks"),
])
def test_planted_mistake_loses_its_criterion_with_its_hint(bug, first, judged_failed, hint):
    """The first failing criterion is the mistake's own, with the hint for its cause; others
    fail only where that mistake makes them (WRONG_SHARD: what a wrong gradient can move)."""
    result = _planted(getattr(zero_bugs, bug))
    judged = {c.name for c in result.criteria
              if not c.passed and not c.detail.startswith("not credited")}
    assert result.failed()[0] == first, {c.name: c.detail for c in result.criteria}
    assert first in judged and judged <= judged_failed, judged
    if judged_failed is not WRONG_SHARD:
        assert judged == judged_failed
    assert hint in result.criterion(first).hint, result.criterion(first)
    assert result.points < 10


def test_the_cause_of_a_wrong_shard_gradient_is_in_its_why_line():
    causes = {"summed_not_averaged": "summed over the ranks",
              "divided_by_micro_count_again": "divided by the micro-batch count twice",
              "overwrites_shard_grad": "the last micro-batch's share only",
              "floor_chunk": "another range of the gradient"}
    for bug, cause in causes.items():
        result = _planted(getattr(zero_bugs, bug), sizes=(2,))
        detail = result.criterion("shard_gradients_averaged").detail
        assert f"({cause})" in detail, (bug, detail)


def test_a_literal_transcription_stops_at_the_frozen_layer_with_the_frozen_hint():
    result = _planted(zero_bugs.zero1_transcribed_literally)
    assert result.points == 0
    texts = " ".join(c.detail + " " + c.hint for c in result.criteria)
    assert "NoneType" in texts and "A frozen parameter (requires_grad=False) has no .grad" in texts
