"""naive_all_reduce and all_reduce_per_tensor against dist.all_reduce, on gloo with 1-4 ranks."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import dpcourse
from collective_cases import DTYPES, against_library, assert_cases, rank_data
from dpcourse.comm import CommTrace, all_reduce_per_tensor, naive_all_reduce, ring_all_reduce

WORLD_SIZES = (1, 2, 3, 4)
SUBGROUP = {3: [1, 2], 4: [0, 1, 3]}


def collectives_worker(world_size: int) -> dict:
    rank = dist.get_rank()
    res = {"naive": against_library(naive_all_reduce, world_size)}

    m = torch.randn(7, 5).t()  # non-contiguous: the result must land in the caller's view
    expected = m.clone()
    dist.all_reduce(expected)
    naive_all_reduce(m)
    res["naive_matrix"] = (m, expected)
    leaf = torch.ones(3, requires_grad=True)  # in place on a leaf, as dist.all_reduce allows
    naive_all_reduce(leaf)
    res["naive_leaf"] = leaf.detach()

    n = 1000
    with CommTrace() as tr:
        naive_all_reduce(torch.ones(n))
    res["naive_trace"] = dict(ops=tr.collective_ops(), sent=tr.bytes_sent(),
                              received=tr.bytes_received())

    # One collective per tensor, with the default, an average, and a plugged-in ring.
    torch.manual_seed(rank)
    tensors = [torch.randn(3, 4), torch.randn(5), torch.randn(())]
    per = {}
    for name, kwargs in (("sum", {}), ("mean", {"average": True}),
                         ("ring", {"all_reduce": ring_all_reduce, "average": True})):
        got = [t.clone() for t in tensors]
        with CommTrace() as tr:
            all_reduce_per_tensor(got + [None], **kwargs)
        expected = [t.clone() for t in tensors]
        for t in expected:
            dist.all_reduce(t)
            if kwargs.get("average"):
                t /= world_size
        per[name] = (got, expected, tr.count("all_reduce"), tr.collective_ops())
    res["per_tensor"] = per

    res["errors"] = []
    for call in (lambda: naive_all_reduce(torch.ones(2), op=dist.ReduceOp.MAX),
                 lambda: ring_all_reduce(torch.ones(2), op=dist.ReduceOp.MAX),
                 lambda: ring_all_reduce(torch.ones(2).to_sparse()),
                 lambda: ring_all_reduce([1.0, 2.0]),
                 lambda: ring_all_reduce(torch.ones(2), dist.ReduceOp.SUM)):
        try:  # raised before any message is sent, so every rank may raise alone
            call()
            res["errors"].append("no error")
        except (TypeError, ValueError) as exc:
            res["errors"].append(str(exc))

    if world_size in SUBGROUP:
        group = dist.new_group(SUBGROUP[world_size])
        if rank in SUBGROUP[world_size]:
            res["subgroup"] = against_library(lambda t: naive_all_reduce(t, group=group),
                                              len(SUBGROUP[world_size]), group=group)
            t = torch.full((4,), float(rank))
            all_reduce_per_tensor([t], group=group, average=True)
            res["subgroup_mean"] = t
    return res


@pytest.fixture(scope="module", params=WORLD_SIZES, ids=lambda n: f"world{n}")
def results(request):
    n = request.param
    return n, dpcourse.run(collectives_worker, n, world_size=n, backend="gloo", timeout=120)


def test_naive_all_reduce_matches_library(results):
    world_size, ranks = results
    for rank, res in enumerate(ranks):
        assert_cases(res["naive"], world_size, f"rank {rank}")
        got, expected = res["naive_matrix"]
        assert got.shape == (5, 7)
        torch.testing.assert_close(got, expected)
        assert torch.equal(res["naive_leaf"], torch.full((3,), float(world_size)))


def test_naive_all_reduce_goes_through_rank_0(results):
    world_size, ranks = results
    size = 4 * 1000
    for rank, res in enumerate(ranks):
        tr = res["naive_trace"]
        assert tr["ops"] == set()  # built from send/recv only
        if rank == 0:  # the root's link carries everything: (N-1) tensors in, (N-1) out
            assert tr["sent"] == tr["received"] == (world_size - 1) * size
        else:
            assert tr["sent"] == tr["received"] == size


def test_all_reduce_per_tensor(results):
    world_size, ranks = results
    for res in ranks:
        for name, (got, expected, count, ops) in res["per_tensor"].items():
            for g, e in zip(got, expected):
                torch.testing.assert_close(g, e, msg=name)
            if name == "ring":  # the plugged-in collective replaced dist.all_reduce
                assert count == 0 and ops == set()
            else:
                assert count == len(got), name  # one call per tensor, None skipped


def test_subgroup(results):
    world_size, ranks = results
    if world_size not in SUBGROUP:
        pytest.skip("subgroups are checked with 3 and 4 ranks")
    members = SUBGROUP[world_size]
    mean = sum(members) / len(members)
    for rank in members:
        assert_cases(ranks[rank]["subgroup"], len(members), f"rank {rank} subgroup")
        torch.testing.assert_close(ranks[rank]["subgroup_mean"], torch.full((4,), mean))


def test_bad_arguments_raise_clear_errors(results):
    _, ranks = results
    msgs = ranks[0]["errors"]
    assert "SUM" in msgs[0] and "SUM" in msgs[1]
    assert "to_dense()" in msgs[2]
    assert "torch.Tensor" in msgs[3]
    assert "op=... by keyword" in msgs[4]


def nccl_naive_worker() -> list:
    rank = dist.get_rank()
    out = []
    for n in (1, 3, 10007):
        for dtype in DTYPES:
            x = rank_data(rank, n, dtype, seed=n, integer=True).cuda()
            expected, got = x.clone(), x.clone()
            dist.all_reduce(expected)
            naive_all_reduce(got)
            out.append(((n, str(dtype), True), got, expected))
    return out


@pytest.mark.gpu(2)
def test_naive_on_nccl():
    for rank, cases in enumerate(dpcourse.run(nccl_naive_worker, world_size=2, backend="nccl")):
        assert_cases(cases, 2, f"nccl rank {rank}")
