"""SyncBatchNorm that runs on any backend: batch statistics over the global batch.

BatchNorm normalises with the mean and variance of the batch it sees. Under
data parallelism each rank sees only its shard, so each rank normalises with
different statistics and keeps different running averages: the model is no
longer the one a single process would train on the global batch.
``torch.nn.SyncBatchNorm`` fixes that with extra collectives, but only on GPUs.
This module does the same on any backend (gloo included), so a CPU lesson can
show it, with the same collectives per BatchNorm layer and step:

* forward: one all-reduce of ``[sum x, sum x^2, count]`` per channel;
* backward: one all-reduce of the gradient of those sums (:class:`AllReduceSum`'s
  backward: the gradient of a sum over ranks is the sum of the ranks' gradients).

torch's version moves the same information with an all-gather in forward and an
all-reduce in backward (``torch/nn/modules/_functions.py``).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm


class AllReduceSum(torch.autograd.Function):
    """Sum a tensor over ranks in forward; sum its gradient over ranks in backward."""

    @staticmethod
    def forward(ctx, tensor, group):
        ctx.group = group
        out = tensor.clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()
        # Each rank's loss depends on every rank's sums: their gradients add up.
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class SyncBatchNorm(_BatchNorm):
    """BatchNorm whose training statistics are those of the batch summed over all ranks.

    Args:
        num_features: channels ``C`` of an input shaped ``(N, C, ...)``.
        eps, momentum, affine, track_running_stats: as ``torch.nn.BatchNorm1d``.
        process_group: group to share statistics over (``None``: the default group).
    """

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: float | None = 0.1,
                 affine: bool = True, track_running_stats: bool = True, process_group=None):
        super().__init__(num_features, eps, momentum, affine, track_running_stats)
        self.process_group = process_group

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"expected an input of shape (N, C, ...), got {tuple(input.shape)}.")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Normalise ``x`` (N, C, ...) with global-batch statistics in training, running ones in eval."""
        self._check_input_dim(x)
        synced = self.training and dist.is_available() and dist.is_initialized()
        if not synced:
            return super().forward(x)
        dims = [0] + list(range(2, x.dim()))
        count = torch.full((self.num_features,), x.numel() / self.num_features,
                           dtype=x.dtype, device=x.device)
        local = torch.cat([x.sum(dims), (x * x).sum(dims), count])
        total = AllReduceSum.apply(local, self.process_group)
        s, ss, n = total.split(self.num_features)
        mean = s / n
        var = ss / n - mean * mean  # biased variance normalises, as in BatchNorm
        if self.track_running_stats:
            self._update_running_stats(mean.detach(), var.detach(), n[0].item())
        shape = [1, -1] + [1] * (x.dim() - 2)
        y = (x - mean.view(shape)) * torch.rsqrt(var.view(shape) + self.eps)
        if self.affine:
            y = y * self.weight.view(shape) + self.bias.view(shape)
        return y

    @torch.no_grad()
    def _update_running_stats(self, mean, var, n: float) -> None:
        assert self.running_mean is not None and self.running_var is not None
        assert self.num_batches_tracked is not None  # track_running_stats=True
        self.num_batches_tracked += 1
        momentum = (1.0 / self.num_batches_tracked.item() if self.momentum is None
                    else self.momentum)
        unbiased = var * (n / max(n - 1, 1))  # running_var keeps the unbiased estimate
        self.running_mean.mul_(1 - momentum).add_(mean, alpha=momentum)
        self.running_var.mul_(1 - momentum).add_(unbiased, alpha=momentum)


def convert_sync_batchnorm(module: nn.Module, process_group=None) -> nn.Module:
    """Replace every BatchNorm layer of ``module`` with :class:`SyncBatchNorm`, keeping its state.

    Same role as ``torch.nn.SyncBatchNorm.convert_sync_batchnorm``, whose layers
    only run on GPUs; these also run on CPU over gloo.

    Args:
        module: the model (changed in place where possible).
        process_group: group to share statistics over (``None``: the default group).

    Returns:
        The converted module (a new object if ``module`` itself is a BatchNorm layer).
    """
    if isinstance(module, _BatchNorm) and not isinstance(module, SyncBatchNorm):
        new = SyncBatchNorm(module.num_features, module.eps, module.momentum, module.affine,
                            module.track_running_stats, process_group)
        new.load_state_dict(module.state_dict())
        new.train(module.training)
        return new.to(next(iter(module.state_dict().values()), torch.empty(0)).device)
    for name, child in module.named_children():
        module.add_module(name, convert_sync_batchnorm(child, process_group))
    return module


__all__ = ["SyncBatchNorm", "convert_sync_batchnorm"]
