"""Where the division of a mean over ranks goes: the dtype facts behind dpcourse.comm.averaging.

Every statement of the module docstring is asked of torch here, on CPU; the
last test asks torch DDP itself (two gloo ranks) where it divides.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

import dpcourse
from dpcourse.comm.averaging import divide_before_sum, sum_can_overflow

FP8 = [d for d in (getattr(torch, "float8_e4m3fn", None), getattr(torch, "float8_e5m2", None)) if d]


def test_fp16_sum_of_two_gradients_overflows_but_their_mean_fits():
    g = torch.tensor([60000.0], dtype=torch.float16)
    assert torch.finfo(torch.float16).max == 65504
    assert torch.finfo(torch.float16).tiny == 2.0 ** -14  # 5 exponent bits (bias 15)
    assert torch.isinf(g + g).all()  # summed first: inf
    assert torch.isinf(g * 2).all()
    assert (g / 2 + g / 2).item() == 60000.0  # divided first: the mean, exactly


def test_bf16_has_fp32s_exponent_range_and_8_bits_of_precision():
    bf16, fp32 = torch.finfo(torch.bfloat16), torch.finfo(torch.float32)
    assert bf16.tiny == fp32.tiny == 2.0 ** -126  # the same 8 exponent bits (bias 127)
    assert 0.99 * fp32.max < bf16.max < fp32.max  # a largest value within 1% of fp32's
    assert bf16.eps == 2.0 ** -7  # 8 bits of precision (7 stored)
    g = torch.tensor([60000.0], dtype=torch.bfloat16)
    assert torch.isfinite(g + g).all()  # the sum that overflows fp16 fits


def test_bf16_division_by_a_power_of_two_is_exact_and_by_three_rounds():
    x = torch.randn(10_000, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    for n in (2, 4, 8):
        assert torch.equal((x / n).float(), x.float() / n)  # only the exponent changes
        assert torch.equal(x / n * n, x)
    rounded = (x / 3).float() != x.float() / 3  # fp32's quotient has 24 bits, bf16's 8
    assert rounded.float().mean() > 0.5  # most elements are rounded


def test_sum_can_overflow_exactly_for_narrower_exponent_ranges():
    assert sum_can_overflow(torch.float16)
    for d in FP8:
        assert sum_can_overflow(d)
    for d in (torch.bfloat16, torch.float32, torch.float64, torch.int64, torch.int32):
        assert not sum_can_overflow(d)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_divide_before_sum(dtype):
    t = torch.full((3,), 6.0, dtype=dtype)
    assert divide_before_sum(t, 3) is True  # default: every dtype, as torch DDP
    assert t.tolist() == [2.0, 2.0, 2.0]
    t = torch.full((3,), 6.0, dtype=dtype)
    divided = divide_before_sum(t, 3, only_if_sum_can_overflow=True)
    assert divided is (dtype == torch.float16)
    assert t.tolist() == ([2.0] * 3 if divided else [6.0] * 3)


def test_divide_before_sum_keeps_the_fp16_mean_finite_where_the_sum_overflows():
    ranks = [torch.tensor([60000.0], dtype=torch.float16) for _ in range(2)]
    assert torch.isinf(ranks[0] + ranks[1]).all()
    for t in ranks:
        assert divide_before_sum(t, 2, only_if_sum_can_overflow=True)
    assert (ranks[0] + ranks[1]).item() == 60000.0


def _fp16_mean_of_60000() -> dict:
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.nn.parallel import DistributedDataParallel as DDP

    out = {}
    for hook in ("none", "allreduce_hook"):
        model = DDP(nn.Linear(1, 1, bias=False).half())
        if hook == "allreduce_hook":
            model.register_comm_hook(None, default_hooks.allreduce_hook)
        x = torch.full((1, 1), 60000.0, dtype=torch.float16)
        model(x).sum().backward()  # d(w * x)/dw = x = 60000 on every rank
        out[hook] = model.module.weight.grad.item()
    summed = torch.full((1,), 60000.0, dtype=torch.float16)
    dist.all_reduce(summed)
    out["all_reduce_sum"] = summed.item()
    return out


def test_torch_ddp_divides_before_summing():
    """Torch DDP (and its allreduce_hook) average fp16 60000s to 60000: the sum would be inf."""
    for res in dpcourse.run(_fp16_mean_of_60000, world_size=2, device="cpu"):
        assert res["all_reduce_sum"] == float("inf")
        assert res["none"] == 60000.0
        assert res["allreduce_hook"] == 60000.0
