"""Averaging over ranks: where the division goes relative to the sum, and why it depends on dtype.

A mean over ``N`` ranks is a sum divided by ``N``; the division can come before
the sum (each rank scales its own contribution) or after it. The dtype decides
whether the order matters for range:

* fp16 has 5 exponent bits and a largest finite value of 65504: two ranks'
  gradients of 60000 sum to ``inf`` although their mean, 60000, fits. Divided
  first, the sum of ``N`` scaled values never exceeds the largest one.
* bf16 has fp32's 8 exponent bits (the same smallest normal value, a largest
  value within 1% of fp32's) but 8 bits of precision (``eps = 2**-7``): a sum
  that fits in fp32 fits in bf16, so there the order moves roundings, not
  overflow. Dividing a normal value by a power of two is exact (only the
  exponent changes); dividing by 3 rounds most values.

Each statement is checked against torch in ``tests/test_averaging.py``, as is
that torch DDP, with and without its ``allreduce_hook``, divides before it sums
(its fp16 mean of 60000 and 60000 over two ranks is 60000, where
``dist.all_reduce``'s sum is ``inf``).
"""

from __future__ import annotations

import torch


def sum_can_overflow(dtype: torch.dtype) -> bool:
    """Return True for dtypes with fewer exponent bits than fp32 (fp16, fp8), where a sum may overflow.

    Args:
        dtype: the dtype the sum over ranks is computed in.

    Returns:
        True when ``dtype``'s smallest normal value is larger than fp32's (a
        narrower exponent range); False for fp32, bf16, fp64 and integer dtypes.
    """
    if not dtype.is_floating_point:
        return False
    return torch.finfo(dtype).tiny > torch.finfo(torch.float32).tiny


@torch.no_grad()
def divide_before_sum(tensor: torch.Tensor, divisor: int, *,
                      only_if_sum_can_overflow: bool = False) -> bool:
    """Divide ``tensor`` in place by ``divisor`` ahead of its sum over ranks; return whether it did.

    Args:
        tensor: this rank's contribution to the sum, updated in place.
        divisor: what the sum is to be divided by (usually the world size).
        only_if_sum_can_overflow: False (default): divide whatever the dtype, the
            order torch DDP uses. True: divide only where :func:`sum_can_overflow`
            (fp16); otherwise leave ``tensor`` as it is and the caller divides
            after the sum.

    Returns:
        True if ``tensor`` was divided; False means the caller must divide the sum.
    """
    if only_if_sum_can_overflow and not sum_can_overflow(tensor.dtype):
        return False
    tensor.div_(divisor)
    return True
