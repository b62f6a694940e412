"""What ``dpcourse grade`` writes: the score table, JSON, gradebook CSVs and feedback notebooks.

``--lms-csv`` has the layout Canvas's and Moodle's CSV grade imports read (``ID`` is the
submission folder); ``--feedback DIR`` writes ``DIR/<submission>/<name>.feedback.ipynb``
(the report, then the executed notebook) and the same as ``.html``. A check this machine
cannot run is never 0 points: it is left out of every maximum and total
(:func:`counted_max`), its cells are empty, and the reason is given instead.
"""

from __future__ import annotations

import csv
import io
import json
import os
import tempfile

from dpcourse.argtypes import UsageError
from dpcourse.formatting import format_table
from dpcourse.grading.report import NOT_GRADED_STATUS, strip_ansi


def _atomic_write(path: str, text: str) -> None:
    """Write ``text`` to ``path`` so that a reader never sees half of it."""
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w", newline="", encoding="utf-8") as f:
        f.write(text)
    os.replace(tmp, path)


def _unwritable(folder: str) -> str | None:
    if not os.path.isdir(folder):
        return f"{folder} {'is not a directory' if os.path.exists(folder) else 'does not exist'}"
    try:
        tempfile.TemporaryFile(dir=folder).close()
    except OSError as exc:
        return f"{folder} is not writable ({exc.strerror})"
    return None


def check_outputs(args) -> None:
    """Refuse, before minutes of grading, an output path that could not be written afterwards."""
    for flag in ("--json", "--csv", "--lms-csv", "--feedback"):
        path = getattr(args, flag[2:].replace("-", "_"))
        if path is None:
            continue
        folder = os.path.dirname(os.path.abspath(path))
        if flag == "--feedback":
            if os.path.exists(path) and not os.path.isdir(path):
                raise UsageError(f"grade: {flag} {path} is a file; give a directory")
            folder = os.path.abspath(path)
            while not os.path.exists(folder):  # created with its missing parents
                folder = os.path.dirname(folder)
        elif os.path.isdir(path):
            raise UsageError(f"grade: {flag} {path} is a directory; give a file name")
        if why := _unwritable(folder):
            raise UsageError(f"grade: {flag} {path} cannot be written: {why}")


def counted_max(row: dict) -> float:
    """The points a result row counts towards a maximum: none when it was not graded."""
    return 0.0 if row.get("not_graded") else row["max_points"]


def _key(row: dict) -> list:
    return [row["submission"], row["notebook"], row["exercise"], row["check"]]


def _why(row: dict) -> str | None:
    """Why the row was not graded (its points are then an empty cell, never a 0), or None."""
    return strip_ansi(row["not_graded"]) if row.get("not_graded") else None


def score_table(report: dict) -> str:
    """Return the score table: one row per exercise, totals per submission, notebook problems."""
    results = report["results"]
    rows = [dict(zip(("submission", "notebook", "exercise", "check"), _key(r)),
                 criteria="-" if _why(r) else f"{r['passed']}/{r['total']}",
                 points=(f"not graded (of {r['max_points']:g})" if _why(r)
                         else f"{r['points']:g}/{r['max_points']:g}"
                         + ("" if r.get("sandboxed", True) else " (not sandboxed)")))
            for r in results]
    out = [format_table(rows)] if rows else ["no exercise checks matched these notebooks"]
    subs = sorted({r["submission"] for r in results})
    for s in subs if len(subs) > 1 else ():
        mine = [r for r in results if r["submission"] == s]
        out.append(f"{s}: {sum(r['points'] for r in mine):g}/"
                   f"{sum(counted_max(r) for r in mine):g} points")
    out.append(f"total: {report['points']:g}/{report['max_points']:g} points")
    if report.get("sandboxed") is False:
        out.append("not sandboxed: these notebooks ran with the grader's own rights "
                   "(--no-sandbox); a notebook could have changed any of these scores")
    skipped = [r for r in results if _why(r)]
    if skipped:
        out.append(f"not graded on this machine: {len(skipped)} check(s), "
                   f"{sum(r['max_points'] for r in skipped):g} points left out of the totals")
        out += dict.fromkeys(f"  exercise {r['exercise']} ({r['check']}): {r['not_graded']}"
                             for r in skipped)
    # A notebook not graded here is said just above, with the reason.
    out += [f"{nb['submission']}/{nb['notebook']}: {nb['status']}: {strip_ansi(nb['message'])}"
            for nb in report["notebooks"] if nb["status"] not in ("ok", NOT_GRADED_STATUS)]
    return "\n".join(out)


def write_json(report: dict, path: str) -> None:
    _atomic_write(path, json.dumps(report, indent=2))


