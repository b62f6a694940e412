"""The one way a flat tensor is cut into one shard per rank: as ``dist.reduce_scatter_tensor``.

``dist.reduce_scatter_tensor(out, inp)`` takes an input of ``N * c`` elements and
leaves block ``r`` (elements ``[r c, (r + 1) c)``) on rank ``r``;
``dist.all_gather_into_tensor`` is its inverse. A tensor of ``numel`` elements
that ``N`` does not divide is padded to ``N * c`` with ``c = ceil(numel / N)``,
so rank ``r`` owns ``[r c, (r + 1) c)`` clipped to ``numel``: every shard but
the last ones has ``c`` real elements, the last may be short or empty (10
elements on 4 ranks: ``[0, 3) [3, 6) [6, 9) [9, 10)``).

The ring (:mod:`dpcourse.comm.ring`), ZeRO (:mod:`dpcourse.zero`), FSDP
(:mod:`dpcourse.fsdp`) and the NVLink kernels (:mod:`dpcourse.comm.kernels`) all
cut tensors with these two functions. The kernels round ``c`` up to a multiple of
``align`` elements so that every shard starts on an aligned address; ``align=1``
is the collectives' layout. ``tests/test_sharding.py`` checks it against
``dist.reduce_scatter_tensor`` on gloo.
"""

from __future__ import annotations


def chunk_size(numel: int, world_size: int, align: int = 1) -> int:
    """Return one rank's shard length: ``ceil(numel / world_size)``, rounded up to ``align``.

    Args:
        numel: elements of the flat tensor (``>= 0``).
        world_size: number of ranks ``N`` (``>= 1``).
        align: round the shard up to a multiple of this many elements (``1``: no rounding).

    Returns:
        ``c``; the padded tensor has ``N * c`` elements.
    """
    if numel < 0 or world_size < 1 or align < 1:
        raise ValueError(f"need numel >= 0, world_size >= 1, align >= 1; got "
                         f"{numel}, {world_size}, {align}.")
    per_rank = -(-numel // world_size)
    return -(-per_rank // align) * align


def shard_range(numel: int, world_size: int, rank: int, align: int = 1) -> tuple[int, int]:
    """Return ``(start, end)`` of the real (unpadded) elements ``rank`` owns of a flat tensor.

    Args:
        numel: elements of the flat tensor.
        world_size: number of ranks ``N``.
        rank: the rank, ``0 <= rank < N``.
        align: as in :func:`chunk_size`.

    Returns:
        ``(min(rank * c, numel), min((rank + 1) * c, numel))`` with
        ``c = chunk_size(numel, N, align)``; empty for the last ranks when ``numel`` is small.
    """
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} out of range for world_size={world_size}.")
    c = chunk_size(numel, world_size, align)
    return min(rank * c, numel), min((rank + 1) * c, numel)
