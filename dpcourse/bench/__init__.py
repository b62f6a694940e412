"""Benchmarks: all-reduce bandwidth sweeps and data-parallel step times (``dpcourse bench``).

The functions here run inside the ranks (call them through :func:`dpcourse.run`);
:mod:`dpcourse.bench.cli` launches them, prints tables and writes JSON results.
Names are imported on first use, so ``dpcourse --help`` does not load torch.
"""

import importlib

_EXPORTS = {
    "allreduce_sweep": "dpcourse.bench.allreduce",
    "allreduce_impls": "dpcourse.bench.allreduce",
    "bus_factor": "dpcourse.bench.allreduce",
    "ddp_step_times": "dpcourse.bench.ddp",
    "ddp_bucket_sweep": "dpcourse.bench.ddp",
    "ddp_step_sweep": "dpcourse.bench.steps",
    "profile_ddp_steps": "dpcourse.bench.profile",
    "time_interleaved": "dpcourse.bench.timing",
    "summarize": "dpcourse.bench.timing",
    "environment": "dpcourse.bench.report",
    "write_results": "dpcourse.bench.report",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'dpcourse.bench' has no attribute {name!r}")


def __dir__():
    return __all__
