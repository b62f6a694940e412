"""Wrong pure functions: bucket assignment and the ring's cost model."""


def assign_buckets_forward(params, bucket_cap_mb=25.0):
    """Fills buckets first parameter to last (the order of the forward pass)."""
    cap, buckets, current, size = bucket_cap_mb * 2**20, [], [], 0
    for i in range(len(params)):  # BUG: gradients arrive last layer first
        current.append(i)
        size += params[i].numel() * params[i].element_size()
        if size >= cap:
            buckets.append(current)
            current, size = [], 0
    return buckets + ([current] if current else [])


def assign_buckets_elements(params, bucket_cap_mb=25.0):
    """Counts elements as if every one took 4 bytes."""
    cap, buckets, current, size = bucket_cap_mb * 2**20, [], [], 0
    for i in reversed(range(len(params))):
        current.append(i)
        size += params[i].numel() * 4  # BUG: float16/float64 take 2/8 bytes
        if size >= cap:
            buckets.append(current)
            current, size = [], 0
    return buckets + ([current] if current else [])


def ring_time_no_latency(nbytes, world_size, alpha, beta):
    """Forgets that each of the 2 (N - 1) steps pays alpha."""
    return 2 * (world_size - 1) / world_size * nbytes * beta  # BUG: no alpha term


def assign_buckets_strict(params, bucket_cap_mb=25.0):
    """Closes a bucket only once it holds more than the cap."""
    cap, buckets, current, size = bucket_cap_mb * 2**20, [], [], 0
    for i in reversed(range(len(params))):
        current.append(i)
        size += params[i].numel() * params[i].element_size()
        if size > cap:  # BUG: a bucket that reaches exactly the cap must close
            buckets.append(current)
            current, size = [], 0
    return buckets + ([current] if current else [])
