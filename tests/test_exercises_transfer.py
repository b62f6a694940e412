"""Transfer exercises and the graded exercises of lessons 01 and 08.

Each reference solution (from solutions/) passes every criterion of its check;
each planted wrong answer (tests/planted/transfer_bugs.py) fails the criterion
that names its mistake. The independent references the checks use are held
against torch itself (torch DDP, torch's bucket rule).
"""

import pathlib
import sys

import pytest
import torch

from dpcourse.grading import check
from notebook_helpers import notebook_module
from planted import transfer_bugs

ROOT = pathlib.Path(__file__).resolve().parent.parent


@pytest.fixture
def solution(tmp_path):
    """Load a solution notebook's code cells (without its check calls) as a module from a file."""
    def load(name: str):
        return notebook_module(ROOT / "solutions" / name, tmp_path / f"solution_{name[:2]}.py")
    yield load
    for name in [n for n in sys.modules if n.startswith("solution_")]:
        del sys.modules[name]


def _assert_all_passed(result):
    assert result.failed() == [], {c.name: c.detail for c in result.criteria if not c.passed}


# -- 01: the gradient of the mean from uneven shards ---------------------------------------

def test_mean_gradient_solution_passes_every_criterion(solution):
    sol = solution("01_why_data_parallel.ipynb")
    _assert_all_passed(check("mean_gradient", sol.global_mean_gradient,
                             shard_sizes=sol.shard_sizes, quiet=True))


@pytest.mark.parametrize("bug, failed", [
    (transfer_bugs.mean_gradient_plain_mean, {"uneven_shards", "empty_shard"}),
    (transfer_bugs.mean_gradient_over_ranks_with_examples, {"uneven_shards"}),
    (transfer_bugs.mean_gradient_summed, {"equal_shards", "uneven_shards", "empty_shard"})])
def test_mean_gradient_bugs_fail_their_criteria(bug, failed):
    result = check("mean_gradient", bug, quiet=True)
    assert failed <= set(result.failed())
    assert "shard_sizes_like_tensor_split" not in result.failed()
    if "equal_shards" not in failed:
        assert result.criterion("equal_shards").passed


def test_shard_sizes_with_the_extra_at_the_end_fail():
    result = check("mean_gradient", transfer_bugs.mean_gradient_plain_mean,
                   shard_sizes=transfer_bugs.shard_sizes_extra_last, quiet=True)
    assert "shard_sizes_like_tensor_split" in result.failed()


def test_an_empty_shard_has_a_nan_loss_but_a_zero_gradient_in_torch():
    from dpcourse.grading.checks.ex01_mean_gradient import IN, OUT, flat_grad

    model, x, y = torch.nn.Linear(IN, OUT), torch.zeros(0, IN), torch.zeros(0, OUT)
    assert torch.nn.functional.mse_loss(model(x), y).isnan()
    assert flat_grad(model, x, y).eq(0).all()


# -- 02: all-gather of pieces of different lengths -----------------------------------------

def test_uneven_all_gather_solution_passes_every_criterion(solution):
    sol = solution("02_collectives.ipynb")
    _assert_all_passed(check("uneven_all_gather", sol.all_gather_uneven, quiet=True))


@pytest.mark.parametrize("bug, failed, cause", [
    (transfer_bugs.gather_own_length_buffers, None, "the sender's number of elements"),
    (transfer_bugs.gather_own_piece_first, {"rank_order"}, "follow its sender's rank"),
    (transfer_bugs.gather_in_default_dtype, {"keeps_dtype"}, "default dtype (float32)"),
    (transfer_bugs.gather_padded, {"uneven_lengths", "empty_piece"},
     "room reserved for the longest piece")])
