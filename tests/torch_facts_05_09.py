"""What lessons 05-09 say torch does, asked of torch itself (not of dpcourse's re-implementation).

Each test names the lesson cell whose sentence it backs. Multi-rank facts run on two CPU
ranks over gloo through ``dpcourse.run``.
"""

from __future__ import annotations

import io
import pickle

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

import dpcourse


def _on_two_cpu_ranks(fn, *args):
    return dpcourse.run(fn, *args, world_size=2, device="cpu")


# -- lesson 05 ----------------------------------------------------------------------


def _bucket_sizes(cap_kwargs):
    """Bytes of every bucket torch DDP all-reduces in one step, read from a comm hook."""
    torch.manual_seed(0)
    # Ten 3 MiB tensors: 30 MiB of gradients, so a 25 MiB cap shows in the bucket sizes.
    model = torch.nn.Sequential(*[torch.nn.Linear(887, 887, bias=False) for _ in range(10)])
    ddp = DistributedDataParallel(model, **cap_kwargs)
    sizes = []

    def hook(state, bucket):
        sizes.append(bucket.buffer().numel() * bucket.buffer().element_size())
        fut = torch.futures.Future()
        fut.set_result(bucket.buffer())
        return fut

    ddp.register_comm_hook(None, hook)
    for _ in range(2):  # the second step runs on the buckets DDP rebuilds after the first
        sizes.clear()
        ddp(torch.randn(2, 887)).sum().backward()
    return sorted(sizes)


def _default_and_25():
    return _bucket_sizes({}), _bucket_sizes({"bucket_cap_mb": 25})


def test_ddp_default_bucket_cap_is_25_mib():
    """L05 c0: torch DDP's default buckets are those of bucket_cap_mb=25 (and not of another cap)."""
    default, cap25 = _on_two_cpu_ranks(_default_and_25)[0]
    assert default == cap25
    assert len(default) >= 2 and max(default) >= 25 * 2**20          # a bucket closes past 25 MiB
    assert _on_two_cpu_ranks(_bucket_sizes, {"bucket_cap_mb": 5})[0] != default


def test_zero_grad_sets_gradients_to_none_by_default():
    """L05 c9: after zero_grad() (Module's and Optimizer's), param.grad is None: set_to_none=True."""
    layer = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(layer.parameters(), lr=0.1)
    for zero_grad in (layer.zero_grad, opt.zero_grad):
        layer(torch.randn(4, 3)).sum().backward()
        assert all(p.grad is not None for p in layer.parameters())
        zero_grad()
        assert all(p.grad is None for p in layer.parameters())


def _grad_storages(as_view):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 1))
    ddp = DistributedDataParallel(model, gradient_as_bucket_view=as_view)
    for _ in range(2):  # the second step runs on the buckets as rebuilt after the first
        ddp(torch.randn(4, 8)).sum().backward()
    return len({p.grad.untyped_storage().data_ptr() for p in model.parameters()}), len(list(model.parameters()))


def test_ddp_gradient_as_bucket_view_puts_gradients_in_the_bucket():
    """L05 c9, L06 c7: with gradient_as_bucket_view=True every param.grad lives in the one bucket's
    storage; the default (False) keeps a separate tensor per gradient."""
    import inspect

    assert inspect.signature(DistributedDataParallel.__init__).parameters[
        "gradient_as_bucket_view"].default is False
    storages, n = _on_two_cpu_ranks(_grad_storages, True)[0]
    assert (storages, n) == (1, 4)
    storages, n = _on_two_cpu_ranks(_grad_storages, False)[0]
    assert (storages, n) == (4, 4)


# -- lesson 06 ----------------------------------------------------------------------


