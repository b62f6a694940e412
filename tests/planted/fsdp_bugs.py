"""Wrong answers to exercise 14 (the hooks of an FSDP unit), one mistake each."""

import torch
import torch.distributed as dist

from dpcourse.fsdp.flat_params import FlatParams, gathered  # noqa: F401 - as the notebook


class _Hooks:
    """The right hooks; each bug below changes one of them."""

    def __init__(self, unit, flats, group=None):
        self.unit, self.flats, self.group = unit, flats, group
        unit.register_forward_pre_hook(self.pre_forward)
        unit.register_forward_hook(self.post_forward)

    def gather(self):
        for flat in self.flats:
            dist.all_gather_into_tensor(flat.alloc_unsharded(), flat.shard.detach(),
                                        group=self.group)

    def pre_forward(self, module, args):
        self.gather()
        for flat in self.flats:
            if flat.requires_grad and torch.is_grad_enabled():
                flat.to_unsharded(gathered(flat, self.post_backward))
            else:
                flat.to_unsharded(flat.full)

    def post_forward(self, module, args, output):
        for flat in self.flats:
            flat.reshard()
        if output.requires_grad:
            output.register_hook(self.pre_backward)

    def pre_backward(self, grad):
        self.gather()

    def post_backward(self, flat, grad_full):
        world = dist.get_world_size(self.group)
        mine = torch.empty(flat.chunk, dtype=grad_full.dtype)
        dist.reduce_scatter_tensor(mine, grad_full / world, group=self.group)
        flat.shard.grad = mine if flat.shard.grad is None else flat.shard.grad + mine
        flat.reshard()


class NoBackwardGather(_Hooks):
    """Frees after forward but never gathers again before backward."""

    def post_forward(self, module, args, output):
        for flat in self.flats:
            flat.reshard()


class SummedNotAveraged(_Hooks):
    """Reduce-scatters the gradient but forgets to divide by the world size."""

    def post_backward(self, flat, grad_full):
        mine = torch.empty(flat.chunk, dtype=grad_full.dtype)
        dist.reduce_scatter_tensor(mine, grad_full, group=self.group)
        flat.shard.grad = mine if flat.shard.grad is None else flat.shard.grad + mine
        flat.reshard()


class AllReduceThenSlice(_Hooks):
    """Right gradients, but all-reduces the whole flat gradient and keeps its own chunk."""

    def post_backward(self, flat, grad_full):
        world, rank = dist.get_world_size(self.group), dist.get_rank(self.group)
        total = grad_full / world
        dist.all_reduce(total, group=self.group)
        mine = total[rank * flat.chunk:(rank + 1) * flat.chunk].clone()
        flat.shard.grad = mine if flat.shard.grad is None else flat.shard.grad + mine
        flat.reshard()


class NeverFrees(_Hooks):
    """Gathers and reduce-scatters right but keeps every unit's full weights."""

    def post_forward(self, module, args, output):
        if output.requires_grad:
            output.register_hook(self.pre_backward)

    def post_backward(self, flat, grad_full):
        world = dist.get_world_size(self.group)
        mine = torch.empty(flat.chunk, dtype=grad_full.dtype)
        dist.reduce_scatter_tensor(mine, grad_full / world, group=self.group)
        flat.shard.grad = mine if flat.shard.grad is None else flat.shard.grad + mine


class NewBufferForBackward(_Hooks):
    """Gathers again before backward, but into a new tensor autograd never saw."""

    def pre_backward(self, grad):
        for flat in self.flats:
            fresh = torch.empty(flat.full.numel())
            dist.all_gather_into_tensor(fresh, flat.shard.detach(), group=self.group)


class FreesBeforeWait(_Hooks):
    """Starts each gather asynchronously and frees the buffer before waiting for it."""

    def gather(self):
        for flat in self.flats:
            work = dist.all_gather_into_tensor(flat.alloc_unsharded(), flat.shard.detach(),
                                               group=self.group, async_op=True)
            flat.reshard()
            work.wait()


class ReadsFreedWeights(_Hooks):
    """Reads a unit's weights after freeing them: torch touches released memory."""

    def post_forward(self, module, args, output):
        super().post_forward(module, args, output)
        print(float(self.flats[0].full.sum()))