def test_uneven_all_gather_bugs_fail_the_criteria_of_their_cause(bug, failed, cause):
    result = check("uneven_all_gather", bug, quiet=True)
    first = result.failed()[0]
    if failed is None:  # a collective of mismatched sizes stops the round
        assert first == "uneven_lengths" and result.points == 0
        assert "disagree on collective" in result.criterion(first).detail
    else:
        own = {c.name for c in result.criteria} - {"no_delegation", "no_deadlock",
                                                   "inputs_unchanged"}
        assert set(result.failed()) & own - {"rank_order", "keeps_dtype"} == \
            failed - {"rank_order", "keeps_dtype"}
        assert failed <= set(result.failed())
        if "uneven_lengths" not in failed:
            assert result.points > 5  # the other causes are credited
    assert cause in result.criterion(first).hint  # the hint names this failure's cause


def _gather_with_torch(pieces, fn_source):
    """Every rank's pieces through torch's all_gather (padded to the longest, then trimmed),
    and through the solution, on real gloo ranks."""
    import torch.distributed as dist

    rank, n = dist.get_rank(), dist.get_world_size()
    mine = pieces[rank]
    longest = max(len(p) for p in pieces)
    padded = torch.zeros(longest, dtype=mine.dtype)
    padded[:len(mine)] = mine
    out = [torch.empty_like(padded) for _ in range(n)]
    dist.all_gather(out, padded)
    by_torch = torch.cat([t[:len(p)] for t, p in zip(out, pieces)])
    scope = {}
    exec(fn_source, scope)
    return by_torch, scope["all_gather_uneven"](mine.clone())


@pytest.mark.parametrize("world_size", [2, 3])
def test_the_concatenation_the_check_expects_is_torchs_all_gather(world_size):
    import nbformat

    import dpcourse

    nb = nbformat.read(ROOT / "solutions" / "02_collectives.ipynb", as_version=4)
    source = "\n\n".join(c.source for c in nb.cells  # the imports and the definition
                         if c.cell_type == "code" and "check(" not in c.source)
    g = torch.Generator().manual_seed(world_size)
    for dtype, lengths in ((torch.float64, [3, 7, 0][:world_size]),
                           (torch.int64, [5, 1, 9][:world_size])):
        pieces = [(torch.randn(n, generator=g, dtype=torch.float64) * 2**40).to(dtype)
                  for n in lengths]
        for by_torch, by_solution in dpcourse.run(_gather_with_torch, pieces, source,
                                                  world_size=world_size):
            assert torch.equal(by_torch, torch.cat(pieces))  # what the check compares with
            assert torch.equal(by_solution, by_torch) and by_solution.dtype == dtype


# -- 03: naive DDP with buffers, unused and frozen parameters ------------------------------

def test_complete_naive_ddp_solution_passes_every_criterion(solution):
    sol = solution("03_naive_ddp.ipynb")
    _assert_all_passed(check("naive_ddp_complete", sol.CompleteNaiveDDP, quiet=True))


@pytest.mark.parametrize("bug, failed", [
    (transfer_bugs.CompleteStaleBuffers, {"buffers_follow_rank_0"}),
    (transfer_bugs.CompleteZerosForUnused, {"unused_parameter_keeps_no_grad"}),
    (transfer_bugs.CompleteSyncsFrozen, {"unused_parameter_keeps_no_grad",
                                         "frozen_parameter_untouched"})])
def test_complete_naive_ddp_bugs_fail_their_criterion(bug, failed):
    assert set(check("naive_ddp_complete", bug, quiet=True).failed()) == failed


def test_skipping_missing_gradients_is_caught_where_the_ranks_disagree():
    result = check("naive_ddp_complete", transfer_bugs.CompleteSkipsMissing, timeout=20,
                   quiet=True)
    assert "no_deadlock" in result.failed()
    assert "extra used on rank(s) [0]" in result.criterion("no_deadlock").detail or \
        "disagree" in result.criterion("no_deadlock").detail


