"""Figures for the lessons and the benchmarks, drawn from plain records.

Every function takes what a rank can return from :func:`dpcourse.run` (lists of
dicts) and returns a matplotlib ``Figure``, so the same data can be plotted in a
notebook, saved for the docs, or checked in a test with the Agg backend. The
per-rank timeline of CommTrace events is in :mod:`dpcourse.timeline`; text
tables are in :mod:`dpcourse.formatting`.
"""

from __future__ import annotations

import math
from collections import defaultdict

from dpcourse.costmodel.alphabeta import bus_factor
from dpcourse.formatting import MiB, format_bytes, format_seconds

TIME_KEYS = ("seconds", "median_s", "time_s", "median", "time")


def figure_axes(ax=None, figsize=(6.4, 4.0)):
    """Return ``(fig, ax)``: the given axes and their figure, or a new figure of ``figsize``."""
    import matplotlib.pyplot as plt

    if ax is not None:
        return ax.figure, ax
    fig, ax = plt.subplots(figsize=figsize)
    return fig, ax


def _finish(fig, ax, title: str, legend: bool = True):
    """Title, light grid, legend, tight layout: how every figure here ends."""
    ax.set_title(title)
    ax.grid(alpha=0.3)
    if legend:
        ax.legend()
    fig.tight_layout()
    return fig


def _time_of(row: dict, time_key: str | None) -> float:
    if time_key is not None:
        return float(row[time_key])
    for key in TIME_KEYS:
        if key in row:
            return float(row[key])
    raise KeyError(f"record {row} has no time: give it one of {TIME_KEYS} or pass time_key=.")


def _group(rows, key: str) -> dict:
    groups: dict = defaultdict(list)
    for row in rows:
        groups[row.get(key, "")].append(row)
    return groups


def plot_curves(series: dict, *, xlabel: str = "step", ylabel: str = "", title: str = "",
                logy: bool = False, ax=None):
    """Draw one line per named series (loss curves, parameter differences per step).

    Args:
        series: ``{label: list of y values}`` (x is the index) or ``{label: (xs, ys)}``.
        xlabel, ylabel, title: axis labels and title.
        logy: use a log y axis (for differences that span orders of magnitude).
        ax: draw into this Axes instead of a new figure.

    Returns:
        The matplotlib Figure.
    """
    fig, ax = figure_axes(ax)
    styles = ["-", "--", ":", "-."]
    for i, (label, ys) in enumerate(series.items()):
        xs, ys = ys if isinstance(ys, tuple) else (range(len(ys)), ys)
        # Zeros cannot sit on a log axis: show them at the bottom as tiny values.
        ys = [max(float(y), 1e-12) for y in ys] if logy else list(ys)
        ax.plot(list(xs), ys, styles[i % len(styles)], marker="o", ms=3, label=str(label))
    if logy:
        ax.set_yscale("log")
        if any(float(y) == 0 for ys in series.values() for y in (ys[1] if isinstance(ys, tuple) else ys)):
            ax.text(0.01, 0.01, "exact zeros are drawn at 1e-12", transform=ax.transAxes, fontsize=8,
                    color="gray", va="bottom")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    return _finish(fig, ax, title)


def plot_bandwidth(rows: list[dict], *, world_size: int | None = None, metric: str = "busbw",
                   series_key: str = "impl", time_key: str | None = None, factor: float | None = None,
                   title: str = "", ax=None):
    """Draw time or bandwidth against message size, one line per implementation.

    Algorithm bandwidth is ``nbytes / time``. Bus bandwidth multiplies it by the
    bytes each rank must move per byte of message (``2(N-1)/N`` for all-reduce),
    so it can be compared with the link's speed whatever N is.

    Args:
        rows: records with ``nbytes``, a time in seconds (``seconds`` or ``median_s``...)
            and a series label under ``series_key``; may carry ``algbw``/``busbw``
            (bytes/s) and ``world_size`` already.
        world_size: N for the bus-bandwidth factor when rows don't carry ``busbw``.
        metric: ``"busbw"``, ``"algbw"`` (GB/s on the y axis) or ``"time"`` (seconds, log).
        series_key: key naming the line a record belongs to (e.g. ``"ring"``, ``"library"``).
        time_key: key of the time, if not one of the usual names.
        factor: bus-bandwidth factor; default ``2(N-1)/N`` (all-reduce).
        title: figure title.
        ax: draw into this Axes instead of a new figure.

    Returns:
        The matplotlib Figure.
    """
    if metric not in ("busbw", "algbw", "time"):
        raise ValueError(f"metric must be 'busbw', 'algbw' or 'time', got {metric!r}.")
    fig, ax = figure_axes(ax)
    for label, group in _group(rows, series_key).items():
        group = sorted(group, key=lambda r: r["nbytes"])
        xs, ys = [], []
        for r in group:
            t = _time_of(r, time_key)
            if metric == "time":
                y = t
            elif metric in r:
                y = float(r[metric]) / 1e9
            else:
                n = r.get("world_size", world_size)
                if metric == "busbw" and factor is None and n is None:
                    raise ValueError("bus bandwidth needs world_size= (or rows with 'world_size').")
                f = 1.0 if metric == "algbw" else (factor if factor is not None else bus_factor(n))
                y = r["nbytes"] / t * f / 1e9 if t > 0 else float("nan")
            xs.append(r["nbytes"])
            ys.append(y)
        ax.plot(xs, ys, marker="o", ms=4, label=str(label))
    ax.set_xscale("log", base=2)
    if metric == "time":
        from matplotlib.ticker import FuncFormatter, LogLocator

        ax.set_yscale("log")
        # 1-2-5 ticks: a sweep often spans less than a decade of time.
        ax.yaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
        ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: format_seconds(v)))
        ax.yaxis.set_minor_formatter(FuncFormatter(lambda v, _: ""))
        ax.set_ylabel("time per call")
    else:
        ax.set_ylabel({"busbw": "bus bandwidth (GB/s)", "algbw": "algorithm bandwidth (GB/s)"}[metric])
    ticks = [r["nbytes"] for r in rows]
    if ticks:
        lo, hi = min(ticks), max(ticks)
        marks = [2 ** k for k in range(int(math.log2(max(lo, 1))), int(math.log2(max(hi, 1))) + 1, 2)]
        ax.set_xticks(marks, [format_bytes(m) for m in marks], rotation=30)
    ax.set_xlabel("message size")
    return _finish(fig, ax, title)


