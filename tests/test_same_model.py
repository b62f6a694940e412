"""Sharded training refuses ranks that built different models, naming the first difference.

ZeRO (:class:`dpcourse.zero.ShardedOptimizer`) and FSDP
(:class:`dpcourse.fsdp.FullyShardedDataParallel`) cut every parameter into shards
by its shape: ranks with different models would hang (different parameter counts),
crash inside the backend (different sizes) or silently train a (4, 2) weight as a
(2, 4) one. They make the same check the data-parallel wrappers make
(:func:`dpcourse.ddp.guards.check_same_model`), on every rank, before any collective
(ZeRO with ``gradients="averaged"`` leaves it to the wrapper that averages the gradients).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

import dpcourse
from dpcourse import RankError

pytestmark = pytest.mark.usefixtures("no_leaked_processes")


def _model(kind: str) -> nn.Module:
    rank = dist.get_rank()
    if kind == "transposed":  # same number of elements, different shape
        shape = (4, 2) if rank == 0 else (2, 4)
        return nn.Sequential(nn.Linear(shape[1], shape[0]), nn.ReLU(), nn.Linear(shape[0], 1))
    layers = [nn.Linear(4, 4)] + ([nn.Linear(4, 4)] if rank == 1 else [])  # "extra"
    return nn.Sequential(*layers)


def build_zero(kind: str, gradients: str, named: bool):
    from dpcourse.zero import ShardedOptimizer

    model = _model(kind)
    params = model.named_parameters() if named else model.parameters()
    ShardedOptimizer(params, torch.optim.AdamW, lr=1e-3, gradients=gradients)
    return "trained"


def build_fsdp(kind: str):
    from dpcourse.fsdp import FullyShardedDataParallel

    FullyShardedDataParallel(_model(kind))
    return "trained"


def _refused(fn, *args) -> RankError:
    with pytest.raises(RankError) as info:
        dpcourse.run(fn, *args, world_size=2, backend="gloo", timeout=60)
    err = info.value
    # Every rank raised (none hung waiting in a collective), with the same message.
    assert {err.rank, *err.also} == {0, 1}
    assert err.exc_type == "RuntimeError"
    assert err.message.startswith("the ranks wrap different models: ")
    return err


# gradients="averaged" runs under a data-parallel wrapper, which made the check already.
@pytest.mark.parametrize("gradients", ["reduce_scatter", "sharded"])
def test_zero_refuses_a_transposed_weight(gradients):
    err = _refused(build_zero, "transposed", gradients, True)
    assert "0.weight has shape (4, 2) on rank 0 but (2, 4) on rank 1" in err.message


def test_zero_names_unnamed_parameters_by_position():
    err = _refused(build_zero, "transposed", "reduce_scatter", False)
    assert "param_groups[0]['params'][0] has shape (4, 2) on rank 0 but (2, 4)" in err.message


def test_zero_refuses_an_extra_layer():
    err = _refused(build_zero, "extra", "sharded", True)
    assert "rank 0 has 2 parameters but rank 1 has 4 (the first without a match: '1.weight')" \
        in err.message


def test_fsdp_refuses_a_transposed_weight():
    err = _refused(build_fsdp, "transposed")
    assert "0.weight has shape (4, 2) on rank 0 but (2, 4) on rank 1" in err.message


def test_fsdp_refuses_an_extra_layer():
    err = _refused(build_fsdp, "extra")
    assert "rank 0 has 2 parameters but rank 1 has 4" in err.message


def build_same(which: str):
    torch.manual_seed(dist.get_rank())  # different values are fine: rank 0's are broadcast
    model = nn.Sequential(nn.Linear(4, 2), nn.Linear(2, 1))
    if which == "zero":
        from dpcourse.zero import ShardedOptimizer

        ShardedOptimizer(model.named_parameters(), torch.optim.SGD, lr=0.1,
                         gradients="reduce_scatter")
    else:
        from dpcourse.fsdp import FullyShardedDataParallel

        FullyShardedDataParallel(model)
    return "ok"


@pytest.mark.parametrize("which", ["zero", "fsdp"])
def test_same_model_with_different_values_is_accepted(which):
    assert dpcourse.run(build_same, which, world_size=2, backend="gloo", timeout=60) == ["ok"] * 2