def _torch_ddp_branchy(seeds, batches):
    import torch.distributed as dist
    from torch import nn

    from dpcourse.grading.checks import ex03_buffers_unused as ex

    rank = dist.get_rank()
    model = ex.make_model(seeds[rank], rank)
    ddp = nn.parallel.DistributedDataParallel(model, find_unused_parameters=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    out = []
    for step, per_rank in enumerate(batches):
        model.use_extra = ex.uses_extra(step, rank)
        opt.zero_grad(set_to_none=True)
        x, y = per_rank[rank]
        nn.functional.mse_loss(ddp(x), y).backward()
        grads = [None if p.grad is None else p.grad.clone() for p in model.parameters()]
        opt.step()
        out.append({"grads": grads, "params": [p.detach().clone() for p in model.parameters()],
                    "buffers": [b.clone() for b in model.buffers()]})
    return out


def test_the_ddp_reference_of_exercise_03_is_what_torch_ddp_does():
    import dpcourse
    from dpcourse.grading.checks import ex03_buffers_unused as ex

    g = torch.Generator().manual_seed(3)
    batches = [[(torch.randn(ex.BATCH, 8, generator=g), torch.randn(ex.BATCH, 4, generator=g))
                for _ in range(2)] for _ in range(3)]
    seeds = [11, 12]
    runs = dpcourse.run(_torch_ddp_branchy, seeds, batches, world_size=2)
    ref = ex.ddp_reference(seeds[0], batches)
    for rank, run in enumerate(runs):
        for step, got in enumerate(run):
            for a, b in zip(got["grads"], ref["grads"][step]):
                assert (a is None) == (b is None), (rank, step)
                if a is not None:
                    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(got["params"], ref["params"][step], rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(got["buffers"], ref["buffers"][step][rank], rtol=1e-5,
                                       atol=1e-6)


# -- 04: all-reduce in log2(N) rounds -------------------------------------------------------

def test_halving_doubling_solution_passes_every_criterion(solution):
    sol = solution("04_ring_all_reduce.ipynb")
    _assert_all_passed(check("halving_doubling", sol.halving_doubling_all_reduce, quiet=True))


def test_ring_is_right_but_fails_log_rounds():
    result = check("halving_doubling", transfer_bugs.all_reduce_ring, quiet=True)
    # on 3 and 5 ranks its bytes per rank are the ring's, not the fold's
    assert set(result.failed()) == {"log_rounds", "bytes_other_sizes"}
    assert "messages, at most" in result.criterion("log_rounds").detail


def test_whole_tensor_swaps_fail_only_the_byte_criteria():
    result = check("halving_doubling", transfer_bugs.all_reduce_whole_tensor_swaps, quiet=True)
    assert set(result.failed()) == {"bandwidth_power_of_two", "bytes_other_sizes"}


# -- 05: torch's small first bucket ---------------------------------------------------------

def test_first_bucket_solution_passes_every_criterion(solution):
    sol = solution("05_bucketing.ipynb")
    _assert_all_passed(check("first_bucket", sol.assign_buckets_like_torch, quiet=True))


@pytest.mark.parametrize("bug, criterion", [
    (transfer_bugs.first_bucket_at_the_wrong_end, "first_bucket_small"),
    (transfer_bugs.small_cap_for_every_bucket, "later_buckets_use_cap"),
    (transfer_bugs.frozen_parameters_bucketed, "frozen_left_out")])
def test_first_bucket_bugs_fail_their_criterion(bug, criterion):
    result = check("first_bucket", bug, quiet=True)
    assert criterion in result.failed() and "matches_torch_rule" in result.failed()
    if criterion != "first_bucket_small":
        assert result.criterion("first_bucket_small").passed  # the cause is elsewhere


def test_first_bucket_rule_is_torchs_own():
    import torch.distributed as dist

    from dpcourse.grading.oracles import MIB, buckets_with_first

    for sizes, frozen, cap, first in [([3 * 2**18, 5 * 2**18, 100, 2**17, 2**17, 10], (), 25.0,
                                       1.0), ([1000] * 9, (), 8000 / MIB, 2000 / MIB),
                                      ([5, 6, 7, 8, 9], (), 40 / MIB, 0.0),
                                      ([1000, 1000, 30, 1000, 20, 1000], (4, 5), 4000 / MIB,
                                       1000 / MIB)]:
        order = [i for i in reversed(range(len(sizes))) if i not in frozen]
        tensors = [torch.zeros(sizes[i]) for i in order]
        buckets, _ = dist._compute_bucket_assignment_by_size(
            tensors, [int(first * MIB), int(cap * MIB)], [False] * len(order))
        nbytes = [4 * n for n in sizes]
        trainable = [i not in frozen for i in range(len(sizes))]
        assert [[order[j] for j in b] for b in buckets] == \
            buckets_with_first(nbytes, trainable, cap, first)


def _ddp_buckets(bucket_cap_mb):
    """Bucket sizes (elements) torch DDP all-reduces in its first two steps on a chain."""
    import torch.distributed as dist
    from torch import nn

    sizes = [3 * 2**18, 5 * 2**18, 100, 2**17, 2**17, 10]

    class Chain(nn.Module):  # parameter k's gradient is ready before parameter k - 1's
        def __init__(self):
            super().__init__()
            self.ps = nn.ParameterList(nn.Parameter(torch.ones(n) / n) for n in sizes)

        def forward(self, x):
            for p in self.ps:
                x = x * p.sum()
            return x

    seen = []

    def hook(state, bucket):
        seen.append(bucket.buffer().numel())
        fut = torch.futures.Future()
        dist.all_reduce(bucket.buffer())
        fut.set_result(bucket.buffer())
        return fut

    kwargs = {} if bucket_cap_mb is None else {"bucket_cap_mb": bucket_cap_mb}
    model = nn.parallel.DistributedDataParallel(Chain(), **kwargs)
    model.register_comm_hook(None, hook)
    steps = []
    for _ in range(2):
        seen.clear()
        model(torch.ones(3)).sum().backward()
        steps.append(list(seen))
    return steps, sizes


def test_torch_ddp_all_reduces_the_buckets_of_the_rule():
    import dpcourse
    from dpcourse.grading.oracles import buckets_with_first

    for cap, first in [(None, 1.0), (25.0, 25.0)]:  # the small bucket only with the default cap
        (first_step, seen), sizes = dpcourse.run(_ddp_buckets, cap, world_size=2)[0]
        want = [sum(sizes[i] for i in b) for b in buckets_with_first(
            [4 * n for n in sizes], [True] * len(sizes), cap or 25.0, first)]
        assert seen == want, (cap, seen, want)
        assert first_step == [sum(sizes)]  # the first iteration: one bucket, then rebuilt


# -- 06: buckets in the order gradients arrive ----------------------------------------------

def test_arrival_order_solution_passes_every_criterion(solution):
    sol = solution("06_overlap.ipynb")
    _assert_all_passed(check("arrival_order", sol.ArrivalOrderDDP, quiet=True))


def test_buckets_in_registration_order_fail_buckets_follow_arrival():
    result = check("arrival_order", transfer_bugs.ReverseRegistrationBuckets, quiet=True)
    assert "buckets_follow_arrival" in result.failed()
    assert result.criterion("matches_torch_ddp").passed  # right numbers, wrong structure


def test_the_check_model_runs_layers_out_of_registration_order():
    from dpcourse.grading.checks.ex06_arrival_order import arrival_order

    order = arrival_order()
    assert sorted(order) == list(range(6)) and order != list(reversed(range(6)))


# -- 07: accumulation over uneven micro-batches ----------------------------------------------

def test_token_weighted_solution_passes_every_criterion(solution):
    sol = solution("07_gradient_accumulation.ipynb")
    _assert_all_passed(check("token_weighted", sol.accumulation_step, quiet=True))


def test_zero_grad_after_the_step_is_right():
    _assert_all_passed(check("token_weighted", transfer_bugs.accumulate_zero_after_step,
                             quiet=True))


@pytest.mark.parametrize("bug, failed", [
    (transfer_bugs.accumulate_divide_by_count,
     {"weights_within_rank", "weights_across_ranks", "matches_single_process"}),
    (transfer_bugs.accumulate_local_rows_only,
     {"weights_across_ranks", "matches_single_process"}),
    (transfer_bugs.accumulate_zero_inside_loop,
     {"zero_grad_once_per_step", "matches_single_process"}),
    (transfer_bugs.accumulate_never_zeroed,
     {"zero_grad_once_per_step", "matches_single_process"})])
def test_accumulation_bugs_fail_only_the_criteria_of_their_cause(bug, failed):
    result = check("token_weighted", bug, quiet=True)
    own = {c.name for c in result.criteria} - {"no_delegation", "no_deadlock"}
    assert set(result.failed()) & own == failed
    shown = [c.hint for c in result.criteria if not c.passed and c.hint]
    weighting = any("the same say as a 6-row one" in hint for hint in shown)
    assert weighting == ("weights_within_rank" in failed)  # a misplaced zero_grad is not one
    if "zero_grad_once_per_step" in failed:  # the hint names the cause, not a recipe
        hint = result.criterion("zero_grad_once_per_step").hint
        assert "erased" in hint and "zero_grad" not in hint


# -- 08: rank-0 checkpoint and exact resume --------------------------------------------------

def test_checkpoint_solution_passes_every_criterion(solution):
    sol = solution("08_real_training_run.ipynb")
    _assert_all_passed(check("checkpoint_resume", sol.save_checkpoint,
                             load_checkpoint=sol.load_checkpoint, quiet=True))


@pytest.mark.parametrize("save, failed", [
    (transfer_bugs.save_rank_0_rng_only, {"restores_each_ranks_rng", "exact_resume"}),
    (transfer_bugs.save_without_barrier, {"rank_0_writes"}),
    (transfer_bugs.save_on_every_rank, {"rank_0_writes"}),
    (transfer_bugs.save_without_epoch, {"restores_sampler_position", "exact_resume"})])
def test_checkpoint_bugs_fail_their_criteria(save, failed):
    result = check("checkpoint_resume", save, load_checkpoint=transfer_bugs.load_checkpoint,
                   quiet=True)
    own = {c.name for c in result.criteria} - {"no_delegation", "no_deadlock"}
    assert set(result.failed()) & own == failed


def test_the_ranks_draw_different_dropout_masks():
    def masks(seed):
        torch.manual_seed(seed)
        return torch.nn.functional.dropout(torch.ones(64), 0.3)

    assert not torch.equal(masks(1000), masks(1001))  # so each rank's state must come back


def _ddp_buckets_on_permuted(bucket_cap_mb):
    """Bucket sizes (bytes) torch DDP all-reduces in its second step on the 06 check's model."""
    import torch.distributed as dist
    from torch import nn

    from dpcourse.grading.checks.ex06_arrival_order import make_model

    seen = []

    def hook(state, bucket):
        seen.append(bucket.buffer().numel() * bucket.buffer().element_size())
        fut = torch.futures.Future()
        dist.all_reduce(bucket.buffer())
        fut.set_result(bucket.buffer())
        return fut

    model = nn.parallel.DistributedDataParallel(make_model(0), bucket_cap_mb=bucket_cap_mb)
    model.register_comm_hook(None, hook)
    for _ in range(2):
        seen.clear()
        nn.functional.mse_loss(model(torch.ones(4, 8)), torch.zeros(4, 4)).backward()
    return seen


def test_torch_ddp_rebuilds_its_buckets_in_arrival_order():
    import dpcourse
    from dpcourse.grading.checks.ex06_arrival_order import arrival_order, make_model
    from dpcourse.grading.oracles import MIB, close_by_caps

    nbytes = [p.numel() * 4 for p in make_model(0).parameters()]
    for cap in (700, 300):
        want = [sum(nbytes[i] for i in b) for b in close_by_caps(arrival_order(), nbytes, [cap])]
        assert dpcourse.run(_ddp_buckets_on_permuted, cap / MIB, world_size=2)[0] == want
