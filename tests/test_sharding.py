"""One sharding layout: ring, ZeRO, FSDP, kernels and exercise 04's grader cut as torch does.

``dist.reduce_scatter_tensor`` on gloo is asked which elements of a padded flat
tensor land on each rank; every component that shards must give each rank the
same ``[start, end)``, for lengths ``N`` does not divide and several world sizes.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

import dpcourse
from dpcourse.comm import chunk_size, ring_reduce_scatter, shard_range
from dpcourse.comm.kernels.schedule import two_shot_plan
from dpcourse.fsdp import FlatParams
from dpcourse.grading import oracles
from dpcourse.zero.layout import make_shard_buckets

LENGTHS = (1, 3, 5, 7, 10, 13, 37)
WORLD_SIZES = (2, 3, 4)


def _owned(values: torch.Tensor, total: torch.Tensor) -> tuple[int, int]:
    """Return ``[start, end)`` of the positions where ``values`` equals ``total``."""
    hits = [i for i in range(values.numel()) if values[i] == total[i]]
    if not hits:
        return (0, 0)
    assert hits == list(range(hits[0], hits[-1] + 1)), hits  # one contiguous block
    return hits[0], hits[-1] + 1


def _torch_ranges(n: int, group) -> tuple[int, int]:
    """This rank's elements of a flat tensor of ``n``, as ``dist.reduce_scatter_tensor`` gives them.

    The input is padded with zeros to a multiple of the group's size, the smallest
    padding torch accepts; element ``i`` carries ``i + 1``, so the non-zero outputs
    name the real elements this rank received.
    """
    world = dist.get_world_size(group)
    per_rank = -(-n // world)
    padded = torch.zeros(world * per_rank)
    padded[:n] = torch.arange(1, n + 1, dtype=torch.float32)
    out = torch.empty(per_rank)
    dist.reduce_scatter_tensor(out, padded, group=group)
    codes = [int(v) // world for v in out.tolist() if v != 0]  # every rank sent i + 1
    return (codes[0] - 1, codes[-1]) if codes else (min(dist.get_rank(group) * per_rank, n),) * 2


def _ring_range(n: int, group) -> tuple[int, int]:
    """The chunk whose sum ``ring_reduce_scatter`` completes on this rank."""
    world = dist.get_world_size(group)
    codes = torch.arange(1, n + 1, dtype=torch.float32)
    t = codes.clone()
    ring_reduce_scatter(t, group=group)  # partial sums elsewhere are k * code with k < N
    return _owned(t, world * codes)


def _zero_range(n: int, group) -> tuple[int, int]:
    """The elements of one parameter in this rank's row after ZeRO's bucket reduce-scatter."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    param = nn.Parameter(torch.arange(1, n + 1, dtype=torch.float32))
    (bucket,) = make_shard_buckets([param], world, bucket_cap_mb=25.0)
    matrix = bucket.new_matrix(world)
    bucket.pack(matrix, [param.detach()])
    row = torch.empty(bucket.row)
    dist.reduce_scatter_tensor(row, matrix.view(-1), group=group)
    start = rank * bucket.row  # row r holds flat elements [r * row, ...) of the padded tensor
    codes = [int(v) // world for v in row.tolist() if v != 0]
    return (codes[0] - 1, codes[-1]) if codes else (min(start, n),) * 2


def _fsdp_range(n: int, group) -> tuple[int, int]:
    """The elements of a unit's flat parameters that this rank's FSDP shard keeps."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    unit = nn.Linear(n, 1, bias=False)
    with torch.no_grad():
        unit.weight.copy_(torch.arange(1, n + 1, dtype=torch.float32).view(1, n))
    (flat,) = FlatParams.of_unit(unit, world, rank, group=group)
    codes = [int(v) for v in flat.shard.detach().tolist() if v != 0]
    return (codes[0] - 1, codes[-1]) if codes else (min(rank * flat.chunk, n),) * 2


def _kernel_range(n: int, world: int, rank: int) -> tuple[int, int]:
    """The elements the two-shot kernel's rank ``rank`` reduces (its own slice)."""
    plan = two_shot_plan(n, world, block=2, max_blocks=2)
    idx = sorted(i for (r, _), steps in plan.items() if r == rank
                 for s in steps if s.op == "reduce" for i in s.index)
    return (idx[0], idx[-1] + 1) if idx else (min(rank * chunk_size(n, world), n),) * 2


def layouts_worker():
    """Every (world size, length): each component's range on this rank, and torch's."""
    rank, out = dist.get_rank(), {}
    for world in WORLD_SIZES:
        group = dist.new_group(list(range(world)))  # every rank calls new_group
        if rank >= world:
            continue
        for n in LENGTHS:
            r = dist.get_rank(group)
            out[(world, n)] = {"torch": _torch_ranges(n, group), "ring": _ring_range(n, group),
                               "zero": _zero_range(n, group), "fsdp": _fsdp_range(n, group),
                               "kernel": _kernel_range(n, world, r),
                               "shard_range": shard_range(n, world, r),
                               "grader": oracles.chunk_bounds(n, world, r)}
    return out


@pytest.fixture(scope="module")
def layouts():
    return dpcourse.run(layouts_worker, world_size=max(WORLD_SIZES), backend="gloo",
                        timeout=180)


def test_every_component_shards_as_reduce_scatter_tensor(layouts):
    checked = 0
    for rank, ranges in enumerate(layouts):
        for (world, n), got in ranges.items():
            want = got.pop("torch")
            for name, bounds in got.items():
                start, end = bounds
                # An empty shard's position is not observable; only its emptiness is.
                same = (start, end) == want or (start == end and want[0] == want[1])
                assert same, f"{name} on rank {rank} of {world}, {n} elements: " \
                             f"{bounds}, reduce_scatter_tensor gives {want}"
                checked += 1
    assert checked == 6 * len(LENGTHS) * sum(WORLD_SIZES)


def test_ten_elements_on_four_ranks():
    # The example that once differed: an even split gave rank 2 [6, 8).
    assert [shard_range(10, 4, r) for r in range(4)] == [(0, 3), (3, 6), (6, 9), (9, 10)]
    assert chunk_size(10, 4) == 3 and chunk_size(10, 4, align=16) == 16
    assert shard_range(10, 4, 1, align=4) == (4, 8) and shard_range(10, 4, 3, align=4) == (10, 10)
