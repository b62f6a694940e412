"""rank_device picks this rank's device; synchronize is safe on every device."""

import pytest
import torch
import torch.distributed as dist

import dpcourse
from dpcourse.device import rank_device, synchronize


def _devices():
    t = torch.ones(1, device=rank_device())
    dist.all_reduce(t)  # the device must be usable by the backend
    synchronize()
    return str(rank_device()), t.item()


def test_cpu_without_process_group():
    assert not dist.is_initialized()
    assert rank_device() == torch.device("cpu")
    synchronize("cpu")  # a no-op, must not fail


def test_gloo_ranks_use_the_cpu():
    assert dpcourse.run(_devices, backend="gloo", world_size=2) == [("cpu", 2.0), ("cpu", 2.0)]


@pytest.mark.gpu
def test_nccl_rank_r_uses_cuda_r():
    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if n < 2:
        pytest.skip("needs 2 GPUs")
    assert dpcourse.run(_devices, backend="nccl", world_size=2) == [("cuda:0", 2.0), ("cuda:1", 2.0)]
