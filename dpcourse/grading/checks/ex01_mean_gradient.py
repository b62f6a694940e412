"""Exercise 01: the full-batch gradient from shards of different sizes, across ranks.

Every rank holds one contiguous shard of a global batch of ``n`` examples, cut
as ``torch.tensor_split`` cuts it (sizes differ by one when ``n`` is not a
multiple of the world size; some shards are empty when ``n`` is smaller than
it). A rank knows only its shard's size and the gradient of its shard's *mean*
loss (an empty shard's mean loss is 0/0, NaN, but the gradient torch computes
for it is zero: no example contributes). ``global_mean_gradient(local_grad,
local_size, group=None)`` must return, on every rank, the gradient of the mean
loss over all ``n`` examples, which the grader computes with autograd on the
whole batch in one process.
"""

from __future__ import annotations

import torch
from torch import nn

from dpcourse.grading.checks.base import Exercise, CaseVerdict, begin, returned
from dpcourse.grading.checks.random_inputs import regression_batches, torch_generator
from dpcourse.grading.criteria import Criterion, mismatch, no_deadlock, no_delegation
from dpcourse.grading.shim import COLLECTIVES, P2P

IN, OUT = 5, 3
TOL = (1e-5, 1e-6)  # float32 gradients of a mean over a few dozen examples, summed differently


def split_sizes(n: int, world_size: int) -> list[int]:
    """Return the shard sizes ``torch.tensor_split`` gives (the grader's reference)."""
    return [len(t) for t in torch.arange(n).tensor_split(world_size)]


def flat_grad(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Return the gradient of the mean squared error over ``(x, y)``, flattened into one vector."""
    model.zero_grad(set_to_none=True)
    nn.functional.mse_loss(model(x), y).backward()
    return torch.cat([p.grad.reshape(-1) for p in model.parameters()])


def _model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Linear(IN, OUT)


class MeanGradient(Exercise):
    """``global_mean_gradient(local_grad, local_size, group=None)``, and ``shard_sizes(n, N)``."""

    name, exercise, title = "mean_gradient", "01", "The gradient of the mean from uneven shards"
    defines = (("main", "global_mean_gradient"), ("shard_sizes", "shard_sizes"))
    world_sizes = (2, 3)
    dist_api = P2P + COLLECTIVES
    timeout = 30.0
    criteria = (
        Criterion("equal_shards", "with equal shards, every rank gets the full-batch gradient",
                  "Even with equal shards the result is off: a ratio of N in the message means "
                  "the ranks' gradients were summed where the mean loss needs their mean; other "
                  "values mean a rank kept its own gradient.", weight=2),
        Criterion("uneven_shards", "with shards one example apart (n not a multiple of N), "
                  "every rank gets the full-batch gradient",
                  "Each shard's gradient is that of its own mean: a mean over a larger shard "
                  "stands for more examples. What must each rank send so that the combination "
                  "counts every example once, and what total must you divide by?", weight=3),
        Criterion("empty_shard", "with fewer examples than ranks (some shards empty), every "
                  "rank gets the full-batch gradient",
                  "A rank with no examples must still take part in the collective (every rank "
                  "calls it) but must not count: dividing by the number of ranks counts it.",
                  weight=2),
        Criterion("same_on_every_rank", "every rank returns the same tensor, with the gradient's "
                  "shape", "Return a new tensor; all ranks must end with identical values (a "
                  "collective that leaves the result on one rank only is not enough).",
                  needs=("equal_shards",)),
        Criterion("shard_sizes_like_tensor_split", "shard_sizes(n, N) gives the sizes "
                  "tensor_split gives, n = 0 to 13 and N = 1 to 5",
                  "Sizes differ by at most one and add up to n; which shards get the extra "
                  "example? Print what torch's tensor_split gives for a few n and look.",
                  requires="shard_sizes"),
        no_delegation("equal_shards"), no_deadlock("equal_shards"),
    )
    notes = (f"compared with one process's autograd on the whole batch, rtol={TOL[0]:g}, "
             f"atol={TOL[1]:g} (float32); fresh random data on each run",)

    def make_inputs(self, rng, world_size):
        seed = rng.getrandbits(31)
        cases = []
        for crit, n in (("equal_shards", 4 * world_size), ("uneven_shards", 4 * world_size + 1),
                        ("uneven_shards", rng.randrange(2, 9) * world_size + world_size - 1),
                        ("empty_shard", world_size - 1)):
            (x, y), = regression_batches(torch_generator(rng), 1, n, IN, OUT)
            cases.append({"crit": crit, "x": x, "y": y})
        return [{"seed": seed, "rank": r, "cases": cases} for r in range(world_size)]

    @staticmethod
    def rank_run(link, learner, inputs):
        combine, out = learner["main"], {"cases": [], "sizes": []}
        model, rank = _model(inputs["seed"]), inputs["rank"]
        for case in inputs["cases"]:
            ws = link.world_size
            xs, ys = case["x"].tensor_split(ws), case["y"].tensor_split(ws)
            local = flat_grad(model, xs[rank], ys[rank])  # zeros for an empty shard
            begin(link, f"{case['crit']}, n={len(case['x'])}")
            got = combine(local, len(xs[rank]))
            out["cases"].append(returned(got))
        sizes = learner.get("shard_sizes")
        if sizes is not None and rank == 0:
            begin(link, "shard_sizes")
            for n in range(14):
                for w in range(1, 6):
                    got = sizes(n, w)
                    out["sizes"].append([int(s) for s in got])
        return out

    def judge(self, ws, inputs, outputs, events):
        recs = []
        model = _model(inputs[0]["seed"])
        for k, case in enumerate(inputs[0]["cases"]):
            full = flat_grad(model, case["x"], case["y"])
            name = f"n={len(case['x'])}, shard sizes {split_sizes(len(case['x']), ws)}"
            gots = [outputs[r]["cases"][k] for r in range(ws)]
            for r, got in enumerate(gots):
                if not isinstance(got, torch.Tensor):
                    recs.append(CaseVerdict(case["crit"], False, f"rank {r} returned {got}, expected "
                                       "a tensor", name))
                    continue
                diff = mismatch(got, full, *TOL)
                recs.append(CaseVerdict(case["crit"], not diff, f"rank {r}: {diff}", name))
            tensors = [g for g in gots if isinstance(g, torch.Tensor)]
            same = len(tensors) == ws and all(
                g.shape == full.shape and torch.equal(g.nan_to_num(), tensors[0].nan_to_num())
                for g in tensors)
            recs.append(CaseVerdict("same_on_every_rank", same, "the ranks returned different tensors "
                               f"(the gradient has shape {tuple(full.shape)})", name))
        if outputs[0]["sizes"]:
            queries = [(n, w) for n in range(14) for w in range(1, 6)]
            bad = [(n, w, got) for (n, w), got in zip(queries, outputs[0]["sizes"])
                   if got != split_sizes(n, w)]
            recs.append(CaseVerdict("shard_sizes_like_tensor_split", not bad,
                               f"shard_sizes({bad[0][0]}, {bad[0][1]}) gave {bad[0][2]}, expected "
                               f"{split_sizes(bad[0][0], bad[0][1])}" if bad else ""))
        return recs
