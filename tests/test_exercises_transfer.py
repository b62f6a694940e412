"""Transfer exercises and the graded exercises of lessons 01 and 08.

Each reference solution (from solutions/) passes every criterion of its check;
each planted wrong answer (tests/planted/transfer_bugs.py) fails the criterion
that names its mistake, and its hint speaks of that mistake.
"""

import pathlib
import types

import pytest

from dpcourse.grading import check
from planted import transfer_bugs

ROOT = pathlib.Path(__file__).resolve().parent.parent


def load_solution(name: str) -> types.ModuleType:
    """Execute a solution notebook's code cells (without its check calls) as a module."""
    import nbformat

    nb = nbformat.read(ROOT / "solutions" / name, as_version=4)
    module = types.ModuleType(f"solution_{name[:2]}")  # not importable: travels by value
    for cell in nb.cells:
        if cell.cell_type == "code" and "check(" not in cell.source:
            exec(compile(cell.source, name, "exec"), module.__dict__)
    return module


def _assert_all_passed(result):
    assert result.failed() == [], {c.name: c.detail for c in result.criteria if not c.passed}


# -- 04: all-reduce in log2(N) rounds ---------------------------------------------------

def test_halving_doubling_solution_passes_every_criterion():
    solution = load_solution("04_ring_all_reduce.ipynb")
    _assert_all_passed(check("halving_doubling", solution.halving_doubling_all_reduce,
                             quiet=True))


def test_ring_is_right_but_fails_log_rounds():
    result = check("halving_doubling", transfer_bugs.all_reduce_ring, world_sizes=(4, 5),
                   quiet=True)
    assert set(result.failed()) == {"log_rounds"}
    assert "sent 6 messages, at most 4" in result.criterion("log_rounds").detail


def test_whole_tensor_swaps_fail_bandwidth_on_a_power_of_two():
    result = check("halving_doubling", transfer_bugs.all_reduce_whole_tensor_swaps, quiet=True)
    assert set(result.failed()) == {"bandwidth_power_of_two", "bounded_bytes_other_sizes"}
    assert "half" in result.criterion("bandwidth_power_of_two").hint


# -- 05: torch's small first bucket -----------------------------------------------------

def test_first_bucket_solution_passes_every_criterion():
    solution = load_solution("05_bucketing.ipynb")
    _assert_all_passed(check("first_bucket", solution.assign_buckets_like_torch, quiet=True))


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

    from dpcourse.grading.ex05_first_bucket import MIB, _cases, expected_buckets_with_first

    for params, cap, first in _cases():
        order = [i for i in reversed(range(len(params))) if params[i].requires_grad]
        buckets, _ = dist._compute_bucket_assignment_by_size(
            [params[i] for i in order], [int(first * MIB), int(cap * MIB)], [False] * len(order))
        assert [[order[j] for j in b] for b in buckets] == \
            expected_buckets_with_first(params, cap, first)


