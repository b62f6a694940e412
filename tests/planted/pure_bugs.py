"""Wrong pure functions: the ring's cost model."""


def ring_time_no_latency(nbytes, world_size, alpha, beta):
    """Forgets that each of the 2 (N - 1) steps pays alpha."""
    return 2 * (world_size - 1) / world_size * nbytes * beta  # BUG: no alpha term
