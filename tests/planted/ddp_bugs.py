"""Wrong data-parallel wrappers, one mistake each."""

import contextlib

import torch
import torch.distributed as dist
from torch import nn


class _Wrapper(nn.Module):
    def __init__(self, module, broadcast=True):
        super().__init__()
        self.module = module
        if broadcast:
            for p in module.parameters():
                dist.broadcast(p.data, src=0)

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)


class NaiveNoDivide(_Wrapper):
    """All-reduces every gradient but forgets to divide by the world size."""

    def finish_gradient_synchronization(self):
        for p in self.module.parameters():
            dist.all_reduce(p.grad)  # BUG: a sum, not the mean


class NaiveFirstStepOnly(_Wrapper):
    """Averages the first step's gradients, then believes the work is done for good."""

    def __init__(self, module):
        super().__init__(module)
        self.synced = False

    def finish_gradient_synchronization(self):
        if self.synced:  # BUG: set once, never cleared: later steps keep local gradients
            return
        for p in self.module.parameters():
            dist.all_reduce(p.grad)
            p.grad /= dist.get_world_size()
        self.synced = True


class NaiveNoBroadcast(_Wrapper):
    """Averages gradients correctly but never makes the replicas equal at the start."""

    def __init__(self, module):
        super().__init__(module, broadcast=False)  # BUG: replicas start from different seeds

    def finish_gradient_synchronization(self):
        for p in self.module.parameters():
            dist.all_reduce(p.grad)
            p.grad /= dist.get_world_size()


class ForwardOrderSerialised(_Wrapper):
    """Buckets filled first-to-last, and each all-reduce waited on inside the hook."""

    def __init__(self, module, bucket_cap_mb=25.0):
        super().__init__(module)
        params, cap = list(module.parameters()), bucket_cap_mb * 2**20
        self.buckets, current, size = [], [], 0
        for p in params:  # BUG: forward order; gradients arrive last layer first
            current.append(p)
            size += p.numel() * p.element_size()
            if size >= cap:
                self.buckets.append(current)
                current, size = [], 0
        if current:
            self.buckets.append(current)
        self.ready = [0] * len(self.buckets)
        for b, bucket in enumerate(self.buckets):
            for p in bucket:
                p.register_post_accumulate_grad_hook(lambda p, b=b: self._ready(b))

    def _ready(self, b):
        self.ready[b] += 1
        if self.ready[b] == len(self.buckets[b]):
            self.ready[b] = 0
            flat = torch.cat([p.grad.flatten() for p in self.buckets[b]])
            dist.all_reduce(flat, async_op=True).wait()  # BUG: waits inside backward
            flat /= dist.get_world_size()
            offset = 0
            for p in self.buckets[b]:
                p.grad.copy_(flat[offset:offset + p.numel()].view_as(p))
                offset += p.numel()

    def finish_gradient_synchronization(self):
        pass


class NoSyncStillReduces(_Wrapper):
    """Per-parameter hooks; no_sync() exists but the hooks ignore it."""

    def __init__(self, module):
        super().__init__(module)
        self.require_backward_grad_sync = True
        self.pending = []
        for p in module.parameters():
            p.register_post_accumulate_grad_hook(self._hook)

    def _hook(self, p):
        # BUG: never looks at require_backward_grad_sync, so it communicates inside no_sync
        self.pending.append((p, dist.all_reduce(p.grad, async_op=True)))

    def finish_gradient_synchronization(self):
        for p, work in self.pending:
            work.wait()
            p.grad /= dist.get_world_size()
        self.pending = []

    @contextlib.contextmanager
    def no_sync(self):
        old = self.require_backward_grad_sync
        self.require_backward_grad_sync = False
        try:
            yield
        finally:
            self.require_backward_grad_sync = old


class WrapsTorchDDP(nn.Module):
    """Delegates everything to torch's DistributedDataParallel."""

    def __init__(self, module):
        super().__init__()
        self.module = module
        self.ddp = nn.parallel.DistributedDataParallel(module)

    def forward(self, *args, **kwargs):
        return self.ddp(*args, **kwargs)
