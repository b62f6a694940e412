"""Resuming from a full checkpoint continues the very same run, on every rank."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import dpcourse
from dpcourse.data import ShardedSampler, make_regression
from dpcourse.ddp import DataParallelOverlapped
from dpcourse.ddp.checkpoint import (load_checkpoint, read_checkpoint_file, save_checkpoint,
                                     strip_module_prefix)

EPOCHS, BATCH = 3, 4


def _setup():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Dropout(0.3), nn.Linear(32, 1))
    model = DataParallelOverlapped(net, bucket_cap_mb=0.001)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
    x, y = make_regression(n=40, seed=1).tensors
    sampler = ShardedSampler(x, seed=7)
    return model, opt, sched, sampler, x, y


def _epoch(model, opt, sched, sampler, x, y, epoch):
    sampler.set_epoch(epoch)
    idx = list(sampler)
    for i in range(0, len(idx), BATCH):
        b = idx[i:i + BATCH]
        F.mse_loss(model(x[b]), y[b]).backward()
        opt.step()
        opt.zero_grad()
    sched.step()


def run_resumed(path: str, stop_after: int | None) -> dict:
    """Train EPOCHS epochs straight, or stop after ``stop_after``, save, rebuild, load, go on."""
    torch.manual_seed(100 + dist.get_rank())  # dropout differs per rank
    model, opt, sched, sampler, x, y = _setup()
    torch.manual_seed(100 + dist.get_rank())
    start = 0
    if stop_after is not None:
        for epoch in range(stop_after):
            _epoch(model, opt, sched, sampler, x, y, epoch)
        save_checkpoint(path, model, opt, sched, sampler, step=stop_after)
        torch.manual_seed(12345)  # the resumed process starts with other generators
        model, opt, sched, sampler, x, y = _setup()
        start = load_checkpoint(path, model, opt, sched, sampler)["step"]
    for epoch in range(start, EPOCHS):
        _epoch(model, opt, sched, sampler, x, y, epoch)
    saved = read_checkpoint_file(path)["model"] if stop_after is not None else None
    return {"params": [p.detach().clone() for p in model.parameters()],
            "keys": None if saved is None else sorted(saved),
            "lr": opt.param_groups[0]["lr"]}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("ckpt") / "state.pt")
    straight = dpcourse.run(run_resumed, path, None, world_size=2, backend="gloo")
    resumed = dpcourse.run(run_resumed, path, 1, world_size=2, backend="gloo")
    return straight, resumed


def test_resume_is_exact_on_every_rank(results):
    straight, resumed = results
    for a, b in zip(straight, resumed):
        assert all(torch.equal(p, q) for p, q in zip(a["params"], b["params"]))
        assert a["lr"] == b["lr"]


def test_checkpoint_keys_have_no_module_prefix(results):
    _, resumed = results
    assert resumed[0]["keys"] == ["0.bias", "0.weight", "3.bias", "3.weight"]


def test_prefixed_state_dict_loads_into_the_bare_model():
    net = nn.Linear(2, 2)
    prefixed = {f"module.{k}": v for k, v in net.state_dict().items()}
    nn.Linear(2, 2).load_state_dict(strip_module_prefix(prefixed))
