"""Will this machine hold the ranks? Check cores and memory before starting any process.

Every rank is a fresh Python interpreter that imports torch: on a laptop, 64
of them start without complaint and then swap the machine to a halt. The
launcher warns when ranks outnumber cores (they then take turns, and timings
mean little) and refuses when their estimated memory exceeds what is free.
"""

from __future__ import annotations

import os
import warnings

# Resident size of one rank that imported torch and joined a gloo group: 223 MiB
# measured with torch 2.13 (CPU build) on Linux; GPU ranks also hold a CUDA context
# in host memory, so this is a floor.
RANK_MEMORY_BYTES = 230 * 2**20
SKIP_MEMORY_CHECK_ENV = "DPCOURSE_SKIP_MEMORY_CHECK"


def available_memory() -> int | None:
    """Return the bytes the kernel says can be allocated without swapping, or None if unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None  # not Linux: nothing to check against


def check_resources(world_size: int, backend: str) -> None:
    """Warn when ``world_size`` ranks outnumber the CPU cores; refuse when they would not fit in memory.

    Args:
        world_size: ranks about to start.
        backend: ``"gloo"`` (ranks compute on the cores) or ``"nccl"`` (on GPUs).

    Raises:
        RuntimeError: the ranks' estimated memory exceeds the available memory,
            unless the environment variable ``DPCOURSE_SKIP_MEMORY_CHECK=1`` is set.
    """
    cores = os.cpu_count() or 1
    if backend == "gloo" and world_size > cores:
        warnings.warn(
            f"{world_size} ranks on {cores} CPU core(s): the ranks take turns on the cores, so "
            "the run is slower than with fewer ranks and its timings say little about scaling. "
            f"Use world_size <= {cores} unless many ranks is the point.",
            RuntimeWarning, stacklevel=3)
    free = available_memory()
    need = world_size * RANK_MEMORY_BYTES
    if free is not None and need > free and os.environ.get(SKIP_MEMORY_CHECK_ENV) != "1":
        raise RuntimeError(
            f"{world_size} ranks need about {need / 2**30:.1f} GiB of memory (each is a Python "
            f"process with torch, about {RANK_MEMORY_BYTES / 2**20:.0f} MiB before any tensor), "
            f"but only {free / 2**30:.1f} GiB are available: starting them would swap or get "
            f"them killed. Use fewer ranks (world_size <= {max(1, free // RANK_MEMORY_BYTES)}), "
            f"or set {SKIP_MEMORY_CHECK_ENV}=1 in the environment to start them anyway."
        )
