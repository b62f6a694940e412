"""When gradients are synchronised (exercise 07) and when a checkpoint is complete (exercise 08).

Each mistake leaves the totals right, so a criterion that only counts elements, or looks
for the file at one moment, lets it through. One honest save is here too: it reaches torch.save
under a name imported before the check starts watching.
"""

import contextlib
import time

import torch
import torch.distributed as dist
from torch import nn, save


class HookedDDPReducesACopy(nn.Module):
    """Exercise 07's wrapper whose hook all-reduces ``p.grad / world_size``, a new tensor."""

    def __init__(self, module):
        super().__init__()
        self.module = module
        self.require_backward_grad_sync, self.sync_this_backward = True, True
        self.in_flight = []
        with torch.no_grad():
            for p in module.parameters():
                dist.broadcast(p, src=0)
        for p in module.parameters():
            p.register_post_accumulate_grad_hook(self._grad_ready)

    def forward(self, *args, **kwargs):
        self.sync_this_backward = self.require_backward_grad_sync
        return self.module(*args, **kwargs)

    def _grad_ready(self, p):
        if self.sync_this_backward:
            # BUG: the sum lands in the quotient, a new tensor; p.grad keeps the local gradient
            self.in_flight.append(dist.all_reduce(p.grad / dist.get_world_size(), async_op=True))

    def finish_gradient_synchronization(self):
        for work in self.in_flight:
            work.wait()
        self.in_flight = []

    @contextlib.contextmanager
    def no_sync(self):
        old, self.require_backward_grad_sync = self.require_backward_grad_sync, False
        try:
            yield
        finally:
            self.require_backward_grad_sync = old


def _scales(micro_batches):
    rows = [len(y) for _, y in micro_batches]
    total = torch.tensor(float(sum(rows)))
    dist.all_reduce(total)
    return [n * dist.get_world_size() / total.item() for n in rows]


def accumulate_syncing_first(model, optimizer, micro_batches, loss_fn):
    """Right weights, but the backward that synchronises is the first, not the last."""
    scales = _scales(micro_batches)
    optimizer.zero_grad()
    (x, y), rest = micro_batches[0], micro_batches[1:]
    (loss_fn(model(x), y) * scales[0]).backward()  # BUG: the later micro-batches stay local
    with model.no_sync():
        for (x, y), s in zip(rest, scales[1:]):
            (loss_fn(model(x), y) * s).backward()
    optimizer.step()


def accumulate_reducing_again(model, optimizer, micro_batches, loss_fn):
    """Right weights and a right last backward, then every gradient all-reduced once more."""
    scales = _scales(micro_batches)
    optimizer.zero_grad()
    with model.no_sync():
        for (x, y), s in zip(micro_batches[:-1], scales[:-1]):
            (loss_fn(model(x), y) * s).backward()
    x, y = micro_batches[-1]
    (loss_fn(model(x), y) * scales[-1]).backward()
    for p in model.module.parameters():  # BUG: the wrapper averaged these already
        dist.all_reduce(p.grad)
        p.grad /= dist.get_world_size()
    optimizer.step()


def _state(model, optimizer, sampler, step):
    mine, rng = torch.get_rng_state(), []
    for src in range(dist.get_world_size()):
        state = mine.clone() if src == dist.get_rank() else torch.empty_like(mine)
        dist.broadcast(state, src=src)
        rng.append(state)
    return {"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
            "epoch": sampler.epoch, "step": step, "rng": rng}


def save_without_barrier_slow_peers(path, model, optimizer, sampler, step):
    """No barrier; the other ranks happen to take a second before they return."""
    state = _state(model, optimizer, sampler, step)
    if dist.get_rank() == 0:
        torch.save(state, path)
    else:
        time.sleep(1.0)  # BUG: time, not a barrier, is all that keeps them from going on early


def save_rewritten_after_barrier(path, model, optimizer, sampler, step):
    """Rank 0 writes the model first, and the full checkpoint over it after the barrier."""
    state = _state(model, optimizer, sampler, step)
    if dist.get_rank() == 0:
        torch.save({"model": state["model"]}, path)
    dist.barrier()
    if dist.get_rank() == 0:
        torch.save(state, path)  # BUG: the other ranks have returned; the file is being rewritten


def save_with_save_imported_from_torch(path, model, optimizer, sampler, step):
    """Honest: the solution's save, through ``save`` bound when this module was imported."""
    state = _state(model, optimizer, sampler, step)
    if dist.get_rank() == 0:
        save(state, path)
    dist.barrier()


def load_checkpoint(path, model, optimizer, sampler):
    """A correct load, for the planted saves (the check takes both from one module)."""
    state = torch.load(path, map_location="cpu", weights_only=True)
    model.module.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    sampler.set_epoch(state["epoch"])
    torch.set_rng_state(state["rng"][dist.get_rank()])
    return state["step"]
