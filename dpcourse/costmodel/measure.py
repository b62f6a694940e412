"""Where older notebooks import the measured step sweep from; it lives in :mod:`dpcourse.bench.steps`."""

from dpcourse.bench.steps import ddp_step_sweep

__all__ = ["ddp_step_sweep"]
