"""Exercise 10, a Join-aware bucketed wrapper: the check, its reference, its wrong answers.

The reference solution (solutions/10) earns every point; the generated exercise
earns none and starts no rank; each wrong answer below, one mistake made into the
solution, fails the criteria that name its cause, with the hint for it. The
grader's reference is held against torch DDP under torch's Join on gloo.
"""

import importlib.util
import pathlib
import sys
import time

import pytest
import torch

from dpcourse.grading import check

ROOT = pathlib.Path(__file__).resolve().parent.parent
NOTEBOOK = "10_when_ranks_disagree.ipynb"

# One mistake each: (text of the solution, what the mistaken version has instead).
NO_SHADOW = ("dist.all_reduce(torch.zeros(n, dtype=bucket[0].dtype, device=bucket[0].device))",
             "pass  # main_hook issues nothing")
ALWAYS_WORLD_SIZE = ("        return int(work.get_future().wait()[0].item())",
                     "        return dist.get_world_size()")
ALWAYS_RANKS_WITH_DATA = ("if work is None or self.divide_by_initial_world_size:",
                          "if work is None:")
COPY_FROM_RANK_0 = ("dist.broadcast(t, src=int(src.item()))", "dist.broadcast(t, src=0)")
ONLY_JOINED_AGREE = ("        src = torch.tensor([dist.get_rank() if is_last_joiner else -1],",
                     "        if is_last_joiner:\n            return\n"
                     "        src = torch.tensor([dist.get_rank() if is_last_joiner else -1],")


def _code(folder: str) -> str:
    import nbformat

    nb = nbformat.read(ROOT / folder / NOTEBOOK, as_version=4)
    return "\n\n".join(c.source for c in nb.cells
                       if c.cell_type == "code" and "check(" not in c.source)


@pytest.fixture
def wrapper(tmp_path):
    """Load ``JoinableDDP`` from a notebook's code, with one mistake planted, as a module file."""
    def load(folder: str = "solutions", mistake=None):
        source = _code(folder)
        if mistake is not None:
            assert mistake[0] in source, "the solution changed: update the planted mistake"
            source = source.replace(mistake[0], mistake[1])
        name = f"join_ex10_{len(list(tmp_path.iterdir()))}"
        path = tmp_path / f"{name}.py"
        path.write_text(source)
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # check() reads the definitions' source from the file
        spec.loader.exec_module(module)
        return module.JoinableDDP
    yield load
    for name in [n for n in sys.modules if n.startswith("join_ex10_")]:
        del sys.modules[name]


def test_solution_earns_every_point(wrapper):
    result = check("join_shadow", wrapper(), quiet=True)
    assert result.failed() == [], {c.name: c.detail for c in result.criteria if not c.passed}
    assert result.points == 10


def test_the_exercise_as_handed_out_scores_zero_at_once(wrapper):
    t0 = time.monotonic()
    result = check("join_shadow", wrapper("exercises"), quiet=True)
    assert result.points == 0
    assert "Exercise 10." in result.notes[0]  # the stub's message: what to write first
    # The hint points at the stub, not at a cause (main_hook's shadows) the run never reached.
    from dpcourse.grading.runner import STUB_HINT

    assert [c.hint for c in result.criteria if c.hint] == [STUB_HINT]
    assert time.monotonic() - t0 < 10  # a stub starts no rank


def test_no_shadow_all_reduce_is_caught_where_the_ranks_part(wrapper):
    result = check("join_shadow", wrapper(mistake=NO_SHADOW), quiet=True)
    assert result.points == 0
    shadow = result.criterion("shadows_each_step")
    assert not shadow.passed and "disagree on collective number" in shadow.detail
    assert "all_reduce of 4 bytes" in shadow.detail  # Join's own round against a bucket
    assert "main_hook issued fewer collectives" in shadow.hint


@pytest.mark.parametrize("mistake, criterion, says", [
    (ALWAYS_WORLD_SIZE, "average_over_ranks_with_data", "torch divides by 1"),
    (ALWAYS_RANKS_WITH_DATA, "average_over_world", "torch divides by"),
], ids=["always world size", "always ranks with data"])
def test_a_wrong_divisor_fails_its_criterion_with_the_divisor_named(wrapper, mistake, criterion,
                                                                    says):
    result = check("join_shadow", wrapper(mistake=mistake), quiet=True)
    assert set(result.failed()) == {criterion, "matches_torch_join"}
    detail = result.criterion(criterion).detail
    assert "ranks with data" in detail and says in detail
    assert "notify_join_context" in result.criterion("average_over_ranks_with_data").hint or \
        criterion == "average_over_world"
    assert 0 < result.points < 10


