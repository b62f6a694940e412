"""What lessons 00-04 say torch, gloo or DDP does, asked of torch itself.

Each test names the lesson cell whose sentence it backs. Multi-rank facts run on
CPU ranks over gloo, started by :func:`dpcourse.run`.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import dpcourse


def _reduce_with_every_op():
    """On each rank: all-reduce ``rank + 1`` (int64) with every ReduceOp; the value or the error."""
    out = {}
    for name in ("SUM", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR"):
        t = torch.tensor([dist.get_rank() + 1], dtype=torch.int64)
        dist.all_reduce(t, op=getattr(dist.ReduceOp, name))
        out[name] = t.item()
    try:
        dist.all_reduce(torch.ones(1), op=dist._make_nccl_premul_sum(2.0))
        out["PREMUL_SUM"] = "accepted"
    except (RuntimeError, ValueError) as exc:
        out["PREMUL_SUM"] = str(exc)
    try:
        dist.all_reduce(torch.ones(1), op=lambda a, b: a + b)
        out["python function"] = "accepted"
    except TypeError as exc:
        out["python function"] = type(exc).__name__
    return out


def test_reduce_ops_are_a_fixed_set():
    """Lesson 00, answer to "Predict, then run": an all-reduce's ``op`` is one of
    ``dist.ReduceOp``'s fixed operations, SUM, AVG, PRODUCT, MIN, MAX, BAND, BOR, BXOR
    and PREMUL_SUM (``UNUSED``, where a version lists it, is no operation)."""
    names = set(dist.ReduceOp.RedOpType.__members__) - {"UNUSED"}
    assert names == {"SUM", "AVG", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR", "PREMUL_SUM"}


def test_gloo_reduce_ops():
    """Lesson 00, answer to "Predict, then run": on gloo SUM, PRODUCT, MIN, MAX, BAND,
    BOR and BXOR leave every rank with the same result; gloo refuses PREMUL_SUM; a
    Python function as ``op`` is refused with a TypeError."""
    results = dpcourse.run(_reduce_with_every_op, world_size=2, backend="gloo", device="cpu")
    expected = dict(SUM=1 + 2, PRODUCT=1 * 2, MIN=1, MAX=2, BAND=1 & 2, BOR=1 | 2, BXOR=1 ^ 2)
    for r in results:
        assert {k: r[k] for k in expected} == expected
        assert "PREMUL_SUM" in r["PREMUL_SUM"] and "Gloo" in r["PREMUL_SUM"]
        assert r["python function"] == "TypeError"


def _ddp_and_local_gradients():
    """On each rank: the gradient torch DDP leaves, and every rank's own local gradient."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    plain = torch.nn.Linear(4, 1)
    plain.load_state_dict(model.state_dict())
    ddp = DDP(model)
    torch.manual_seed(100 + rank)  # different data on every rank
    x, y = torch.randn(8, 4), torch.randn(8, 1)
    torch.nn.functional.mse_loss(ddp(x), y).backward()
    torch.nn.functional.mse_loss(plain(x), y).backward()
    local = torch.cat([p.grad.flatten() for p in plain.parameters()])
    everyone = [torch.empty_like(local) for _ in range(world)]
    dist.all_gather(everyone, local)
    return dict(ddp=torch.cat([p.grad.flatten() for p in model.parameters()]),
                mean=torch.stack(everyone).mean(0), local=local)


def test_ddp_gradient_is_mean_over_ranks():
    """Lesson 03, "The whole algorithm": after backward, torch DDP's gradient is the mean
    of the ranks' local gradients (their sum divided by the world size), on every rank."""
    for n in (2, 3):
        for r in dpcourse.run(_ddp_and_local_gradients, world_size=n, backend="gloo", device="cpu"):
            assert torch.allclose(r["ddp"], r["mean"], rtol=1e-6, atol=1e-7)
            assert not torch.allclose(r["ddp"], r["local"], rtol=1e-3)  # not this rank's own


