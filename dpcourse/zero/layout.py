"""How a list of parameters is cut into one shard per rank (flat, padded, per parameter).

Every parameter's flattened values are cut into ``N`` equal chunks of
``chunk = ceil(numel / N)`` elements (the last ones padded with zeros), and rank
``r`` owns chunk ``r`` of EVERY parameter (the layout of ``dist.reduce_scatter_tensor``,
:func:`dpcourse.comm.sharding.shard_range`). Each rank therefore owns ``1/N`` of
every tensor, whatever the sizes, so an optimizer state that has the shape of
the parameters shrinks to ``1/N`` per rank (up to the padding, at most ``N - 1``
elements per tensor).

Chunks are packed into buckets (:func:`dpcourse.ddp.assign_buckets`, so the
gradients of the last layers form the first bucket, as in DDP). A bucket is
one ``(N, row)`` matrix: row ``r`` holds rank ``r``'s chunk of each of its
parameters side by side. That is exactly the layout ``reduce_scatter`` (rank
``r`` gets row ``r``) and ``all_gather`` (row ``r`` comes from rank ``r``)
work on, so one collective serves a whole bucket.

This requires an optimizer whose update of each element depends only on that
element's gradient and state (SGD, momentum, Adam, AdamW): cutting tensors
anywhere does not change what those compute. Optimizers that take norms over a
whole tensor (LAMB, Adafactor) would need whole tensors per rank instead.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from dpcourse.comm.sharding import chunk_size
from dpcourse.ddp.buckets import assign_buckets


@dataclass
class ShardBucket:
    """The parameters one collective serves, and where each one's chunk sits in a row.

    Attributes:
        indices: positions of its parameters in the sharded list (arrival order in backward).
        params: the parameters.
        chunks: ``chunks[k]`` elements of ``params[k]`` per rank.
        offsets: ``offsets[k]``: where ``params[k]``'s chunk starts inside a row.
        row: elements per rank (the sum of ``chunks``).
    """

    indices: list[int]
    params: list[torch.Tensor] = field(repr=False)
    chunks: list[int]
    offsets: list[int]
    row: int

    def new_matrix(self, world_size: int, dtype=None) -> torch.Tensor:
        """Return a zeroed ``(world_size, row)`` buffer for this bucket (padding stays zero)."""
        p = self.params[0]
        return torch.zeros(world_size, self.row, dtype=dtype or p.dtype, device=p.device)

    @torch.no_grad()
    def pack(self, matrix: torch.Tensor, tensors) -> None:
        """Write each tensor's ``N`` chunks into column block ``k`` of ``matrix`` (``None``: zeros).

        Args:
            matrix: ``(N, row)`` buffer, zeroed where nothing is written.
            tensors: one tensor per parameter, shaped like it, or ``None``.
        """
        for t, c, off in zip(tensors, self.chunks, self.offsets):
            if t is not None and c:
                _copy_rows(matrix[:, off:off + c], t.reshape(-1), into_matrix=True)

    @torch.no_grad()
    def unpack(self, matrix: torch.Tensor) -> None:
        """Copy every rank's chunks in ``matrix`` back into the parameters, in place."""
        for p, c, off in zip(self.params, self.chunks, self.offsets):
            if c:
                _copy_rows(matrix[:, off:off + c], p.detach().view(-1), into_matrix=False)


def _copy_rows(block: torch.Tensor, flat: torch.Tensor, into_matrix: bool) -> None:
    """Copy between ``flat`` (n elements) and the first n elements of ``block`` (N, c) read row by row."""
    n, c = flat.numel(), block.shape[1]
    full = n // c  # complete rows; the last chunk may be short (padding) or absent
    rest = n - full * c
    pairs = [(block[:full], flat[:full * c].view(full, c))]
    if rest:
        pairs.append((block[full, :rest], flat[full * c:]))
    for b, f in pairs:
        (b if into_matrix else f).copy_(f if into_matrix else b)


def make_shard_buckets(params: list[torch.Tensor], world_size: int,
                       bucket_cap_mb: float) -> list[ShardBucket]:
    """Group ``params`` into buckets of about ``bucket_cap_mb`` MiB of full gradients.

    Args:
        params: contiguous tensors in registration order.
        world_size: number of ranks ``N``.
        bucket_cap_mb: a bucket closes once its full tensors reach this many MiB
            (see :func:`dpcourse.ddp.assign_buckets`; 0: one bucket per parameter).

    Returns:
        Buckets in the order their gradients complete during backward.
    """
    buckets = []
    for indices in assign_buckets(params, bucket_cap_mb):
        chunks = [chunk_size(params[i].numel(), world_size) for i in indices]
        offsets = [sum(chunks[:k]) for k in range(len(chunks))]
        buckets.append(ShardBucket(indices, [params[i] for i in indices], chunks, offsets,
                                   sum(chunks)))
    return buckets
