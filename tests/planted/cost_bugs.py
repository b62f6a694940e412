"""Attempts at exercise 09's part 2, each with one slip of reasoning (part 1 is right in all)."""

import math


def ring_bytes_per_rank(nbytes, world_size):
    return 2 * (world_size - 1) / world_size * nbytes


def ring_all_reduce_time(nbytes, world_size, alpha, beta):
    return 2 * (world_size - 1) * alpha + ring_bytes_per_rank(nbytes, world_size) * beta


def hd_halving_only(nbytes, world_size, alpha, beta):
    """Prices the halving rounds and forgets that doubling brings the parts back."""
    p = 1 << (world_size.bit_length() - 1)
    time = math.log2(p) * alpha + (p - 1) / p * nbytes * beta
    return time + (2 * (alpha + nbytes * beta) if world_size > p else 0.0)


def hd_log_of_n(nbytes, world_size, alpha, beta):
    """Takes log2 N rounds among all N ranks, as if every N were a power of two."""
    return 2 * math.log2(world_size) * alpha + 2 * (world_size - 1) / world_size * nbytes * beta


def hd_no_handoff(nbytes, world_size, alpha, beta):
    """Prices the rounds among p ranks and forgets the ranks that sit out."""
    p = 1 << (world_size.bit_length() - 1)
    return 2 * math.log2(p) * alpha + 2 * (p - 1) / p * nbytes * beta


def hd_ring(nbytes, world_size, alpha, beta):
    """Answers with the ring's time."""
    return ring_all_reduce_time(nbytes, world_size, alpha, beta)
