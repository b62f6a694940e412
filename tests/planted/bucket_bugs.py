"""Wrong answers to exercise 05, part 1: buckets that must fit a buffer of bucket_cap_mb MiB.

Each is graded code (no imports beyond torch), so ``check`` and ``run_check``
take them as a learner's definitions.
"""


def within_cap_lesson_rule(params, bucket_cap_mb=25.0):
    """Lesson 05's rule transcribed: the gradient that crosses the cap stays in the bucket."""
    cap, buckets, current, size = bucket_cap_mb * 2**20, [], [], 0
    for i in reversed(range(len(params))):
        current.append(i)
        size += params[i].numel() * params[i].element_size()
        if size >= cap:  # BUG: the bucket now holds more than the buffer
            buckets.append(current)
            current, size = [], 0
    return buckets + ([current] if current else [])


def within_cap_refuses_exact_fit(params, bucket_cap_mb=25.0):
    """Closes a bucket when the next gradient would fill it to exactly the cap."""
    cap, buckets, current, size = bucket_cap_mb * 2**20, [], [], 0
    for i in reversed(range(len(params))):
        nbytes = params[i].numel() * params[i].element_size()
        if current and size + nbytes >= cap:  # BUG: a gradient that fills it exactly fits
            buckets.append(current)
            current, size = [], 0
        current.append(i)
        size += nbytes
    return buckets + ([current] if current else [])


def within_cap_empty_bucket(params, bucket_cap_mb=25.0):
    """Closes the open bucket before a gradient that does not fit, even when it is empty."""
    cap, buckets, current, size = bucket_cap_mb * 2**20, [], [], 0
    for i in reversed(range(len(params))):
        nbytes = params[i].numel() * params[i].element_size()
        if size + nbytes > cap:  # BUG: with nothing in it, the bucket is closed empty
            buckets.append(current)
            current, size = [], 0
        current.append(i)
        size += nbytes
    return buckets + ([current] if current else [])


def within_cap_oversized_joins(params, bucket_cap_mb=25.0):
    """Makes room only for gradients that fit a buffer; a larger one joins the open bucket."""
    cap, buckets, current, size = bucket_cap_mb * 2**20, [], [], 0
    for i in reversed(range(len(params))):
        nbytes = params[i].numel() * params[i].element_size()
        if current and size + nbytes > cap and nbytes <= cap:  # BUG: big ones never close it
            buckets.append(current)
            current, size = [], 0
        current.append(i)
        size += nbytes
    return buckets + ([current] if current else [])


def within_cap_forward(params, bucket_cap_mb=25.0):
    """Fills buckets first parameter to last (the order of the forward pass)."""
    cap, buckets, current, size = bucket_cap_mb * 2**20, [], [], 0
    for i in range(len(params)):  # BUG: backward produces the last layer's gradients first
        nbytes = params[i].numel() * params[i].element_size()
        if current and size + nbytes > cap:
            buckets.append(current)
            current, size = [], 0
        current.append(i)
        size += nbytes
    return buckets + ([current] if current else [])


def within_cap_elements(params, bucket_cap_mb=25.0):
    """Counts every element as 4 bytes."""
    cap, buckets, current, size = bucket_cap_mb * 2**20, [], [], 0
    for i in reversed(range(len(params))):
        nbytes = params[i].numel() * 4  # BUG: float16 and float64 elements take 2 and 8 bytes
        if current and size + nbytes > cap:
            buckets.append(current)
            current, size = [], 0
        current.append(i)
        size += nbytes
    return buckets + ([current] if current else [])
