"""Peak tensor memory of a block of CPU code, from the allocator's own records.

On GPUs ``torch.cuda.max_memory_allocated`` answers "how much memory did this
need at most". On the CPU there is no such counter, but torch's CPU allocator
reports every allocation and every release (a storage resize included) to the
profiler when ``profile_memory=True``. Replaying those records in time order
gives the bytes alive at every moment: the peak is counted by the allocator,
not by the code being measured.
"""

from __future__ import annotations

import contextlib
import os
import sys

from torch.profiler import ProfilerActivity, profile


@contextlib.contextmanager
def _quiet_stderr():
    """Silence file descriptor 2 for the block: the profiler logs a line with the time and
    the process id when it starts and stops, noise in a notebook's output."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 2)
            yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


class CPUMemoryPeak:
    """Measure the most tensor bytes alive at once inside the block, above those alive at entry.

    Only allocations made by the calling thread are seen (a backend's worker
    threads are not). Use::

        with CPUMemoryPeak() as mem:
            model = FullyShardedDataParallel(meta_model)
        mem.peak_bytes, mem.end_bytes

    Attributes:
        peak_bytes: the highest sum of bytes allocated minus bytes released, at any moment.
        end_bytes: that sum when the block ended (what the block left alive).
    """

    def __enter__(self) -> CPUMemoryPeak:
        self._prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
        with _quiet_stderr():  # only while the profiler starts: the block's errors still show
            self._prof.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        with _quiet_stderr():
            self._prof.__exit__(*exc)
        from torch._C._profiler import _ExtraFields_Allocation

        results = self._prof.profiler.kineto_results if self._prof.profiler else None
        if results is None:
            raise RuntimeError("the profiler returned no records to measure memory from.")
        events, stack = [], list(results.experimental_event_tree())
        while stack:
            node = stack.pop()
            fields = node.extra_fields
            if isinstance(fields, _ExtraFields_Allocation) and fields.device.type == "cpu":
                events.append((node.start_time_ns, fields.alloc_size))
            stack.extend(node.children)
        live = self.peak_bytes = 0
        for _, nbytes in sorted(events):
            live += nbytes
            self.peak_bytes = max(self.peak_bytes, live)
        self.end_bytes = live
