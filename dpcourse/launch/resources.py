"""Will this machine hold the ranks? Check cores and memory before starting any process.

Every rank is a fresh Python interpreter that imports torch: on a laptop, 64
of them start without complaint and then swap the machine to a halt. The
launcher warns when ranks outnumber cores (they then take turns, and timings
mean little) and refuses when their estimated memory exceeds what is free.
The warning names the line that asked for the ranks (in a notebook: the cell,
never its temporary file); a caller that oversubscribes on purpose, such as the
grader, launches inside :func:`expected_oversubscription` and gets no warning.
"""

from __future__ import annotations

import contextlib
import contextvars
import os
import sys
import warnings

# Resident size of one rank that imported torch and joined a gloo group: 223 MiB
# measured with torch 2.13 (CPU build) on Linux; GPU ranks also hold a CUDA context
# in host memory, so this is a floor.
RANK_MEMORY_BYTES = 230 * 2**20
SKIP_MEMORY_CHECK_ENV = "DPCOURSE_SKIP_MEMORY_CHECK"
PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep

_oversubscription_expected = contextvars.ContextVar("dpcourse_oversubscription_expected",
                                                    default=False)


class OversubscriptionWarning(RuntimeWarning):
    """More CPU ranks than cores: the run is slow and its timings say little."""


@contextlib.contextmanager
def expected_oversubscription():
    """Launch more CPU ranks than cores inside this block without a warning.

    For code that oversubscribes on purpose (the grader's odd world sizes): the
    person at the keyboard did not ask for those ranks, so a warning about them
    would only confuse. Warnings of other kinds are untouched.
    """
    token = _oversubscription_expected.set(True)
    try:
        yield
    finally:
        _oversubscription_expected.reset(token)


def _warn_at_caller(message: str, category: type[Warning]) -> None:
    """Warn at the first frame outside this package: the line that asked for the launch.

    A notebook cell is named the way IPython names it in tracebacks ("Cell In[3]"),
    not by the temporary file it was compiled from (a path with the kernel's pid).
    """
    frame = sys._getframe(1)
    while frame.f_back is not None and frame.f_code.co_filename.startswith(PACKAGE_DIR):
        frame = frame.f_back
    filename, lineno, glob = frame.f_code.co_filename, frame.f_lineno, frame.f_globals
    cell = _notebook_cell_name(filename)
    warnings.warn_explicit(message, category, cell or filename, lineno,
                           module=glob.get("__name__", "<unknown>"),
                           registry=glob.setdefault("__warningregistry__", {}),
                           module_globals=None if cell else glob)


def _notebook_cell_name(filename: str) -> str | None:
    """Return IPython's name for the cell compiled to ``filename`` ("Cell In[3]"), or None."""
    ipython = sys.modules.get("IPython")
    shell = ipython.get_ipython() if ipython is not None else None
    try:
        label = shell.compile.format_code_name(filename) if shell is not None else None
    except Exception:  # noqa: BLE001 - an IPython without it: show the file name
        return None
    return " ".join(label) if label else None


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

    The warning (an :class:`OversubscriptionWarning`, a RuntimeWarning) points at
    the first caller outside this package, and is not given inside
    :func:`expected_oversubscription`.

    Args:
        world_size: ranks about to start.
        backend: ``"gloo"`` (ranks compute on the cores) or ``"nccl"`` (on GPUs).

    Raises:
        RuntimeError: the ranks' estimated memory exceeds the available memory,
            unless the environment variable ``DPCOURSE_SKIP_MEMORY_CHECK=1`` is set.
    """
    cores = os.cpu_count() or 1
    if backend == "gloo" and world_size > cores and not _oversubscription_expected.get():
        _warn_at_caller(
            f"{world_size} ranks on {cores} CPU core(s): the ranks take turns on the cores, so "
            "the run is slower than with fewer ranks and its timings say little about scaling. "
            f"Use world_size <= {cores} unless many ranks is the point.",
            OversubscriptionWarning)
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