def _ddp_buckets(bucket_cap_mb):
    """Bucket sizes (elements) torch DDP all-reduces in its first two steps on a chain of params."""
    import torch
    import torch.distributed as dist
    from torch import nn

    from dpcourse.grading.ex05_first_bucket import MIB

    mf = MIB // 4
    sizes = [3 * mf, 5 * mf, 100, mf // 2, mf // 2, 10]

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
    import torch

    import dpcourse
    from dpcourse.grading.ex05_first_bucket import expected_buckets_with_first

    for cap, first in [(None, 1.0), (25.0, 25.0)]:  # the small bucket only with the default cap
        (first_step, seen), sizes = dpcourse.run(_ddp_buckets, cap, world_size=2)[0]
        params = [torch.nn.Parameter(torch.zeros(n)) for n in sizes]
        want = [sum(params[i].numel() for i in b)
                for b in expected_buckets_with_first(params, cap or 25.0, first)]
        assert seen == want, (cap, seen, want)
        assert first_step == [sum(sizes)]  # the first iteration: one bucket, then rebuilt


# -- 06: buckets in the order gradients arrive -------------------------------------------

def test_arrival_order_solution_passes_every_criterion():
    solution = load_solution("06_overlap.ipynb")
    _assert_all_passed(check("arrival_order", solution.ArrivalOrderDDP, quiet=True))


def test_buckets_in_registration_order_fail_only_buckets_follow_arrival():
    result = check("arrival_order", transfer_bugs.ReverseRegistrationBuckets, quiet=True)
    assert set(result.failed()) == {"buckets_follow_arrival"}
    assert "first backward" in result.criterion("buckets_follow_arrival").hint


def test_the_check_model_runs_layers_out_of_registration_order():
    from dpcourse.grading.ex06_arrival_order import arrival_order

    order = arrival_order("cpu")
    assert sorted(order) == list(range(6)) and order != list(reversed(range(6)))


# -- 07: accumulation over uneven micro-batches --------------------------------------------

def test_token_weighted_solution_passes_every_criterion():
    solution = load_solution("07_no_sync.ipynb")
    _assert_all_passed(check("token_weighted", solution.accumulation_step, quiet=True))


def test_no_sync_warm_up_passes_with_the_forward_time_flag():
    solution = load_solution("07_no_sync.ipynb")
    _assert_all_passed(check("no_sync", solution.HookedDDP, quiet=True))


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
    assert set(result.failed()) == failed
    shown = [c.hint for c in result.criteria if not c.passed and c.hint]
    if "weights_within_rank" not in failed:  # a misplaced zero_grad is not a weighting hint
        assert not any("share of the rows" in hint for hint in shown)


# -- 03: naive DDP with buffers, unused and frozen parameters ------------------------------

def test_complete_naive_ddp_solution_passes_every_criterion():
    solution = load_solution("03_naive_ddp.ipynb")
    _assert_all_passed(check("naive_ddp_complete", solution.CompleteNaiveDDP, quiet=True))


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
    assert "extra is used on rank 0 only" in result.criterion("no_deadlock").detail


# -- 01: the gradient of the mean from uneven shards ----------------------------------------

def test_mean_gradient_solution_passes_every_criterion():
    solution = load_solution("01_why_data_parallel.ipynb")
    _assert_all_passed(check("mean_gradient", solution.global_mean_gradient,
                             shard_sizes=solution.shard_sizes, quiet=True))


@pytest.mark.parametrize("bug, failed", [
    (transfer_bugs.mean_gradient_plain_mean, {"uneven_shards", "empty_shard"}),
    (transfer_bugs.mean_gradient_over_ranks_with_examples, {"uneven_shards"}),
    (transfer_bugs.mean_gradient_summed, {"equal_shards", "uneven_shards", "empty_shard"})])
def test_mean_gradient_bugs_fail_their_criteria(bug, failed):
    solution = load_solution("01_why_data_parallel.ipynb")
    result = check("mean_gradient", bug, shard_sizes=solution.shard_sizes, world_sizes=(3,),
                   quiet=True)
    assert set(result.failed()) == failed


def test_shard_sizes_with_the_extra_at_the_end_fail():
    solution = load_solution("01_why_data_parallel.ipynb")
    result = check("mean_gradient", solution.global_mean_gradient,
                   shard_sizes=transfer_bugs.shard_sizes_extra_last, world_sizes=(2,), quiet=True)
    assert set(result.failed()) == {"shard_sizes_like_tensor_split"}


def test_an_empty_shard_has_a_nan_loss_but_a_zero_gradient_in_torch():
    import torch

    from dpcourse.grading.ex01_mean_gradient import IN, OUT, flat_grad

    model, x, y = torch.nn.Linear(IN, OUT), torch.zeros(0, IN), torch.zeros(0, OUT)
    assert torch.nn.functional.mse_loss(model(x), y).isnan()
    assert flat_grad(model, x, y).eq(0).all()


# -- 08: rank-0 checkpoint and exact resume -------------------------------------------------

def test_checkpoint_solution_passes_every_criterion():
    solution = load_solution("08_real_training_run.ipynb")
    _assert_all_passed(check("checkpoint_resume", solution.save_checkpoint,
                             load_checkpoint=solution.load_checkpoint, quiet=True))


@pytest.mark.parametrize("save, failed", [
    (transfer_bugs.save_rank_0_rng_only, {"restores_each_ranks_rng", "exact_resume"}),
    (transfer_bugs.save_without_barrier, {"rank_0_writes"}),
    (transfer_bugs.save_on_every_rank, {"rank_0_writes"}),
    (transfer_bugs.save_without_epoch, {"restores_sampler_position", "exact_resume"})])
def test_checkpoint_bugs_fail_their_criteria(save, failed):
    result = check("checkpoint_resume", save, load_checkpoint=transfer_bugs.load_checkpoint,
                   quiet=True)
    assert set(result.failed()) == failed


def test_resume_is_not_exact_by_accident():
    """Without the generator states, dropout draws other masks and the runs part."""
    import torch

    from dpcourse.grading import ex08_checkpoint as ex

    def masks(seed):
        torch.manual_seed(seed)
        return torch.nn.functional.dropout(torch.ones(64), 0.3)

    assert not torch.equal(masks(1000), masks(1001))  # the ranks' masks differ
    assert 0 < ex.STOP[0] < ex.EPOCHS - 1 and ex.STOP[1] > 0  # mid-run and mid-epoch


def _ddp_buckets_on_permuted(bucket_cap_mb):
    """Bucket sizes (bytes) torch DDP all-reduces in its second step on the 06 check's model."""
    import torch
    import torch.distributed as dist
    from torch import nn

    from dpcourse.grading.ex06_arrival_order import make_model

    seen = []

    def hook(state, bucket):
        seen.append(bucket.buffer().numel() * bucket.buffer().element_size())
        fut = torch.futures.Future()
        dist.all_reduce(bucket.buffer())
        fut.set_result(bucket.buffer())
        return fut

    model = nn.parallel.DistributedDataParallel(make_model(0, "cpu"), bucket_cap_mb=bucket_cap_mb)
    model.register_comm_hook(None, hook)
    for _ in range(2):
        seen.clear()
        nn.functional.mse_loss(model(torch.ones(4, 8)), torch.zeros(4, 4)).backward()
    return seen


def test_torch_ddp_rebuilds_its_buckets_in_arrival_order():
    import dpcourse
    from dpcourse.grading.ex06_arrival_order import arrival_buckets, arrival_order, make_model

    params = list(make_model(0, "cpu").parameters())
    for cap in (700 / 2**20, 300 / 2**20):
        want = [sum(params[i].numel() * 4 for i in b)
                for b in arrival_buckets(arrival_order("cpu"), params, cap)]
        assert dpcourse.run(_ddp_buckets_on_permuted, cap, world_size=2)[0] == want