def test_copying_from_rank_0_fails_only_the_final_copy(wrapper):
    result = check("join_shadow", wrapper(mistake=COPY_FROM_RANK_0), quiet=True)
    assert set(result.failed()) == {"ranks_agree_at_exit", "matches_torch_join"}
    agree = result.criterion("ranks_agree_at_exit")
    assert "post_hook" in agree.detail and "is_last_joiner" in agree.hint


def test_a_last_joiner_skipping_the_final_agreement_is_named(wrapper):
    result = check("join_shadow", wrapper(mistake=ONLY_JOINED_AGREE), quiet=True)
    assert result.points == 0
    first = result.criterion("shadows_each_step")  # a stopped round is reported here
    assert "disagree on collective number" in first.detail and "broadcast" in first.detail
    assert "post_hook runs on every rank" in first.hint


def test_hints_name_causes_without_handing_over_code():
    import re

    from dpcourse.grading.checks.ex10_join import JoinShadow

    spec = JoinShadow()
    code = re.compile(r"\w\(|\s=\s|%|\*\*|>=|\bdist\.\w|\.\w+\(")  # as for exercises 01-09
    explained = [spec.explain(t) for t in (
        "the ranks disagree on collective number 3: rank 0: all_reduce of 4 bytes; ...",
        "the ranks disagree on collective number 3: rank 0: broadcast of 64 bytes; ...",
        "the ranks disagree on collective number 3: rank 0: all_reduce of 64 bytes; ...",
        "world size 2: not finished after 45 s.", "AssertionError: Check that the <class> "
        "constructor calls the ``Joinable`` constructor", "TypeError: Can't instantiate "
        "abstract class JoinableDDP")]
    assert all(explained)
    for hint in [c.hint for c in spec.criteria] + explained:
        assert hint and not code.search(hint), hint


def _torch_ddp_join(seeds, cases):
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.algorithms.join import Join

    from dpcourse.grading.checks import ex10_join as ex

    rank, out = dist.get_rank(), []
    for batches, divide in cases:
        model = ex.make_model(seeds[rank])
        ddp = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=ex.BUCKET_CAP_MB)
        opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=ex.LR)
        grads = []
        with Join([ddp], divide_by_initial_world_size=divide):
            for x, y in batches[rank]:
                opt.zero_grad(set_to_none=True)
                nn.functional.mse_loss(ddp(x), y).backward()
                grads.append([p.grad.clone() for p in model.parameters() if p.requires_grad])
                opt.step()
        out.append({"grads": grads, "params": [p.detach().clone() for p in model.parameters()]})
    return out


@pytest.mark.parametrize("world_size", [2, 3])
def test_the_reference_is_what_torch_ddp_under_join_does(world_size):
    import dpcourse
    from dpcourse.grading.checks import ex10_join as ex
    from dpcourse.grading.checks.join_verdicts import join_reference

    g = torch.Generator().manual_seed(world_size)
    cases = []
    for _, counts, _ in ex.CASES[world_size]:
        batches = [[(torch.randn(ex.BATCH, ex.IN, generator=g),
                     torch.randn(ex.BATCH, ex.OUT, generator=g)) for _ in range(c)]
                   for c in counts]
        cases += [(batches, True), (batches, False)]
    seeds = [100 + r for r in range(world_size)]
    runs = dpcourse.run(_torch_ddp_join, seeds, cases, world_size=world_size, timeout=120)
    for k, (batches, divide) in enumerate(cases):
        ref = join_reference(seeds[0], batches, divide)
        for rank, run in enumerate(runs):
            got = run[k]
            for step, grads in enumerate(got["grads"]):  # the steps this rank had data for
                torch.testing.assert_close(grads, ref["grads"][step], rtol=1e-5, atol=1e-6)
            # every rank, joined early or not, ends with the reference's parameters,
            # the frozen layer (rank 0's, from the broadcast at construction) included
            torch.testing.assert_close(got["params"], ref["params"], rtol=1e-5, atol=1e-6)
    uneven = [k for k, (b, _) in enumerate(cases) if len({len(x) for x in b}) > 1]
    for k in uneven[::2]:  # the two divisors really differ on uneven counts
        a, b = runs[-1][k]["params"], runs[-1][k + 1]["params"]
        assert max((x - y).abs().max().item() for x, y in zip(a, b)) > 1e-4