def plot_bucket_sweep(rows: list[dict], *, x: str = "bucket_cap_mb", series_key: str = "impl",
                      time_key: str | None = None, count_key: str | None = "n_buckets",
                      title: str = "", ax=None):
    """Draw step time against bucket size, one line per implementation.

    Args:
        rows: records with ``x`` (bucket size in MB), a time in seconds, optionally a
            series label under ``series_key`` and a bucket count under ``count_key``
            (written next to each point).
        x: key of the bucket size.
        series_key: key naming the line a record belongs to.
        time_key: key of the step time, if not one of the usual names.
        count_key: key of the number of buckets to annotate; None to skip.
        title: figure title.
        ax: draw into this Axes instead of a new figure.

    Returns:
        The matplotlib Figure.
    """
    fig, ax = figure_axes(ax)
    for label, group in _group(rows, series_key).items():
        group = sorted(group, key=lambda r: r[x])
        xs = [r[x] for r in group]
        ys = [_time_of(r, time_key) * 1e3 for r in group]
        ax.plot(xs, ys, marker="o", label=str(label) if label != "" else None)
        for r, xv, yv in zip(group, xs, ys):
            if count_key and count_key in r:
                ax.annotate(str(r[count_key]), (xv, yv), textcoords="offset points",
                            xytext=(0, 6), ha="center", fontsize=8)
    positive = [r[x] for r in rows if r[x] > 0]
    if positive and max(positive) / min(positive) > 20:
        # symlog keeps bucket_cap_mb=0 (one bucket per parameter) on the axis.
        ax.set_xscale("symlog", linthresh=min(positive))
    ax.set_xlabel("bucket size (MB)")
    ax.set_ylabel("step time (ms)")
    labelled = any(h.get_label() and not h.get_label().startswith("_") for h in ax.get_lines())
    return _finish(fig, ax, title + (" (numbers: buckets per step)" if count_key and any(
        count_key in r for r in rows) else ""), legend=labelled)


def plot_scaling(rows: list[dict], *, x: str = "world_size", throughput_key: str = "throughput",
                 series_key: str = "impl", title: str = "", ax=None):
    """Draw scaling efficiency against the number of ranks, with the ideal line at 100 %.

    Efficiency at N ranks is ``throughput(N) / (N * throughput(1 rank))`` per series,
    or the record's own ``efficiency`` (a fraction) when present.

    Args:
        rows: records with ``x`` (ranks) and ``throughput_key`` (samples/s) or ``efficiency``.
        x: key of the number of ranks.
        throughput_key: key of the throughput.
        series_key: key naming the line a record belongs to.
        title: figure title.
        ax: draw into this Axes instead of a new figure.

    Returns:
        The matplotlib Figure.
    """
    fig, ax = figure_axes(ax)
    all_n = set()
    for label, group in _group(rows, series_key).items():
        group = sorted(group, key=lambda r: r[x])
        if all("efficiency" in r for r in group):
            eff = [float(r["efficiency"]) for r in group]
        else:
            base = group[0]
            per_rank = float(base[throughput_key]) / base[x]
            eff = [float(r[throughput_key]) / (r[x] * per_rank) for r in group]
        ns = [r[x] for r in group]
        all_n.update(ns)
        ax.plot(ns, [100 * e for e in eff], marker="o", label=str(label) if label != "" else "measured")
    if all_n:
        ax.plot(sorted(all_n), [100] * len(all_n), "k--", lw=1, label="ideal")
        ax.set_xticks(sorted(all_n))
    ax.set_ylim(0, 110)
    ax.set_xlabel("ranks")
    ax.set_ylabel("scaling efficiency (%)")
    return _finish(fig, ax, title)


def plot_memory_per_rank(rows: list[dict], *, parts=("weights", "grads", "optimizer"),
                         title: str = "", ax=None):
    """Draw a stacked bar per rank of what it holds (bytes per part), in MiB.

    Args:
        rows: one record per rank with ``rank`` and a byte count per entry of ``parts``.
        parts: keys stacked from the bottom.
        title: figure title.
        ax: draw into this Axes instead of a new figure.

    Returns:
        The matplotlib Figure.
    """
    fig, ax = figure_axes(ax)
    labels = [f"rank {r.get('rank', i)}" for i, r in enumerate(rows)]
    bottom = [0.0] * len(rows)
    for part in parts:
        vals = [r.get(part, 0) / MiB for r in rows]
        ax.bar(labels, vals, bottom=bottom, label=part)
        bottom = [b + v for b, v in zip(bottom, vals)]
    ax.set_ylabel("MiB held by the rank")
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    return fig