def _float16_sums():
    """On each rank: a float16 gradient of 40000 averaged by torch DDP, and the plain float16 sum."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = torch.nn.Linear(1, 1, bias=False).half()
    ddp = DDP(model)
    ddp(torch.full((1, 1), 40000.0, dtype=torch.float16)).sum().backward()  # d/dw (w x) = x
    summed = torch.tensor([40000.0], dtype=torch.float16)
    dist.all_reduce(summed)
    return dict(ddp=model.weight.grad.item(), sum_first=summed.item(),
                max_float16=torch.finfo(torch.float16).max)


def test_ddp_divides_float16_gradients_before_summing():
    """Lesson 03, "The whole algorithm": torch DDP divides before it sums. Two ranks each
    with a float16 gradient of 40000: the float16 sum (80000) overflows to inf (float16
    ends at 65504), yet DDP's averaged gradient is 40000, so each rank's gradient was
    halved before the all-reduce added them."""
    for r in dpcourse.run(_float16_sums, world_size=2, backend="gloo", device="cpu"):
        assert r["max_float16"] == 65504.0
        assert r["sum_first"] == float("inf")
        assert r["ddp"] == 40000.0


def _buffers_after_forwards():
    """On each rank: BatchNorm's running mean after each of 3 forwards under torch DDP's defaults."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4, momentum=0.0))
    ddp = DDP(model)
    seen = []
    for _ in range(3):
        with torch.no_grad():
            model[1].running_mean.fill_(float(dist.get_rank()))  # this rank's own value
        ddp(torch.randn(8, 4)).sum().backward()
        seen.append(model[1].running_mean.tolist())
    # The flag that governs it: broadcast_buffers (renamed forward_sync_buffers in torch 2.13).
    flag = ddp.forward_sync_buffers if hasattr(ddp, "forward_sync_buffers") else ddp.broadcast_buffers
    return dict(seen=seen, flag=flag)


def test_ddp_broadcasts_buffers_before_every_forward_by_default():
    """Lesson 02, introduction and "Broadcast before every forward": with its default
    arguments torch DDP copies rank 0's buffers to every rank before every forward (its
    ``broadcast_buffers`` flag, ``forward_sync_buffers`` from torch 2.13, is on)."""
    for r in dpcourse.run(_buffers_after_forwards, world_size=2, backend="gloo", device="cpu"):
        assert r["seen"] == [[0.0] * 4] * 3
        assert r["flag"] is True


def _p2p_on_a_subgroup():
    """Ranks 1 and 2 exchange over the group {1, 2}, naming each other by global rank."""
    rank = dist.get_rank()
    group = dist.new_group([1, 2])
    if rank == 0:
        return None
    peer = 3 - rank  # 1 <-> 2: global ranks; their ranks inside the group are 0 and 1
    send, recv = torch.tensor([float(rank)]), torch.zeros(1)
    works = dist.batch_isend_irecv([dist.P2POp(dist.isend, send, peer, group),
                                    dist.P2POp(dist.irecv, recv, peer, group)])
    for w in works:
        w.wait()
    return dict(group_rank=dist.get_rank(group), received=recv.item())


def test_p2p_peers_are_global_ranks():
    """Lesson 04, "The code": a point-to-point call on a sub-group names its peer by global
    rank (rank 2 of the world is rank 1 of the group {1, 2}, and is addressed as 2)."""
    results = dpcourse.run(_p2p_on_a_subgroup, world_size=3, backend="gloo", device="cpu")
    assert results[0] is None
    assert results[1] == dict(group_rank=0, received=2.0)
    assert results[2] == dict(group_rank=1, received=1.0)


def test_distributed_sampler_shuffles_with_seed_plus_epoch():
    """Lesson 03, "Why set_epoch": torch's DistributedSampler seeds its shuffle with
    ``seed + epoch``, the same on every rank, and the ranks split that one order between
    them; without ``set_epoch`` the epoch stays 0."""
    from torch.utils.data.distributed import DistributedSampler

    data = list(range(64))
    moved = DistributedSampler(data, num_replicas=2, rank=0, shuffle=True, seed=3)
    moved.set_epoch(2)
    assert list(moved) == list(DistributedSampler(data, num_replicas=2, rank=0, shuffle=True, seed=5))
    ranks = [list(DistributedSampler(data, num_replicas=2, rank=r, shuffle=True, seed=0)) for r in (0, 1)]
    assert sorted(ranks[0] + ranks[1]) == data  # one shared order, split: every example once
    fixed = DistributedSampler(data, num_replicas=2, rank=0, shuffle=True, seed=0)
    assert list(fixed) == list(fixed) == ranks[0]  # nothing advances the epoch by itself


def _default_bucket_cap():
    from torch.nn.parallel import DistributedDataParallel as DDP

    return DDP(torch.nn.Linear(2, 2)).bucket_bytes_cap


def test_ddp_default_bucket_cap_is_25_mib():
    """Lesson 04, answer on gradient buckets: torch DDP's default bucket cap is 25 MiB."""
    caps = dpcourse.run(_default_bucket_cap, world_size=2, backend="gloo", device="cpu")
    assert caps == [25 * 2**20] * 2


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(pytest.main([__file__, "-q"]))
