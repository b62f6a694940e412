"""Ring reduce-scatter / all-gather / all-reduce against dist.all_reduce, on gloo with 1-4 ranks.

One launch per world size runs every case and returns the raw tensors; the
assertions run here in the parent, so a failure names the case.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import dpcourse
from collective_cases import (BIG, DTYPES, against_library, assert_cases, lengths, rank_data,
                              tolerance)
from dpcourse.comm import (CommTrace, ring_all_gather, ring_all_reduce, ring_reduce_scatter,
                           ring_step_chunks, shard_range)

WORLD_SIZES = (1, 2, 3, 4)
SUBGROUP = {3: [0, 2], 4: [1, 2, 3]}


def ring_worker(world_size: int) -> dict:
    rank = dist.get_rank()
    res = {}
    res["all_reduce"] = against_library(ring_all_reduce, world_size)

    # Shapes: a matrix, a 0-d tensor, and a transposed (non-contiguous) view
    # whose base tensor must see the result.
    torch.manual_seed(rank)
    shapes = []
    for x in (torch.randn(5, 7), torch.randn(()), torch.randn(7, 5).t()):
        expected = x.clone()
        dist.all_reduce(expected)
        got = x.clone() if x.is_contiguous() else x.t().clone().t()
        assert got.is_contiguous() == x.is_contiguous()
        ring_all_reduce(got)
        shapes.append((tuple(x.shape), got, expected))
    res["shapes"] = shapes

    # The two halves on their own.
    halves = []
    for n in lengths(world_size):
        x = rank_data(rank, n, torch.float32, seed=7 + n, integer=True)
        expected = x.clone()
        dist.all_reduce(expected)
        scattered = x.clone()
        ring_reduce_scatter(scattered)
        a, b = shard_range(n, world_size, rank)
        gathered = torch.full((n,), float("nan"))
        gathered[a:b] = torch.arange(a, b, dtype=torch.float32) + 1000 * rank
        ring_all_gather(gathered)
        halves.append((n, scattered, expected, gathered))
    res["halves"] = halves

    # Structure: only point-to-point, to the right neighbour, 2(N-1)/N of the bytes.
    traces = {}
    for n in (BIG, max(world_size - 1, 1)):
        t = torch.ones(n)
        with CommTrace() as tr:
            ring_all_reduce(t)
        traces[n] = dict(ops=tr.collective_ops(), sent=tr.bytes_sent(),
                                  received=tr.bytes_received(), isend=tr.count("isend"),
                                  send_peers={e.peer for e in tr.of("isend")},
                                  recv_peers={e.peer for e in tr.of("irecv")})
    res["traces"] = traces

    # The last of many calls is as right as the first (no ordering drift between calls).
    # (4 ranks on 2 cores are slow to switch between, so they do fewer.)
    wrong = 0
    for i in range(200 if world_size < 4 else 100):
        t = torch.arange(37, dtype=torch.float32) + rank + i
        ring_all_reduce(t)
        want = world_size * (torch.arange(37, dtype=torch.float32) + i) + sum(range(world_size))
        wrong += int(not torch.equal(t, want))
    res["repeat_wrong"] = wrong
    leaf = torch.ones(3, requires_grad=True)  # in place on a leaf, as dist.all_reduce allows
    ring_all_reduce(leaf)
    res["leaf"] = leaf.detach()

    if world_size in SUBGROUP:
        members = SUBGROUP[world_size]
        group = dist.new_group(members)
        if rank in members:
            res["subgroup"] = against_library(
                lambda t: ring_all_reduce(t, group=group),
                len(members), group=group)
        else:
            try:
                ring_all_reduce(torch.ones(4), group=group)
                res["subgroup_outsider"] = "no error"
            except ValueError as exc:
                res["subgroup_outsider"] = str(exc)
    return res


@pytest.fixture(scope="module", params=WORLD_SIZES, ids=lambda n: f"world{n}")
def ring_results(request):
    n = request.param
    return n, dpcourse.run(ring_worker, n, world_size=n, backend="gloo", timeout=120)


def test_all_reduce_matches_library(ring_results):
    world_size, ranks = ring_results
    for rank, res in enumerate(ranks):
        assert_cases(res["all_reduce"], world_size, f"rank {rank}")


def test_shapes_and_non_contiguous(ring_results):
    world_size, ranks = ring_results
    for res in ranks:
        for shape, got, expected in res["shapes"]:
            assert got.shape == shape
            torch.testing.assert_close(got, expected, **tolerance(torch.float32, world_size))


def test_reduce_scatter_owns_chunk_rank_and_all_gather_reassembles(ring_results):
    world_size, ranks = ring_results
    for rank, res in enumerate(ranks):
        for n, scattered, expected, gathered in res["halves"]:
            a, b = shard_range(n, world_size, rank)
            assert torch.equal(scattered[a:b], expected[a:b]), (rank, n)
            owners = torch.cat([torch.full((e - s,), 1000.0 * r) for r in range(world_size)
                                for s, e in [shard_range(n, world_size, r)]])
            assert torch.equal(gathered, torch.arange(n, dtype=torch.float32) + owners), n


def test_trace_is_point_to_point_with_2_n_minus_1_over_n_bytes(ring_results):
    world_size, ranks = ring_results
    for rank, res in enumerate(ranks):
        for n, tr in res["traces"].items():
            assert tr["ops"] == set(), tr  # no all_reduce, broadcast, ...
            size = [e - s for s, e in (shard_range(n, world_size, c) for c in range(world_size))]
            if world_size == 1:
                assert tr["sent"] == tr["received"] == 0
                continue
            # reduce-scatter sends every chunk but our own, all-gather every chunk but the next.
            want = 4 * ((n - size[rank]) + (n - size[(rank + 1) % world_size]))
            assert tr["sent"] == want, (rank, n, tr)
            # ... and receives every chunk but the left one's, then every chunk but our own.
            assert tr["received"] == 4 * ((n - size[(rank - 1) % world_size]) + (n - size[rank]))
            assert tr["send_peers"] <= {(rank + 1) % world_size}
            assert tr["recv_peers"] <= {(rank - 1) % world_size}
            if n == BIG:
                assert tr["isend"] == 2 * (world_size - 1)


def test_repeated_calls_stay_correct(ring_results):
    _, ranks = ring_results
    assert [res["repeat_wrong"] for res in ranks] == [0] * len(ranks)
    for res in ranks:
        assert torch.equal(res["leaf"], torch.full((3,), float(len(ranks))))


def test_subgroup(ring_results):
    world_size, ranks = ring_results
    if world_size not in SUBGROUP:
        pytest.skip("subgroups are checked with 3 and 4 ranks")
    members = SUBGROUP[world_size]
    for rank, res in enumerate(ranks):
        if rank in members:
            assert_cases(res["subgroup"], len(members), f"rank {rank} subgroup {members}")
        else:
            assert "not a member" in res["subgroup_outsider"]


def test_ring_chunks_cover_the_tensor():
    for n in (0, 1, 3, 10, 10007):
        for world_size in (1, 2, 3, 4, 7):
            bounds = [shard_range(n, world_size, i) for i in range(world_size)]
            assert bounds[0][0] == 0 and bounds[-1][1] == n
            assert all(bounds[i][1] == bounds[i + 1][0] for i in range(world_size - 1))
            sizes = [e - s for s, e in bounds]
            # ceil(n / N) each, as dist.reduce_scatter_tensor cuts a padded tensor; the
            # last ones short or empty (tests/test_sharding.py asks torch).
            full = -(-n // world_size)
            assert sizes == sorted(sizes, reverse=True) and max(sizes) == full
            assert all(size == full for size in sizes[:n // full if full else 0])
    with pytest.raises(ValueError):
        shard_range(10, 2, 2)


def test_ring_schedule_visits_every_chunk_once_per_phase():
    for world_size in (2, 3, 5):
        for rank in range(world_size):
            steps = range(world_size - 1)
            rs = [ring_step_chunks(rank, world_size, "reduce_scatter", s) for s in steps]
            ag = [ring_step_chunks(rank, world_size, "all_gather", s) for s in steps]
            # What I receive at a step is what I send at the next one.
            assert all(rs[s][1] == rs[s + 1][0] for s in range(world_size - 2))
            assert rs[-1][1] == rank and ag[0][0] == rank  # rank r owns chunk r in between
            # My left neighbour sends me exactly what I expect to receive.
            left = (rank - 1) % world_size
            for phase, mine in (("reduce_scatter", rs), ("all_gather", ag)):
                assert [ring_step_chunks(left, world_size, phase, s)[0]
                        for s in range(world_size - 1)] == [r for _, r in mine]


def nccl_ring_worker() -> dict:
    """The same comparisons on CUDA tensors over NCCL (first call on a 1-element tensor)."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", rank)
    cases = []
    for n in [1] + lengths(world_size) + [(64 << 20) // 4]:
        for dtype in DTYPES:
            x = rank_data(rank, n, dtype, seed=n, integer=True).to(device)
            expected, got = x.clone(), x.clone()
            ring_all_reduce(got)  # the very first call is the ring's
            dist.all_reduce(expected)
            # Integer-valued data sum exactly: compare on the GPU, return only the verdict.
            cases.append((n, str(dtype), torch.equal(got, expected)))
    wrong = 0
    t = torch.ones(1000, device=device)
    for i in range(1000):
        t.fill_(rank + i)
        ring_all_reduce(t)
        wrong += int(not torch.all(t == world_size * i + sum(range(world_size))).item())
    return {"cases": cases, "repeat_wrong": wrong}


@pytest.mark.gpu(2)
def test_ring_on_nccl():
    ranks = dpcourse.run(nccl_ring_worker, world_size=2, backend="nccl", timeout=300)
    for rank, res in enumerate(ranks):
        assert [c for c in res["cases"] if not c[-1]] == [], f"rank {rank}: wrong sums"
        assert res["repeat_wrong"] == 0


def odd_world_worker() -> dict:
    """Larger odd rings: every length case against the library, and the bytes each rank sends."""
    world = dist.get_world_size()
    cases = against_library(ring_all_reduce, world)
    n = 1000 * world + 1  # not divisible by the world size
    with CommTrace() as trace:
        ring_all_reduce(torch.ones(n))
    return {"cases": cases, "sent": trace.bytes_sent(), "ops": sorted(trace.collective_ops())}


@pytest.mark.parametrize("world_size", [5, 7])
def test_odd_world_sizes(world_size):
    ranks = dpcourse.run(odd_world_worker, world_size=world_size, backend="gloo", timeout=120)
    n = 1000 * world_size + 1
    for rank, res in enumerate(ranks):
        assert_cases(res["cases"], world_size, f"world {world_size} rank {rank}")
        assert res["ops"] == []
        # N-1 steps per phase, one chunk sent per step: (N-1)/N of the data, twice.
        expected = 0
        for phase in ("reduce_scatter", "all_gather"):
            for step in range(world_size - 1):
                start, end = shard_range(n, world_size,
                                         ring_step_chunks(rank, world_size, phase, step)[0])
                expected += 4 * (end - start)  # float32
        assert res["sent"] == expected
        assert abs(res["sent"] - 2 * (world_size - 1) / world_size * 4 * n) <= 8 * world_size
