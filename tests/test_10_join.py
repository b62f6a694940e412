"""Lesson 10: uneven inputs. Under torch's Join, ranks with different batch counts finish and
end with the parameters torch DDP + Join gives, on gloo with 2 and 3 ranks."""

from __future__ import annotations

import pytest

import dpcourse
from join_helpers import join_against_torch

# Batches per rank: they differ by up to 3.
COUNTS = {2: [5, 2], 3: [4, 1, 3]}
# name -> (wrapper, model, divide_by_initial_world_size, kwargs, hook, no_sync every n-th batch)
CASES = {
    "naive-mlp": ("naive", "mlp", True, {}, None, 0),
    "bucketed-batchnorm": ("bucketed", "batchnorm", True, {"bucket_cap_mb": 0.0005}, None, 0),
    "overlapped-batchnorm-live-divisor": ("overlapped", "batchnorm", False,
                                          {"bucket_cap_mb": 0.0005}, None, 0),
    "overlapped-tied": ("overlapped", "tied", True, {}, None, 0),
    "overlapped-fp16-hook": ("overlapped", "deep_mlp", True, {"bucket_cap_mb": 0.002},
                             "fp16", 0),
    "bucketed-no-sync": ("bucketed", "mlp", True, {}, None, 2),
}


@pytest.fixture(scope="module", params=[2, 3], ids=lambda w: f"world{w}")
def results(request):
    world = request.param
    return dpcourse.run(join_against_torch, COUNTS[world], CASES, world_size=world,
                        backend="gloo", timeout=300)


@pytest.mark.parametrize("case", sorted(CASES))
def test_uneven_ranks_finish_and_match_torch_ddp_under_join(results, case):
    # Same data, same Join: the same parameters and buffers as torch DDP, on every rank
    # (fp32 summation order aside; fp16 hook: rounding of the compressed sum).
    tol = 2e-3 if CASES[case][4] == "fp16" and len(results) > 2 else 1e-6
    for r in results:
        ours, ddp = r[case]["ours"], r[case]["ddp"]
        assert ours.keys() == ddp.keys()
        for n in ours:
            assert (ours[n] - ddp[n]).abs().max().item() <= tol, (case, n)


@pytest.mark.parametrize("case", sorted(CASES))
def test_every_rank_ends_with_the_same_model(results, case):
    # Join's post-hook copies the state of one of the last ranks to join to all others.
    for r in results[1:]:
        for n, t in r[case]["ours"].items():
            assert t.equal(results[0][case]["ours"][n]), (case, n)
