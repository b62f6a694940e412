"""An optimizer step on gradients that were never averaged is refused with a clear error."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import dpcourse
from ddp_helpers import make_wrapper
from dpcourse.models import MLP


def step_before_sync(kind: str) -> dict:
    """Backward inside no_sync, then step: refused; after an explicit finish: allowed and equal."""
    model = make_wrapper(kind, MLP(seed=0))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(dist.get_rank()))
    with model.no_sync():
        model(x).pow(2).mean().backward()
    try:
        opt.step()
        refused = None
    except RuntimeError as exc:
        refused = str(exc)
    model.finish_gradient_synchronization()
    opt.step()  # now allowed
    opt.zero_grad()
    model(x).pow(2).mean().backward()  # an ordinary synchronised step is untouched
    opt.step()
    return {"refused": refused, "weights": [p.detach().clone() for p in model.parameters()]}


@pytest.mark.parametrize("kind", ["naive", "overlapped"])
def test_step_before_synchronisation_is_refused(kind):
    ranks = dpcourse.run(step_before_sync, kind, world_size=2, backend="gloo")
    for res in ranks:
        assert res["refused"] is not None, "optimizer.step() on unaveraged gradients must raise"
        assert "before the gradients of" in res["refused"]
        assert "finish_gradient_synchronization()" in res["refused"]
    for a, b in zip(ranks[0]["weights"], ranks[1]["weights"]):
        assert torch.equal(a, b)  # replicas stayed identical