def test_post_accumulate_grad_hooks_fire_last_layer_first_after_grad_is_written():
    """L06 c2/c3: register_post_accumulate_grad_hook calls fn(param) once param.grad holds the
    gradient, and backward reaches the last layer's parameters first."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 4),
                                torch.nn.ReLU(), torch.nn.Linear(4, 1))
    seen = []
    for name, p in model.named_parameters():
        p.register_post_accumulate_grad_hook(
            lambda p, name=name: seen.append((name, p.grad is not None and bool(p.grad.abs().sum() > 0))))
    model(torch.randn(8, 4)).sum().backward()
    layers = [int(name.split(".")[0]) for name, _ in seen]
    assert len(seen) == 6 and all(ready for _, ready in seen)
    assert layers == sorted(layers, reverse=True)


def _async_all_reduce():
    t = torch.full((4,), float(dist.get_rank() + 1))
    work = dist.all_reduce(t, async_op=True)
    handle = type(work).__name__, hasattr(work, "wait")
    work.wait()
    return handle, t.tolist()


def test_async_all_reduce_returns_a_work_handle():
    """L06 c5: all_reduce(..., async_op=True) returns a work handle; after wait() the sum is in place."""
    (name, has_wait), values = _on_two_cpu_ranks(_async_all_reduce)[0]
    assert has_wait and name != "NoneType"
    assert values == [3.0] * 4


def test_torch_cat_copies():
    """L06 c7/c8: torch.cat returns new memory; writing it leaves the inputs alone."""
    a, b = torch.zeros(3), torch.zeros(2)
    flat = torch.cat([a, b])
    flat.add_(1)
    assert flat.untyped_storage().data_ptr() not in (a.untyped_storage().data_ptr(),
                                                     b.untyped_storage().data_ptr())
    assert a.sum() == 0 and b.sum() == 0


# -- lesson 07 ----------------------------------------------------------------------


def _no_sync_flag():
    ddp = DistributedDataParallel(torch.nn.Linear(2, 1))
    before = ddp.require_backward_grad_sync
    with ddp.no_sync():
        inside = ddp.require_backward_grad_sync
    return before, inside, ddp.require_backward_grad_sync


def test_ddp_no_sync_sets_and_restores_a_flag():
    """L07 c9: no_sync() sets require_backward_grad_sync to False and restores it on exit."""
    assert _on_two_cpu_ranks(_no_sync_flag)[0] == (True, False, True)


def _split_no_sync():
    torch.manual_seed(0)
    ddp = DistributedDataParallel(torch.nn.Linear(4, 1))
    x = torch.full((2, 4), float(dist.get_rank() + 1))   # different data on each rank

    def grads_agree():
        g = ddp.module.weight.grad.clone()
        other = [torch.zeros_like(g) for _ in range(2)]
        dist.all_gather(other, g)
        ddp.zero_grad()
        return torch.equal(other[0], other[1])

    with ddp.no_sync():
        loss = ddp(x).sum()            # forward inside
    loss.backward()                    # backward outside
    a = grads_agree()
    loss = ddp(x).sum()                # forward outside
    with ddp.no_sync():
        loss.backward()                # backward inside
    b = grads_agree()
    return a, b


def test_ddp_decides_no_sync_at_forward():
    """L07 c9/c10: torch DDP reads the flag at forward time: forward inside no_sync with backward
    outside leaves the gradients local; forward outside with backward inside averages them."""
    forward_inside, forward_outside = _on_two_cpu_ranks(_split_no_sync)[0]
    assert forward_inside is False and forward_outside is True


# -- lesson 08 ----------------------------------------------------------------------


def _huge_gradient():
    # A gradient of 3e38 on both ranks: summing first overflows float32 (max 3.4e38) to inf,
    # dividing by the world size first gives 1.5e38 + 1.5e38 = 3e38.
    ddp = DistributedDataParallel(torch.nn.Linear(1, 1, bias=False))
    ddp(torch.full((1, 1), 3e38)).sum().backward()
    return ddp.module.weight.grad.item()


def test_ddp_divides_by_world_size_before_summing():
    """L08 c8: torch DDP divides each gradient by the world size before the all-reduce sums."""
    grad = _on_two_cpu_ranks(_huge_gradient)[0]
    assert grad == pytest.approx(3e38, rel=1e-6)


class _NotATensor:
    pass


def test_weights_only_load_refuses_other_objects():
    """L08 c4: torch.load(..., weights_only=True) loads tensors and plain containers and refuses
    an arbitrary pickled object."""
    ok, bad = io.BytesIO(), io.BytesIO()
    torch.save({"w": torch.ones(2), "step": 3, "names": ["a"]}, ok)
    torch.save({"obj": _NotATensor()}, bad)
    ok.seek(0)
    bad.seek(0)
    assert torch.load(ok, weights_only=True)["step"] == 3
    with pytest.raises(pickle.UnpicklingError):
        torch.load(bad, weights_only=True)


def _first_update(opt_cls, scale):
    torch.manual_seed(0)
    layer = torch.nn.Linear(8, 1)
    opt = opt_cls(layer.parameters(), lr=1e-2)
    before = layer.weight.detach().clone()
    (scale * layer(torch.randn(16, 8)).pow(2).mean()).backward()
    opt.step()
    return (layer.weight.detach() - before).norm().item()


def test_adamw_update_ignores_the_gradient_scale_sgd_does_not():
    """L08 c2: SGD's update is lr x gradient (4x the gradient, 4x the step); AdamW's step does not
    grow with the gradient's scale, so the linear scaling argument for SGD does not carry over."""
    sgd = _first_update(torch.optim.SGD, 4.0) / _first_update(torch.optim.SGD, 1.0)
    adamw = _first_update(lambda p, lr: torch.optim.AdamW(p, lr=lr, weight_decay=0.0), 4.0) / \
        _first_update(lambda p, lr: torch.optim.AdamW(p, lr=lr, weight_decay=0.0), 1.0)
    assert sgd == pytest.approx(4.0, rel=1e-4)
    assert adamw == pytest.approx(1.0, abs=1e-3)


