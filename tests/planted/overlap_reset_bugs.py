"""Exercise 06 wrappers that forget to start each step's count afresh (right in step 1 only)."""

import torch
import torch.distributed as dist
from torch import nn

from dpcourse.ddp import assign_buckets


class OverlappedNoReset(nn.Module):
    """Part 1's wrapper, except that the gradients counted per bucket are never reset."""

    def __init__(self, module, bucket_cap_mb=25.0):
        super().__init__()
        self.module = module
        params = [p for p in module.parameters() if p.requires_grad]
        with torch.no_grad():
            for p in module.parameters():
                dist.broadcast(p, src=0)
        self.buckets = [[params[i] for i in b] for b in assign_buckets(params, bucket_cap_mb)]
        self.arrived = [0] * len(self.buckets)
        self.in_flight = []
        for b, bucket in enumerate(self.buckets):
            for p in bucket:
                p.register_post_accumulate_grad_hook(lambda p, b=b: self._grad_ready(b))

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def _grad_ready(self, b):
        self.arrived[b] += 1
        if self.arrived[b] == len(self.buckets[b]):
            flat = torch.cat([p.grad.reshape(-1) for p in self.buckets[b]])
            self.in_flight.append((b, flat, dist.all_reduce(flat, async_op=True)))

    def finish_gradient_synchronization(self):
        for b, flat, work in self.in_flight:
            work.wait()
            flat.div_(dist.get_world_size())
            offset = 0
            for p in self.buckets[b]:
                p.grad.copy_(flat[offset:offset + p.numel()].view_as(p.grad))
                offset += p.numel()
        self.in_flight = []  # BUG: self.arrived keeps counting into the next step


class ArrivalOrderNoReset(nn.Module):
    """Part 2's wrapper, except that the gradients counted per bucket are never reset."""

    def __init__(self, module, bucket_cap_mb=25.0):
        super().__init__()
        self.module = module
        self.cap = bucket_cap_mb * 2**20
        with torch.no_grad():
            for p in module.parameters():
                dist.broadcast(p, src=0)
        self.order, self.buckets, self.in_flight = [], None, []
        for p in module.parameters():
            if p.requires_grad:
                p.register_post_accumulate_grad_hook(self._grad_ready)

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def _grad_ready(self, p):
        if self.buckets is None:
            self.order.append(p)
            return
        b = self.bucket_of[p]
        self.arrived[b] += 1
        if self.arrived[b] == len(self.buckets[b]):
            flat = torch.cat([q.grad.reshape(-1) for q in self.buckets[b]])
            flat.div_(dist.get_world_size())
            self.in_flight.append((b, flat, dist.all_reduce(flat, async_op=True)))

    def finish_gradient_synchronization(self):
        if self.buckets is None:
            for p in self.order:
                p.grad.div_(dist.get_world_size())
                dist.all_reduce(p.grad)
            self.buckets, current, size = [], [], 0
            for p in self.order:
                current.append(p)
                size += p.numel() * p.element_size()
                if size >= self.cap:
                    self.buckets.append(current)
                    current, size = [], 0
            if current:
                self.buckets.append(current)
            self.bucket_of = {p: b for b, bucket in enumerate(self.buckets) for p in bucket}
            self.arrived = [0] * len(self.buckets)  # set once, after step 1 ...
        for b, flat, work in self.in_flight:
            work.wait()
            offset = 0
            for p in self.buckets[b]:
                p.grad.copy_(flat[offset:offset + p.numel()].view_as(p.grad))
                offset += p.numel()
        self.in_flight = []  # BUG: ... and never again
