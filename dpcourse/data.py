"""Give each rank its own share of the data, and tiny deterministic datasets to share.

Data parallelism only speeds training up if every rank sees *different*
examples: with a plain ``DataLoader`` every rank reads the same batches, so K
ranks compute K identical gradients and the effective batch is one rank's
batch, not K times it. :class:`ShardedSampler` splits the (shuffled) index
list into K disjoint interleaved shards, like
``torch.utils.data.distributed.DistributedSampler``.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch.utils.data import Sampler, TensorDataset


def _replicas_and_rank(num_replicas, rank) -> tuple[int, int]:
    if num_replicas is None or rank is None:
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError(
                "ShardedSampler needs num_replicas and rank: pass them explicitly, or create the "
                "sampler inside a process group (dpcourse.run, or torchrun + init_process_group)."
            )
        num_replicas = dist.get_world_size() if num_replicas is None else num_replicas
        rank = dist.get_rank() if rank is None else rank
    if isinstance(num_replicas, bool) or not isinstance(num_replicas, int) or num_replicas < 1:
        raise ValueError(f"num_replicas must be a positive int, got {num_replicas!r}.")
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < num_replicas:
        raise ValueError(f"rank must be an int in [0, {num_replicas - 1}], got {rank!r}.")
    return num_replicas, rank


class ShardedSampler(Sampler[int]):
    """Yield this rank's share of a dataset's indices, reshuffled identically on all ranks.

    The index list (shuffled with ``seed + epoch`` when ``shuffle``) is first made
    divisible by ``num_replicas``: either padded by repeating indices from its
    start (every rank then does the same number of steps; a few examples count
    twice) or, with ``drop_last``, cut at the end. Rank ``r`` then takes
    positions ``r, r + num_replicas, r + 2 * num_replicas, ...``. Same indices as
    ``DistributedSampler`` for the same arguments.

    Args:
        dataset: anything with ``len()``.
        num_replicas: number of ranks (default: the process group's world size).
        rank: this rank (default: the process group's rank).
        shuffle: shuffle the indices each epoch.
        seed: base seed; must be the same on every rank.
        drop_last: drop the tail instead of padding.
    """

    def __init__(self, dataset, num_replicas: int | None = None, rank: int | None = None,
                 shuffle: bool = True, seed: int = 0, drop_last: bool = False):
        if not hasattr(dataset, "__len__"):
            raise TypeError(
                f"ShardedSampler needs a dataset with len(), got {type(dataset).__name__}.")
        self.dataset = dataset
        self.num_replicas, self.rank = _replicas_and_rank(num_replicas, rank)
        self.shuffle, self.seed, self.drop_last = bool(shuffle), int(seed), bool(drop_last)
        self.epoch = 0
        n = len(dataset)
        # Padding rounds the per-rank count up, dropping rounds it down.
        self.num_samples = n // self.num_replicas if drop_last else math.ceil(n / self.num_replicas)
        self.total_size = self.num_samples * self.num_replicas

    def set_epoch(self, epoch: int) -> None:
        """Use a new shuffle for ``epoch``; call it on every rank, with the same value, each epoch.

        Args:
            epoch: the epoch number (the shuffle is seeded with ``seed + epoch``).
        """
        self.epoch = int(epoch)

    def global_order(self) -> list[int]:
        """Return the padded (or cut) index list of the epoch, before it is split among ranks."""
        n = len(self.dataset)
        if self.shuffle:
            g = torch.Generator()
            g.manual_seed(self.seed + self.epoch)  # same seed on every rank => same permutation
            order = torch.randperm(n, generator=g).tolist()
        else:
            order = list(range(n))
        # Cyclic repetition pads from the start; for drop_last this is a plain cut.
        return [order[i % n] for i in range(self.total_size)] if n else []

    def __iter__(self):
        return iter(self.global_order()[self.rank::self.num_replicas])

    def __len__(self) -> int:
        return self.num_samples


def make_regression(n: int = 256, in_features: int = 8, out_features: int = 1,
                    noise: float = 0.1, seed: int = 0) -> TensorDataset:
    """Build a linear-plus-noise regression dataset, identical for a given seed.

    Args:
        n: number of examples.
        in_features: input width.
        out_features: target width.
        noise: standard deviation of the Gaussian noise added to the targets.
        seed: generator seed.

    Returns:
        ``TensorDataset(x, y)``: ``x`` (n, in_features) and ``y`` (n, out_features), float32.
    """
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, in_features, generator=g)
    w = torch.randn(in_features, out_features, generator=g)
    y = x @ w + noise * torch.randn(n, out_features, generator=g)
    return TensorDataset(x, y)


def make_classification(n: int = 256, in_features: int = 8, num_classes: int = 4,
                        seed: int = 0) -> TensorDataset:
    """Build a separable-ish classification dataset (Gaussian blobs), identical for a given seed.

    Args:
        n: number of examples.
        in_features: input width.
        num_classes: number of classes.
        seed: generator seed.

    Returns:
        ``TensorDataset(x, y)``: ``x`` float32 (n, in_features), ``y`` int64 (n,) of class ids.
    """
    g = torch.Generator().manual_seed(seed)
    centers = 2.0 * torch.randn(num_classes, in_features, generator=g)
    y = torch.randint(0, num_classes, (n,), generator=g)
    x = centers[y] + torch.randn(n, in_features, generator=g)
    return TensorDataset(x, y)


def shard_batch(batch: torch.Tensor, rank: int | None = None,
                world_size: int | None = None) -> torch.Tensor:
    """Return this rank's contiguous slice of a global batch (dimension 0).

    Args:
        batch: the global batch; its first dimension must divide evenly by ``world_size``,
            so that the mean of per-rank mean losses equals the global mean loss.
        rank: this rank (default: the process group's rank).
        world_size: number of ranks (default: the process group's world size).

    Returns:
        A view of rows ``[rank * b, (rank + 1) * b)`` with ``b = len(batch) // world_size``.
    """
    world_size, rank = _replicas_and_rank(world_size, rank)
    if batch.shape[0] % world_size:
        raise ValueError(
            f"a global batch of {batch.shape[0]} cannot be split evenly over {world_size} ranks; "
            "use a multiple of the world size so every rank's mean loss weighs the same."
        )
    b = batch.shape[0] // world_size
    return batch[rank * b:(rank + 1) * b]
