"""Inputs and comparisons shared by the collective tests (module level, so ranks can import them).

Every hand-built all-reduce is checked the same way: each rank makes the same
kinds of data (integer-valued, which every summation order adds exactly, and
random) for the awkward lengths, and the result is compared with
``dist.all_reduce`` on the same input.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)
BIG = 10007  # prime: never divisible by the world size


def lengths(world_size: int) -> list[int]:
    """0, 1, fewer than the ranks, not divisible, and large-ish."""
    return sorted({0, 1, max(world_size - 1, 0), 2 * world_size + 1, BIG})


def rank_data(rank: int, n: int, dtype, seed: int, integer: bool) -> torch.Tensor:
    """This rank's input: small integers (exact in any order) or standard normal values."""
    g = torch.Generator().manual_seed(1000 * seed + rank)
    x = torch.randint(-8, 9, (n,), generator=g).float() if integer else torch.randn(n, generator=g)
    return x.to(dtype)


def tolerance(dtype, world_size: int) -> dict:
    """Round-off allowed between two summation orders: a few ulps of the largest partial sum."""
    eps = torch.finfo(dtype).eps
    return {"rtol": 4 * eps, "atol": 4 * eps * world_size * 5.0}


def against_library(fn, world_size: int, group=None) -> list:
    """Run ``fn`` and ``dist.all_reduce`` on the same inputs for every length, dtype and data kind."""
    rank = dist.get_rank()
    out = []
    for n in lengths(world_size):
        for dtype in DTYPES:
            for integer in (True, False):
                x = rank_data(rank, n, dtype, seed=n, integer=integer)
                expected, got = x.clone(), x.clone()
                dist.all_reduce(expected, group=group)
                fn(got)
                out.append(((n, str(dtype), integer), got, expected))
    return out


def assert_cases(cases, world_size: int, label: str) -> None:
    """Assert every ``(case, got, expected)``: exact for integer data, within tolerance otherwise."""
    for (n, dtype, integer), got, expected in cases:
        msg = f"{label}: n={n} {dtype} {'integer' if integer else 'randn'} data"
        assert got.shape == expected.shape and got.dtype == expected.dtype, msg
        if integer:
            assert torch.equal(got, expected), msg
        else:
            torch.testing.assert_close(got, expected, **tolerance(got.dtype, world_size), msg=msg)
