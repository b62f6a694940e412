"""Text for printing next to plots: byte counts, durations and fixed-width tables."""

from __future__ import annotations

MiB = 2**20  # a mebibyte; torch DDP's bucket_cap_mb counts these


def format_bytes(n: float) -> str:
    """Format a byte count with a binary unit (``"4.0 MiB"``)."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"


def format_seconds(s: float) -> str:
    """Format a duration with a readable unit (``"250 µs"``, ``"3.1 ms"``, ``"2.0 s"``)."""
    if s >= 1:
        return f"{s:.1f} s"
    if s >= 1e-3:
        return f"{s * 1e3:.3g} ms"
    return f"{s * 1e6:.3g} µs"


def format_table(rows: list[dict], columns: list[str] | None = None, floatfmt: str = ".4g") -> str:
    """Lay out records as a fixed-width text table (for printing in a notebook).

    Args:
        rows: records with the same keys.
        columns: keys to show, in order (default: the first record's keys).
        floatfmt: format spec for floats.

    Returns:
        The table as one string, header first.
    """
    if not rows:
        return "(no rows)"
    columns = list(columns or rows[0].keys())

    def cell(v):
        return format(v, floatfmt) if isinstance(v, float) else str(v)

    cells = [[cell(r.get(c, "")) for c in columns] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(columns)]
    line = lambda vals: "  ".join(v.rjust(w) for v, w in zip(vals, widths))  # noqa: E731
    return "\n".join([line(columns), line(["-" * w for w in widths])] + [line(r) for r in cells])
