"""A stepper through ring all-reduce: who sends which chunk, and what each rank holds."""

from __future__ import annotations

import html

import ipywidgets as widgets
import numpy as np

from dpcourse.widgets.ringsim import RingFrame, simulate_ring

REDUCED, PARTIAL, OWN = "#a8dba8", "#ffe08a", "#f4f4f4"  # cell colours by how summed a chunk is


def ring_inputs(world_size: int, seed: int = 0) -> list[np.ndarray]:
    """Return small integer inputs (one value per chunk) that are easy to add up by eye."""
    rng = np.random.default_rng(seed)
    return [rng.integers(1, 10, size=world_size).astype(np.int64) for _ in range(world_size)]


def describe_frame(frame: RingFrame) -> str:
    """Say in one sentence what happened in ``frame``'s step."""
    n = len(frame.data)
    if frame.phase == "start":
        return (f"Start: each of the {n} ranks holds its own gradient, cut into {n} chunks. "
                "Nothing has been sent yet.")
    verb = ("adds it to its own copy" if frame.phase == "reduce_scatter"
            else "overwrites its copy with it")
    name = "Reduce-scatter" if frame.phase == "reduce_scatter" else "All-gather"
    return (f"{name} step {frame.step + 1} of {n - 1}: every rank sends one chunk to its right "
            f"neighbour, receives one from its left neighbour and {verb}.")


def render_frame(frame: RingFrame) -> str:
    """Draw ``frame`` as an HTML table: one row per rank, one column per chunk.

    Cell colour: green = sum over all ranks (reduced), yellow = partial sum, grey =
    the rank's own input. A chunk being sent has a blue outline and ``→``, the one
    being received an orange outline and ``←``.
    """
    n = len(frame.data)
    sent = {(m.src, m.chunk) for m in frame.messages}
    received = {(m.dst, m.chunk) for m in frame.messages}
    head = "".join(f"<th style='padding:2px 8px'>chunk {c}</th>" for c in range(n))
    rows = []
    for r in range(n):
        cells = []
        for c in range(n):
            who = frame.contributors[r][c]
            colour = REDUCED if len(who) == n else PARTIAL if len(who) > 1 else OWN
            border = ("2px solid #1f6fd1" if (r, c) in sent
                      else "2px solid #e07b00" if (r, c) in received else "1px solid #bbb")
            mark = (" →" if (r, c) in sent else "") + (" ←" if (r, c) in received else "")
            value = " ".join(str(v) for v in frame.chunk(r, c).tolist())
            label = "Σ all" if len(who) == n else "+".join(f"r{x}" for x in sorted(who))
            cells.append(f"<td class='ring-cell' style='background:{colour};border:{border};"
                         f"padding:2px 8px;text-align:center'><b>{html.escape(value)}</b>{mark}"
                         f"<br><small>{label}</small></td>")
        rows.append(f"<tr><th style='padding:2px 8px'>rank {r}</th>{''.join(cells)}</tr>")
    msgs = "; ".join(f"rank {m.src} → rank {m.dst}: chunk {m.chunk}" for m in frame.messages)
    legend = (f"<small><span style='background:{REDUCED}'>&nbsp;sum over all ranks&nbsp;</span> "
              f"<span style='background:{PARTIAL}'>&nbsp;partial sum&nbsp;</span> "
              f"<span style='background:{OWN}'>&nbsp;own input&nbsp;</span> "
              "blue outline →: sent this step, orange outline ←: received</small>")
    return (f"<div class='ring-frame' data-phase='{frame.phase}' data-step='{frame.step}'>"
            f"<p>{html.escape(describe_frame(frame))}</p>"
            f"<table style='border-collapse:collapse'><tr><th></th>{head}</tr>"
            f"{''.join(rows)}</table>"
            f"<p><small>{html.escape(msgs) if msgs else '&nbsp;'}</small></p>{legend}</div>")


class RingStepper(widgets.VBox):
    """Step through a ring all-reduce: pick the number of ranks, then move step by step.

    Attributes:
        world_size: ``IntSlider`` (2 to 8 ranks).
        step: ``IntSlider`` over the ``2 (N - 1) + 1`` frames (0: the start).
        table: ``HTML`` showing the current frame.
        frames: the :class:`RingFrame` list being shown.
    """

    def __init__(self, world_size: int = 4, seed: int = 0):
        if not 2 <= world_size <= 8:
            raise ValueError(f"world_size must be between 2 and 8, got {world_size}.")
        self.seed = seed
        self.world_size = widgets.IntSlider(value=world_size, min=2, max=8, description="ranks")
        self.step = widgets.IntSlider(value=0, min=0, max=2 * (world_size - 1), description="step")
        width = widgets.Layout(width="110px")
        self.prev_button = widgets.Button(description="◀ previous", layout=width)
        self.next_button = widgets.Button(description="next ▶", layout=width)
        self.table = widgets.HTML()
        self.frames: list[RingFrame] = []
        self.world_size.observe(self._on_world_size, names="value")
        self.step.observe(lambda _: self._show(), names="value")
        self.prev_button.on_click(lambda _: self._move(-1))
        self.next_button.on_click(lambda _: self._move(+1))
        controls = widgets.HBox([self.world_size, self.step, self.prev_button, self.next_button])
        super().__init__([controls, self.table])
        self._on_world_size()

    def _on_world_size(self, _change=None) -> None:
        n = self.world_size.value
        self.frames = simulate_ring(ring_inputs(n, self.seed))
        # Shrinking the range first keeps the slider's value valid at every moment.
        self.step.value = min(self.step.value, len(self.frames) - 1)
        self.step.max = len(self.frames) - 1
        self._show()

    def _move(self, delta: int) -> None:
        self.step.value = max(0, min(self.step.max, self.step.value + delta))

    def _show(self) -> None:
        self.table.value = render_frame(self.frames[self.step.value])
