"""Check for exercise 01: the full-batch gradient from shards of different sizes, across ranks.

Every rank holds one contiguous shard of a global batch of ``n`` examples, cut
as ``torch.tensor_split`` cuts it (so sizes differ by one when ``n`` is not a
multiple of the world size, and some shards are empty when ``n`` is smaller
than it). A rank knows only its shard's size and the gradient of its shard's
*mean* loss (an empty shard's mean loss is 0/0, NaN, but the gradient torch
computes for it is zero: no example contributes). The learner's ``global_mean_gradient(local_grad,
local_size, group=None)`` must return, on every rank, the gradient of the mean
loss over all ``n`` examples: one process computes that with autograd on the
whole batch, and the check compares.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from dpcourse.grading.criteria import Criterion, mismatch
from dpcourse.grading.inprocess import CheckSpec

IN, OUT = 5, 3
TOL = (1e-5, 1e-6)  # float32 gradients of a mean over a few dozen examples, summed differently


def split_sizes(n: int, world_size: int) -> list[int]:
    """Return the shard sizes ``torch.tensor_split`` gives (the check's reference)."""
    return [len(t) for t in torch.arange(n).tensor_split(world_size)]


def flat_grad(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Return the gradient of the mean squared error over ``(x, y)``, flattened into one vector."""
    model.zero_grad(set_to_none=True)
    nn.functional.mse_loss(model(x), y).backward()
    return torch.cat([p.grad.reshape(-1) for p in model.parameters()])


def _cases(ws: int) -> list[tuple[str, int]]:
    return [("equal_shards", 4 * ws), ("uneven_shards", 4 * ws + 1),
            ("uneven_shards", 5 * ws - 1), ("empty_shard", ws - 1)]


class MeanGradient(CheckSpec):
    """``global_mean_gradient(local_grad, local_size, group=None)``, and ``shard_sizes(n, N)``."""

    name, exercise, title = "mean_gradient", "01", "The gradient of the mean from uneven shards"
    world_sizes = (2, 3)
    timeout = 30.0
    criteria = (
        Criterion("equal_shards", "with equal shards, every rank gets the full-batch gradient",
                  "The ranks must combine their gradients with a collective; the result must "
                  "be the mean loss's gradient, not a sum over ranks."),
        Criterion("uneven_shards", "with shards one example apart (n not a multiple of N), "
                  "every rank gets the full-batch gradient",
                  "Each shard's gradient is that of its own mean: a mean over a larger shard "
                  "stands for more examples. What must each rank send so that the combination "
                  "counts every example once, and what total must you divide by?"),
        Criterion("empty_shard", "with fewer examples than ranks (some shards empty), every "
                  "rank gets the full-batch gradient",
                  "A rank with no examples must still take part in the collective (every rank "
                  "calls it) but must not count: dividing by the number of ranks counts it."),
        Criterion("same_on_every_rank", "every rank returns the same tensor, with the gradient's "
                  "shape",
                  "Return a new tensor; all ranks must end with identical values (a collective "
                  "that leaves the result on one rank only is not enough)."),
        Criterion("shard_sizes_like_tensor_split", "shard_sizes(n, N) gives the sizes "
                  "tensor_split gives, n = 0 to 13 and N = 1 to 5",
                  "Sizes differ by at most one and add up to n; which shards get the extra "
                  "example? Print torch.arange(n).tensor_split(N) for a few n and look.",
                  requires="shard_sizes"),
    )
    notes = (f"compared with one process's autograd on the whole batch, rtol={TOL[0]:g}, "
             f"atol={TOL[1]:g} (float32)",)

    def run(self, rec, combine, extras, reference):
        ws, rank = dist.get_world_size(), dist.get_rank()
        torch.manual_seed(0)
        model = nn.Linear(IN, OUT)
        for crit, n in _cases(ws):
            g = torch.Generator().manual_seed(300 + n)
            x, y = torch.randn(n, IN, generator=g), torch.randn(n, OUT, generator=g)
            full = flat_grad(model, x, y)
            xs, ys = x.tensor_split(ws), y.tensor_split(ws)
            local = flat_grad(model, xs[rank], ys[rank])  # zeros for an empty shard
            sizes = split_sizes(n, ws)
            case = f"n={n}, shard sizes {sizes}"
            with rec.case(crit, case):
                got = combine(local, len(xs[rank]))
            if not isinstance(got, torch.Tensor):
                rec.record(crit, False, f"returned {type(got).__name__}, expected a tensor", case)
                continue
            diff = mismatch(got, full, *TOL)
            rec.record(crit, not diff, f"rank {rank} (shard of {sizes[rank]}): {diff}", case)
            gathered = [torch.empty_like(full) for _ in range(ws)]
            dist.all_gather(gathered, got.detach().reshape(full.shape).contiguous()
                            if got.numel() == full.numel() else torch.full_like(full, float("inf")))
            same = all(torch.equal(a.nan_to_num(), gathered[0].nan_to_num()) for a in gathered)
            rec.record("same_on_every_rank", same and got.shape == full.shape,
                       "the ranks returned different tensors" if not same else
                       f"shape {tuple(got.shape)}, expected {tuple(full.shape)}", case)
        if "shard_sizes" in extras and rank == 0:
            self._sizes(rec, extras["shard_sizes"])

    @staticmethod
    def _sizes(rec, shard_sizes) -> None:
        for n in range(14):
            for w in range(1, 6):
                case = f"shard_sizes({n}, {w})"
                with rec.case("shard_sizes_like_tensor_split", case):
                    got = shard_sizes(n, w)
                want = split_sizes(n, w)
                if [int(s) for s in got] != want:
                    rec.record("shard_sizes_like_tensor_split", False,
                               f"got {list(got)}, expected {want}", case)
                    return
        rec.record("shard_sizes_like_tensor_split", True)
