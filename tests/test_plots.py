"""Plots draw from the records ranks return, with the artists a learner should see."""

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402

from dpcourse import formatting, plots, timeline  # noqa: E402


@pytest.fixture(autouse=True)
def _close_figures():
    yield
    plt.close("all")


def _bandwidth_rows():
    rows = []
    for impl, speed in (("ring", 1e9), ("library", 2e9)):
        for k in range(10, 22, 2):
            n = 2 ** k
            rows.append(dict(impl=impl, nbytes=n, seconds=1e-5 + n / speed))
    return rows


def test_bandwidth_one_line_per_impl_and_busbw_factor():
    rows = _bandwidth_rows()
    fig = plots.plot_bandwidth(rows, world_size=4)
    ax = fig.axes[0]
    lines = {ln.get_label(): ln for ln in ax.get_lines()}
    assert set(lines) == {"ring", "library"}
    assert "bus bandwidth" in ax.get_ylabel()
    # largest message of "library": busbw = nbytes/t * 2(N-1)/N, in GB/s
    r = max((r for r in rows if r["impl"] == "library"), key=lambda r: r["nbytes"])
    expected = r["nbytes"] / r["seconds"] * 1.5 / 1e9
    assert lines["library"].get_ydata()[-1] == pytest.approx(expected)
    assert ax.get_xscale() == "log"


def test_bandwidth_time_metric_and_precomputed_values():
    rows = [dict(impl="ring", nbytes=1024, median_s=0.5, busbw=3e9)]
    ax = plots.plot_bandwidth(rows, metric="busbw").axes[0]
    assert ax.get_lines()[0].get_ydata()[0] == pytest.approx(3.0)
    ax = plots.plot_bandwidth(rows, metric="time").axes[0]
    assert ax.get_lines()[0].get_ydata()[0] == pytest.approx(0.5)
    assert ax.get_yscale() == "log"


def test_bandwidth_rejects_bad_metric_and_missing_world_size():
    with pytest.raises(ValueError, match="metric"):
        plots.plot_bandwidth(_bandwidth_rows(), metric="speed")
    with pytest.raises(ValueError, match="world_size"):
        plots.plot_bandwidth(_bandwidth_rows())


def test_bucket_sweep_lines_and_bucket_counts():
    rows = [dict(impl=impl, bucket_cap_mb=mb, seconds=0.01 + 0.001 * mb, n_buckets=nb)
            for impl in ("bucketed", "overlapped") for mb, nb in ((0, 40), (0.25, 10), (1, 3), (25, 1))]
    ax = plots.plot_bucket_sweep(rows).axes[0]
    assert [ln.get_label() for ln in ax.get_lines()] == ["bucketed", "overlapped"]
    assert list(ax.get_lines()[0].get_xdata()) == [0, 0.25, 1, 25]
    assert ax.get_lines()[0].get_ydata()[-1] == pytest.approx(35.0)  # ms
    assert sorted(t.get_text() for t in ax.texts) == sorted(["40", "10", "3", "1"] * 2)
    assert ax.get_xscale() == "symlog"
    assert "step time" in ax.get_ylabel()


def test_spans_from_marks_pairs_in_order():
    marks = [("backward_start", 0.0), ("backward_end", 1.0), ("x", 1.5),
             ("backward_start", 2.0), ("backward_end", 3.0), ("forward_end", 4.0)]
    assert timeline.spans_from_marks(marks) == [("backward", 0.0, 1.0), ("backward", 2.0, 3.0)]


def test_timeline_draws_compute_and_each_waited_collective_per_rank():
    ranks = []
    for r in range(2):
        events = [dict(op="all_reduce", nbytes=100, start=0.1 * i, end=0.1 * i + 0.05,
                       async_op=True, peer=None) for i in range(3)]
        events.append(dict(op="broadcast", nbytes=4, start=0.0, end=0.01, async_op=False, peer=None))
        events.append(dict(op="all_reduce", nbytes=4, start=0.5, end=None, async_op=True, peer=None))
        ranks.append(dict(events=events, marks=[("backward_start", 0.0), ("backward_end", 0.25)]))
    ax = timeline.plot_timeline(ranks).axes[0]
    # per rank: 1 compute span + 3 waited all-reduces (broadcast filtered, unwaited skipped)
    assert len(ax.collections) == 2 * (1 + 3)
    labels = [t.get_text() for t in ax.get_yticklabels()]
    assert labels == ["rank 0 comm", "rank 0 compute", "rank 1 comm", "rank 1 compute"]
    legend = [t.get_text() for t in ax.get_legend().get_texts()]
    assert "backward" in legend and any("all_reduce" in t for t in legend)


