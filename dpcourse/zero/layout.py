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
from dpcourse.ddp.bucket_assignment import assign_buckets


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
        """Return an uninitialised ``(world_size, row)`` buffer (:meth:`pack` writes all of it)."""
        p = self.params[0]
        return torch.empty(world_size, self.row, dtype=dtype or p.dtype, device=p.device)

    @torch.no_grad()
    def pack(self, matrix: torch.Tensor, tensors) -> None:
        """Write each tensor's ``M`` chunks into column block ``k`` of ``matrix``, zero-padded.

        One ``torch.cat`` writes every element of the bucket, so the step launches
        a kernel per bucket rather than one per parameter (and the buffer needs
        no zero-filling first). ``M`` is ``matrix``'s number of rows: the world
        size for a bucket's full gradients, 1 for this rank's row of shards.

        Args:
            matrix: ``(M, row)`` contiguous buffer, overwritten.
            tensors: per parameter, a tensor of at most ``M * chunks[k]`` elements
                (a gradient shaped like the parameter, or this rank's 1-D shard), or
                ``None`` (zeros).
        """
        m = matrix.shape[0]
        blocks = []
        for t, c in zip(tensors, self.chunks):
            if not c:
                continue  # an empty parameter has no chunk
            if t is None:
                blocks.append(matrix.new_zeros(m, c))
                continue
            flat = t.reshape(-1)
            if flat.numel() != m * c:  # a short last chunk: pad it (only these tensors copy twice)
                flat = torch.nn.functional.pad(flat, (0, m * c - flat.numel()))
            blocks.append(flat.view(m, c))
        if blocks:
            torch.cat(blocks, dim=1, out=matrix)

    @torch.no_grad()
    def unpack(self, matrix: torch.Tensor) -> None:
        """Copy every rank's chunks in ``matrix`` back into the parameters, in place.

        One ``torch.split_with_sizes_copy`` (a single kernel on CUDA) writes every
        parameter whose size divides by the world size straight into its ``(N, c)``
        view; a parameter with a padded last chunk goes through a scratch block.
        """
        n_rows = matrix.shape[0]
        sizes, outs, padded = [], [], []
        for p, c in zip(self.params, self.chunks):
            if not c:
                continue
            flat = p.detach().view(-1)
            if flat.numel() == n_rows * c:
                outs.append(flat.view(n_rows, c))
            else:
                scratch = matrix.new_empty(n_rows, c)
                outs.append(scratch)
                padded.append((flat, scratch))
            sizes.append(c)
        if sizes:
            torch.split_with_sizes_copy(matrix, sizes, dim=1, out=outs)
        for flat, scratch in padded:
            flat.copy_(scratch.view(-1)[:flat.numel()])


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
