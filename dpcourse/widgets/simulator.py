"""An ipywidgets simulator of a data-parallel step, driven by :mod:`dpcourse.costmodel`."""

from __future__ import annotations

import io

import ipywidgets as widgets

from dpcourse import costmodel as cm

WORLD_SIZES = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024]


def _log_slider(value, lo, hi, description, fmt=".3g"):
    return widgets.FloatLogSlider(value=value, base=10, min=lo, max=hi, step=0.05,
                                  description=description, readout_format=fmt,
                                  style={"description_width": "120px"},
                                  layout=widgets.Layout(width="420px"))


def efficiency_figure(curves: dict, world_size: int):
    """Draw predicted scaling efficiency against ranks; return a matplotlib Figure.

    Args:
        curves: ``{label: [StepPrediction per entry of WORLD_SIZES]}``.
        world_size: the current number of ranks (marked with a vertical line).
    """
    from matplotlib.figure import Figure

    from dpcourse.plots import plot_scaling

    fig = Figure(figsize=(6.0, 3.4))
    ax = fig.subplots()
    rows = [{"impl": label, "world_size": n, "efficiency": p.efficiency}
            for label, preds in curves.items() for n, p in zip(WORLD_SIZES, preds)]
    plot_scaling(rows, title="predicted scaling efficiency", ax=ax)
    ax.set_xscale("log", base=2)
    ax.set_xticks(WORLD_SIZES, [str(n) for n in WORLD_SIZES])
    ax.axvline(world_size, color="grey", lw=1, ls=":")
    return fig


class CostModelSimulator(widgets.VBox):
    """Change model size, dtype, ranks, link and compute; see step time and efficiency live.

    Args:
        model: an :class:`~dpcourse.costmodel.AlphaBeta` to start from (e.g. your fitted one);
            default: 50 GB/s links with 10 us per ring step.
        params, dtype, world_size, compute_ms, bucket_cap_mb, overlap, device_memory_gb:
            starting values of the controls.

    Attributes:
        prediction: the :class:`~dpcourse.costmodel.StepPrediction` for the current values.
        verdict: the :class:`~dpcourse.costmodel.DataParallelVerdict` for the current values.
        summary: ``HTML`` with the numbers; plot: ``Image`` (PNG) of efficiency vs ranks.
    """

    def __init__(self, model: cm.AlphaBeta | None = None, params: float = 7e9, dtype: str = "bf16",
                 world_size: int = 8, compute_ms: float = 200.0, bucket_cap_mb: float = 25.0,
                 overlap: bool = True, device_memory_gb: float = 80.0):
        model = model or cm.AlphaBeta(alpha=10e-6, beta=1 / 50e9)
        self.latency = model.latency
        self.params = _log_slider(params, 6, 12, "parameters", ".2e")
        self.dtype = widgets.Dropdown(options=["fp32", "bf16", "fp16"], value=dtype, description="dtype")
        self.world_size = widgets.SelectionSlider(options=WORLD_SIZES[1:], value=world_size,
                                                  description="ranks")
        self.bandwidth_gbs = _log_slider(model.bandwidth / 1e9, -2, 3, "bandwidth (GB/s)")
        self.alpha_us = _log_slider(max(model.alpha * 1e6, 0.01), -2, 4, "alpha (µs)")
        self.compute_ms = _log_slider(compute_ms, -1, 4, "compute (ms)")
        self.bucket_cap_mb = _log_slider(bucket_cap_mb, 0, 4, "bucket (MB)")
        self.overlap = widgets.Checkbox(value=overlap, description="overlap comm with backward")
        self.device_memory_gb = widgets.FloatSlider(value=device_memory_gb, min=8, max=192, step=8,
                                                    description="device GB")
        self.summary = widgets.HTML()
        self.plot = widgets.Image(format="png")
        controls = [self.params, self.dtype, self.world_size, self.bandwidth_gbs, self.alpha_us,
                    self.compute_ms, self.bucket_cap_mb, self.overlap, self.device_memory_gb]
        for c in controls:
            c.observe(lambda _: self.update(), names="value")
        super().__init__([widgets.HBox([widgets.VBox(controls), self.summary]), self.plot])
        self.update()

    def current_model(self) -> cm.AlphaBeta:
        """Return the :class:`~dpcourse.costmodel.AlphaBeta` the controls describe."""
        return cm.AlphaBeta(alpha=self.alpha_us.value * 1e-6, beta=1e-9 / self.bandwidth_gbs.value,
                            latency=self.latency)

    def update(self) -> None:
        """Recompute the prediction, the verdict, the summary and the plot."""
        model, n = self.current_model(), self.world_size.value
        grad = self.params.value * cm.dtype_bytes(self.dtype.value)
        compute = self.compute_ms.value / 1e3
        self.verdict = cm.data_parallel_limits(
            self.params.value, n, self.device_memory_gb.value * 1e9, model, compute,
            self.dtype.value, bucket_cap_mb=self.bucket_cap_mb.value, overlap=self.overlap.value)
        self.prediction = p = self.verdict.step
        traffic = cm.ring_bytes_per_rank(grad, n)
        rows = [("step time", f"{p.step_s * 1e3:.1f} ms"), ("compute", f"{p.compute_s * 1e3:.1f} ms"),
                ("all-reduce (sum of buckets)", f"{p.comm_s * 1e3:.1f} ms in {p.n_buckets} buckets"),
                ("exposed communication", f"{p.exposed_comm_s * 1e3:.1f} ms ({p.comm_share:.0%})"),
                ("scaling efficiency", f"<b>{p.efficiency:.0%}</b>"),
                ("sent per rank per step", f"{traffic / 1e9:.2f} GB"),
                ("memory per rank", f"{self.verdict.memory['total'] / 1e9:.1f} GB (no activations)")]
        table = "".join(f"<tr><td>{k}</td><td style='padding-left:12px'>{v}</td></tr>" for k, v in rows)
        verdict = ("<p style='color:#2a7d2a'>Data parallelism is enough here.</p>" if self.verdict.enough
                   else "".join(f"<p style='color:#b03a2e'>{r}</p>" for r in self.verdict.reasons))
        self.summary.value = f"<div class='costmodel-summary'><table>{table}</table>{verdict}</div>"
        curves = {label: cm.scaling_curve(WORLD_SIZES, grad, compute, model, self.bucket_cap_mb.value,
                                          overlap=flag)
                  for label, flag in (("overlap", True), ("no overlap", False))}
        fig = efficiency_figure(curves, n)
        buf = io.BytesIO()
        fig.savefig(buf, format="png", dpi=80)
        self.plot.value = buf.getvalue()
