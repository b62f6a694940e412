"""An ipywidgets simulator of a data-parallel step, driven by :mod:`dpcourse.costmodel`."""

from __future__ import annotations

import io

import ipywidgets as widgets

from dpcourse import costmodel as cm

WORLD_SIZES = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024]


# Preset choices rather than free sliders: a slider snaps to its step grid, which
# would turn 7e9 into 7.08e9 and break the 24.5 GB the lesson computes by hand.
PARAMS = {"125M": 125e6, "350M": 350e6, "1.3B": 1.3e9, "7B": 7e9, "13B": 13e9, "30B": 30e9,
          "70B": 70e9, "175B": 175e9, "1T": 1e12}
BANDWIDTH_GBS = [0.1, 0.3, 1, 3, 10, 25, 50, 100, 200, 500]
ALPHA_US = [0.1, 1, 3, 10, 30, 100, 1000]
COMPUTE_MS = [1, 3, 10, 30, 100, 200, 500, 1000, 3000, 10000]
BUCKET_MB = [1, 5, 10, 25, 50, 100, 250, 1000]
DEVICE_GB = [16, 24, 40, 48, 80, 94, 141, 192]


def _slider(description: str, choices, value, unit: str = ""):
    """A slider over sorted ``choices`` (``value`` is added if missing) labelled with ``unit``."""
    if isinstance(choices, dict):
        options = list(choices.items())
        if value not in choices.values():
            options.append((f"{value:.3g}", value))
    else:
        values = sorted(set(choices) | {value})
        options = [(f"{v:.3g}{unit}", v) for v in values]
    options.sort(key=lambda kv: kv[1])
    return widgets.SelectionSlider(options=options, value=value, description=description,
                                   style={"description_width": "110px"},
                                   layout=widgets.Layout(width="390px"))


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
        if not 0 < model.beta:
            raise ValueError("the simulator needs a finite bandwidth (model.beta > 0).")
        self.latency = model.latency
        self.params = _slider("parameters", PARAMS, params)
        self.dtype = widgets.Dropdown(options=["fp32", "bf16", "fp16"], value=dtype,
                                      description="dtype",
                                      style={"description_width": "110px"},
                                      layout=widgets.Layout(width="230px"))
        self.world_size = _slider("ranks", WORLD_SIZES[1:], world_size)
        self.bandwidth_gbs = _slider("bandwidth", BANDWIDTH_GBS,
                                     float(f"{model.bandwidth / 1e9:.3g}"), " GB/s")
        self.alpha_us = _slider("alpha", ALPHA_US, float(f"{model.alpha * 1e6:.3g}"), " µs")
        self.compute_ms = _slider("compute", COMPUTE_MS, compute_ms, " ms")
        self.bucket_cap_mb = _slider("bucket", BUCKET_MB, bucket_cap_mb, " MB")
        self.overlap = widgets.Checkbox(value=overlap, description="overlap comm with backward",
                                        indent=True, style={"description_width": "initial"})
        self.device_memory_gb = _slider("device memory", DEVICE_GB, device_memory_gb, " GB")
        self.summary = widgets.HTML()
        self.plot = widgets.Image(format="png", layout=widgets.Layout(width="480px"))
        controls = [self.params, self.dtype, self.world_size, self.bandwidth_gbs, self.alpha_us,
                    self.compute_ms, self.bucket_cap_mb, self.overlap, self.device_memory_gb]
        for c in controls:
            c.observe(lambda _: self.update(), names="value")
        # Fixed-width controls: otherwise the summary squeezes them and hides the readouts.
        panel = widgets.VBox(controls, layout=widgets.Layout(min_width="400px", flex="0 0 400px"))
        super().__init__([widgets.HBox([panel, self.summary]), self.plot])
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
        self.prediction = self.verdict.step
        self.summary.value = summary_html(self.verdict, cm.ring_bytes_per_rank(grad, n))
        curves = {label: cm.scaling_curve(WORLD_SIZES, grad, compute, model,
                                          self.bucket_cap_mb.value, overlap=flag)
                  for label, flag in (("overlap", True), ("no overlap", False))}
        buf = io.BytesIO()
        efficiency_figure(curves, n).savefig(buf, format="png", dpi=80)
        self.plot.value = buf.getvalue()


def summary_html(verdict: cm.DataParallelVerdict, sent_bytes: float) -> str:
    """Lay out a verdict's numbers (and its reasons, if any) as an HTML table."""
    p = verdict.step
    rows = [("step time", f"{p.step_s * 1e3:.1f} ms"),
            ("compute", f"{p.compute_s * 1e3:.1f} ms"),
            ("all-reduce (sum of buckets)", f"{p.comm_s * 1e3:.1f} ms in {p.n_buckets} buckets"),
            ("exposed communication", f"{p.exposed_comm_s * 1e3:.1f} ms ({p.comm_share:.0%})"),
            ("scaling efficiency", f"<b>{p.efficiency:.0%}</b>"),
            ("sent per rank per step", f"{sent_bytes / 1e9:.2f} GB"),
            ("memory per rank", f"{verdict.memory['total'] / 1e9:.1f} GB (no activations)")]
    table = "".join(f"<tr><td>{k}</td><td style='padding-left:12px'>{v}</td></tr>"
                    for k, v in rows)
    if verdict.enough:
        notes = "<p style='color:#2a7d2a'>Data parallelism is enough here.</p>"
    else:
        notes = "".join(f"<p style='color:#b03a2e'>{r}</p>" for r in verdict.reasons)
    return f"<div class='costmodel-summary'><table>{table}</table>{notes}</div>"
