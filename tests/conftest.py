"""Shared fixtures: leak checks for multi-process tests, and GPU-count skipping.

* ``no_leaked_processes``: fails a test that leaves a child process of the test
  process behind (a rank that outlived its launch).
* ``@pytest.mark.gpu`` / ``@pytest.mark.gpu(2)``: skip unless that many CUDA GPUs
  are visible (default 1).
"""

from __future__ import annotations

import os

import pytest
from proc_helpers import describe, live_children, wait_gone


@pytest.fixture
def no_leaked_processes():
    """Fail the test if it leaves child processes behind (e.g. a rank that was not stopped)."""
    before = {p.pid for p in live_children()}
    yield
    new = [p for p in live_children() if p.pid not in before]
    left = wait_gone([p.pid for p in new], timeout=5.0)
    assert not left, "processes left behind by the test:\n" + describe(
        [p for p in new if p.pid in left])


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "gpu(n=1): needs n CUDA GPUs; skipped when fewer are visible")


def _gpu_count() -> int:
    if os.environ.get("CUDA_VISIBLE_DEVICES", None) == "":
        return 0
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def pytest_runtest_setup(item):
    marker = item.get_closest_marker("gpu")
    if marker is not None:
        need = int(marker.args[0]) if marker.args else int(marker.kwargs.get("n", 1))
        have = _gpu_count()
        if have < need:
            pytest.skip(f"needs {need} CUDA GPU(s), {have} visible")