def test_adamw_state_is_a_step_and_two_moments_shaped_like_the_parameter():
    """L08 c10, L09 c16: AdamW keeps a step count and two moments per parameter, of the parameter's
    shape and dtype: 8 bytes per float32 parameter."""
    layer = torch.nn.Linear(5, 3)
    opt = torch.optim.AdamW(layer.parameters(), lr=1e-3)
    layer(torch.randn(2, 5)).sum().backward()
    opt.step()
    for p in layer.parameters():
        state = opt.state[p]
        assert set(state) == {"step", "exp_avg", "exp_avg_sq"}
        assert float(state["step"]) == 1.0
        moments = [state["exp_avg"], state["exp_avg_sq"]]
        assert all(m.shape == p.shape and m.dtype == torch.float32 for m in moments)
        assert sum(m.numel() * m.element_size() for m in moments) == 8 * p.numel()


# -- lesson 09 ----------------------------------------------------------------------


def test_autocast_keeps_parameters_and_gradients_float32():
    """L09 c16: under autocast a Linear computes in bfloat16, but its weight stays float32, so its
    gradient (what DDP all-reduces) is float32 too."""
    layer = torch.nn.Linear(16, 16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = layer(torch.randn(4, 16))
    assert out.dtype == torch.bfloat16
    out.float().sum().backward()
    assert layer.weight.dtype == torch.float32
    assert layer.weight.grad.dtype == torch.float32 and layer.bias.grad.dtype == torch.float32


def test_bfloat16_weight_loses_a_small_update():
    """L09 c16: a bf16 weight cannot take a small update (1 + 0.001 rounds back to 1), which is why
    mixed-precision training keeps fp32 master weights; in fp32 the update survives."""
    for dtype, kept in ((torch.bfloat16, False), (torch.float32, True)):
        w = torch.ones(1, dtype=dtype)
        w.add_(torch.full((1,), 1e-3, dtype=dtype))
        assert (w.item() != 1.0) is kept