def test_timeline_accepts_explicit_spans_and_all_ops():
    ranks = [dict(spans=[("forward", 0.0, 0.1), ("backward", 0.1, 0.3)],
                  events=[dict(op="broadcast", nbytes=4, start=0.0, end=0.01)])]
    ax = timeline.plot_timeline(ranks, ops=None).axes[0]
    assert len(ax.collections) == 3


def test_scaling_efficiency_from_throughput():
    rows = [dict(world_size=n, throughput=100.0 * n * eff) for n, eff in ((1, 1.0), (2, 0.9), (4, 0.5))]
    ax = plots.plot_scaling(rows).axes[0]
    measured, ideal = ax.get_lines()
    assert list(measured.get_ydata()) == pytest.approx([100, 90, 50])
    assert ideal.get_label() == "ideal" and set(ideal.get_ydata()) == {100}
    assert "efficiency" in ax.get_ylabel()


def test_scaling_uses_given_efficiency_per_series():
    rows = [dict(impl=i, world_size=n, efficiency=e) for i in ("a", "b") for n, e in ((1, 1.0), (8, 0.7))]
    ax = plots.plot_scaling(rows).axes[0]
    assert [ln.get_label() for ln in ax.get_lines()] == ["a", "b", "ideal"]
    assert ax.get_lines()[1].get_ydata()[-1] == pytest.approx(70)


def test_curves_and_memory_bars():
    ax = plots.plot_curves({"ddp": [1.0, 0.5], "naive": ([0, 1], [0.0, 1e-7])}, logy=True).axes[0]
    assert [ln.get_label() for ln in ax.get_lines()] == ["ddp", "naive"]
    assert ax.get_lines()[1].get_ydata()[0] > 0  # zero clipped onto the log axis
    assert any("zeros" in t.get_text() for t in ax.texts)  # ... and the reader is told
    rows = [dict(rank=r, weights=2**20, grads=2**20, optimizer=2**21) for r in range(2)]
    ax = plots.plot_memory_per_rank(rows).axes[0]
    assert len(ax.patches) == 2 * 3
    assert max(p.get_y() + p.get_height() for p in ax.patches) == pytest.approx(4.0)


def test_format_table_and_bytes():
    text = formatting.format_table([dict(op="all_reduce", nbytes=4096, ms=1.23456)])
    header, rule, row = text.splitlines()
    assert header.split() == ["op", "nbytes", "ms"]
    assert row.split() == ["all_reduce", "4096", "1.235"]
    assert formatting.format_bytes(4 * 2**20) == "4.0 MiB"
    assert formatting.format_bytes(12) == "12 B"
    assert formatting.format_seconds(250e-6) == "250 µs"
    assert formatting.format_seconds(0.0031) == "3.1 ms"
    assert formatting.format_seconds(2.0) == "2.0 s"


def test_timeline_stacks_collectives_in_flight_together():
    events = [dict(op="all_reduce", nbytes=8, start=0.1 * i, end=1.0, async_op=True) for i in range(3)]
    events.append(dict(op="all_reduce", nbytes=8, start=1.5, end=1.6, async_op=False))
    ax = timeline.plot_timeline([dict(events=events)]).axes[0]
    ys = [c.get_paths()[0].get_extents().y0 for c in ax.collections]
    assert len(set(round(y, 6) for y in ys[:3])) == 3  # three overlapping calls, three sub-rows
    assert timeline._pack(sorted(events, key=lambda e: e["start"])) == {0: 1, 1: 2, 2: 3, 3: 1}