def split_points(amount: float, weights: list[float]) -> list[float]:
    """Share ``amount`` in proportion to ``weights``, to 0.01, adding up to ``amount`` exactly
    (the last share with a weight takes what rounding left over)."""
    total = sum(weights)
    if not total:
        return [0.0] * len(weights)
    shares = [round(amount * w / total, 2) for w in weights]
    last = max(i for i, w in enumerate(weights) if w)
    shares[last] = round(amount - sum(shares[:last]) - sum(shares[last + 1:]), 2)
    return shares


def criterion_points(row: dict) -> list[float]:
    """Each criterion's share of the check's points (zero everywhere when a gate failed)."""
    crits = row["criteria"]
    if row["points"] == 0:
        return [0.0] * len(crits)
    return split_points(row["points"], [c["weight"] if c["passed"] else 0.0 for c in crits])


def _write_csv(path: str, report: dict, header: list, rows: list, sandboxed: str) -> None:
    # Without the sandbox every row says so, in a column of its own (named ``sandboxed``).
    bare = report.get("sandboxed") is False
    buf = io.StringIO()
    w = csv.writer(buf)
    w.writerow(header + ([sandboxed] if bare else []))
    w.writerows(row + (["no"] if bare else []) for row in rows)
    _atomic_write(path, buf.getvalue())


def write_csv(report: dict, path: str) -> None:
    """One row per submission, check and criterion; a check's rows add up to its points."""
    rows = []
    for r in report["results"]:
        if _why(r):
            rows.append(_key(r) + ["not_graded", "", "", "", "", _why(r)])
            continue
        most = split_points(r["max_points"], [c["weight"] for c in r["criteria"]])
        rows += [_key(r) + [c["name"], c["weight"], int(c["passed"]), pts, top,
                            strip_ansi(c["detail"]).splitlines()[0] if c["detail"] else ""]
                 for c, pts, top in zip(r["criteria"], criterion_points(r), most)]
    _write_csv(path, report, ["submission", "notebook", "exercise", "check", "criterion",
                              "weight", "passed", "points", "max_points", "detail"], rows,
               "sandboxed")


def write_lms_csv(report: dict, path: str) -> None:
    """One row per submission: Student, ID, one column per exercise, Total (Canvas, Moodle)."""
    columns: dict[str, None] = {}
    marks: dict[str, dict] = {}
    why: dict[str, list[str]] = {}
    for r in report["results"]:
        col = f"Exercise {r['exercise']}: {r['title']} ({r['max_points']:g})"
        columns[col] = None
        mine = marks.setdefault(r["submission"], {})
        if _why(r):
            mine.setdefault(col, "")
            why.setdefault(r["submission"], []).append(f"Exercise {r['exercise']}: {_why(r)}")
        else:
            mine[col] = r["points"]
    rows = [[sub, sub, *[mine.get(c, 0) for c in columns],
             round(sum(v for v in mine.values() if v != ""), 1),
             *(["; ".join(why.get(sub, []))] if why else [])]
            for sub, mine in sorted(marks.items())]
    _write_csv(path, report, ["Student", "ID", *columns, "Total",
                              *(["Not graded"] if why else [])], rows, "Sandboxed")


def report_markdown(info: dict, results: list) -> str:
    """The feedback report as Markdown: status, then each check's criteria."""
    lines = ["# Grading report", ""]
    if info.get("status") not in ("ok", NOT_GRADED_STATUS, None):
        lines += [f"**The notebook did not run to the end** ({info['status']}): "
                  f"{strip_ansi(info.get('message', ''))}", ""]
    return "\n".join(lines + [r.markdown() for r in results])


def write_feedback(folder: str, submission: str, name: str, executed, original: str,
                   info: dict, results: list) -> None:
    """Write ``<name>.feedback.ipynb`` and ``.html``: the executed notebook after the report."""
    import nbformat

    nb = executed
    if nb is None:
        try:
            nb = nbformat.reads(original, as_version=4)
        except Exception:  # noqa: BLE001 - unreadable: the report alone
            nb = nbformat.v4.new_notebook()
    nb.cells.insert(0, nbformat.v4.new_markdown_cell(report_markdown(info, results)))
    out = os.path.join(folder, submission)
    os.makedirs(out, exist_ok=True)
    stem = os.path.join(out, name[:-len(".ipynb")] if name.endswith(".ipynb") else name)
    _atomic_write(stem + ".feedback.ipynb", nbformat.writes(nb))
    try:
        from nbconvert import HTMLExporter

        html, _ = HTMLExporter().from_notebook_node(nb)
    except Exception as exc:  # noqa: BLE001 - HTML is a convenience; the notebook is written
        html = f"<pre>could not render HTML ({type(exc).__name__}); see the .ipynb</pre>"
    _atomic_write(stem + ".feedback.html", html)
