"""A per-rank timeline of one training step: backward compute and each bucket's all-reduce.

Built from what a rank can return: :meth:`CommTrace.to_records` events and
``(label, t)`` marks such as ``"backward_start"`` / ``"backward_end"``. Seeing
the all-reduce bars start inside the backward bar is what "overlap" means.
"""

from __future__ import annotations

from collections import defaultdict

from dpcourse.plots import figure_axes


def spans_from_marks(marks) -> list[tuple[str, float, float]]:
    """Pair ``"<name>_start"``/``"<name>_end"`` marks into ``(name, start, end)`` spans.

    Repeated names (one per step) pair up in order; unmatched marks are dropped.

    Args:
        marks: ``(label, seconds)`` pairs, e.g. ``CommTrace.marks``.

    Returns:
        Spans sorted by start time.
    """
    open_: dict[str, list[float]] = defaultdict(list)
    spans = []
    for label, t in sorted(marks, key=lambda m: m[1]):
        if label.endswith("_start"):
            open_[label[: -len("_start")]].append(t)
        elif label.endswith("_end"):
            name = label[: -len("_end")]
            if open_[name]:
                spans.append((name, open_[name].pop(0), t))
    return sorted(spans, key=lambda s: s[1])


def _pack(events: list[dict]) -> dict[int, int]:
    """Give each event (sorted by start) a 1-based sub-row so that events on one row never overlap."""
    row_ends: list[float] = []
    rows = {}
    for i, e in enumerate(events):
        for r, end in enumerate(row_ends):
            if end <= e["start"]:
                row_ends[r] = e["end"]
                rows[i] = r + 1
                break
        else:
            row_ends.append(e["end"])
            rows[i] = len(row_ends)
    return rows


def plot_timeline(ranks: list[dict], *, ops: tuple[str, ...] | None = ("all_reduce",),
                  title: str = "", ax=None):
    """Draw a per-rank timeline: compute spans on one lane, each collective on another.

    Overlap shows at a glance: communication bars that sit under a compute bar ran
    while backward was still computing. Collectives in flight at the same time (async
    calls, drawn from issue to ``wait()``) are stacked in sub-rows of the comm lane.

    Args:
        ranks: one dict per rank with ``events`` (``CommTrace.to_records()``) and
            ``marks`` (``CommTrace.marks``, ``"<name>_start"``/``"<name>_end"`` pairs
            become compute spans) and/or ``spans`` (``(name, start, end)`` tuples).
        ops: which collective ops to draw (None: all); events never waited on are skipped.
        title: figure title.
        ax: draw into this Axes instead of a new figure.

    Returns:
        The matplotlib Figure.
    """
    fig, ax = figure_axes(ax, figsize=(8.0, 1.0 + 1.1 * len(ranks)))
    colors = {}
    palette = ["tab:blue", "tab:green", "tab:purple", "tab:brown", "tab:olive"]
    yticks, ylabels = [], []
    comm_drawn = False
    for rank, data in enumerate(ranks):
        base = (len(ranks) - 1 - rank) * 2.5
        spans = list(data.get("spans", [])) + spans_from_marks(data.get("marks", []))
        for name, start, end in spans:
            color = colors.setdefault(name, palette[len(colors) % len(palette)])
            ax.broken_barh([(start * 1e3, (end - start) * 1e3)], (base + 1.1, 0.8),
                           facecolors=color, alpha=0.8,
                           label=name if name not in ax.get_legend_handles_labels()[1] else None)
        events = sorted((x for x in data.get("events", [])
                         if (ops is None or x["op"] in ops) and x.get("end") is not None),
                        key=lambda x: x["start"])
        rows = _pack(events)
        height = 0.8 / max(rows.values(), default=0) if rows else 0.8
        for i, e in enumerate(events):
            # Collectives in flight at the same time get their own sub-row of the lane.
            y = base + 0.1 + (max(rows.values()) - rows[i]) * height
            ax.broken_barh([(e["start"] * 1e3, max(e["end"] - e["start"], 1e-6) * 1e3)],
                           (y, height * 0.9), facecolors="tab:orange" if i % 2 == 0 else "tab:red",
                           edgecolors="black", linewidth=0.3,
                           label=None if comm_drawn else "collective (" + ", ".join(ops or ["all"]) + ")")
            comm_drawn = True
        yticks += [base + 0.5, base + 1.5]
        ylabels += [f"rank {rank} comm", f"rank {rank} compute"]
    ax.set_yticks(yticks, ylabels)
    ax.set_xlabel("time since trace start (ms)")
    ax.set_title(title)
    ax.grid(axis="x", alpha=0.3)
    handles, labels = ax.get_legend_handles_labels()
    if handles:
        ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8)
    fig.tight_layout()
    return fig
