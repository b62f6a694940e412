"""The rows a benchmark returns: typed records that also read like the dicts of a table.

Every row is a dataclass, so its fields are named in one place and a typo is an
error, not a silent ``None``. Each also behaves as a read-only mapping
(``row["median_s"]``, ``dict(row)``, ``format_table(rows)``), which is how
notebooks, tables, plots and the JSON files in ``docs/results/`` read them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any


class FieldMapping(Mapping):
    """Mixin for a dataclass: read its fields by name like a dict's keys."""

    def __getitem__(self, key: str) -> Any:
        if key not in self._names():
            raise KeyError(key)
        return getattr(self, key)

    def __iter__(self) -> Iterator[str]:
        return iter(self._names())

    def __len__(self) -> int:
        return len(self._names())

    def _names(self) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(self))  # type: ignore[arg-type]


@dataclass(eq=True)
class Timing(FieldMapping):
    """Statistics of a candidate's timed trials (seconds).

    Attributes:
        median_s: the median, the number to quote.
        min_s, max_s: the extremes.
        p25_s, p75_s: the quartiles; the interquartile range is the spread to quote.
        trials: how many timed trials.
    """

    median_s: float
    min_s: float
    max_s: float
    p25_s: float
    p75_s: float
    trials: int


@dataclass(eq=True)
class AllReduceRow(Timing):
    """One all-reduce implementation at one message size (see :func:`~dpcourse.bench.allreduce_sweep`).

    Attributes:
        impl: implementation name.
        nbytes, numel, dtype: the message.
        world_size, backend, device: where it ran.
        latency_us: the median in microseconds.
        algbw: ``nbytes / median_s`` in bytes/s.
        busbw: ``algbw * 2 (N - 1) / N``, what each rank's link carries.
        vs_library: the library's median / this median (None without a library row).
        calls_per_trial: back-to-back calls each trial timed (its time divided by them).
    """

    impl: str = ""
    nbytes: int = 0
    numel: int = 0
    dtype: str = ""
    world_size: int = 1
    backend: str = ""
    device: str = ""
    latency_us: float = 0.0
    algbw: float = 0.0
    busbw: float = 0.0
    vs_library: float | None = None
    calls_per_trial: int = 1


@dataclass(eq=True)
class StepRow(Timing):
    """One data-parallel variant's training step (see :func:`~dpcourse.bench.ddp_step_times`).

    Attributes:
        variant: ``local``, ``naive``, ``bucketed``, ``overlapped``, ``torch_ddp``, or a
            sharded one: ``zero1``, ``zero2``, ``fsdp``, ``torch_fsdp``.
        bucket_cap_mb: the bucket cap it ran with.
        n_buckets: its number of buckets (None for variants without buckets or torch's).
        world_size, backend, device: where it ran.
        config, params, batch_size, seq_len, amp: the model and batch.
        tokens_per_s: tokens processed per second over all ranks.
        vs_torch_ddp: this median / torch DDP's (None without torch DDP in the run).
        efficiency: local median / this median (None without ``local``).
        peak_bytes_per_rank: on GPUs, for ``torch_ddp`` and the sharded variants, each rank's
            peak ``torch.cuda.max_memory_allocated`` over a few steps of this variant alone
            (see :func:`dpcourse.bench.sharded.measure_memory`); else None.
    """

    variant: str = ""
    bucket_cap_mb: float = 0.0
    n_buckets: int | None = None
    world_size: int = 1
    backend: str = ""
    device: str = ""
    config: str = ""
    params: int = 0
    batch_size: int = 0
    seq_len: int = 0
    amp: str = ""
    tokens_per_s: float = 0.0
    vs_torch_ddp: float | None = None
    efficiency: float | None = None
    peak_bytes_per_rank: list[int] | None = None


@dataclass(eq=True)
class BucketStepRow(Timing):
    """One SGD step of the MLP at one bucket cap (see :func:`~dpcourse.bench.ddp_step_sweep`).

    Attributes:
        variant: ``local``, ``bucketed`` or ``overlapped``.
        bucket_cap_mb: the cap (None for ``local``).
        n_buckets: number of buckets.
        bucket_bytes: bucket sizes in launch order.
        grad_bytes: gradient bytes per step.
        world_size: number of ranks.
    """

    variant: str = ""
    bucket_cap_mb: float | None = None
    n_buckets: int = 0
    bucket_bytes: list[int] = dataclasses.field(default_factory=list)
    grad_bytes: int = 0
    world_size: int = 1


def to_json(obj: Any) -> Any:
    """``json.dump``'s ``default=``: records become dicts, anything else its ``str``."""
    if isinstance(obj, FieldMapping):
        return dict(obj)
    return str(obj)
