"""``dpcourse grade``: execute exercise notebooks headless and collect their checks' scores.

Each notebook runs top to bottom in a fresh kernel of this Python environment
with ``DPCOURSE_GRADE_FILE`` set; every ``check(...)`` call in it appends its
result there. The exercises a notebook calls ``check`` for are read from its
source, so an exercise the notebook never reached (an error, a timeout) still
appears in the table, with zero points. Learner code runs only in that kernel
and in the ranks it launches.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import tempfile
import time

from dpcourse.formatting import format_table
from dpcourse.grading.report import DEFAULT_POINTS, GRADE_FILE_ENV

_CHECK_CALL = re.compile(r"""\bcheck\(\s*["'](\w+)["']""")


def expected_checks(nb) -> list[str]:
    """Return the check names a notebook calls, in order of first appearance."""
    names = []
    for cell in nb.cells:
        if cell.cell_type == "code":
            for name in _CHECK_CALL.findall(cell.source):
                if name not in names:
                    names.append(name)
    return names


def _kernel_manager():
    """A kernel running this very interpreter (like nbval's --nbval-current-env)."""
    import ipykernel.kernelspec
    from jupyter_client.kernelspec import KernelSpecManager
    from jupyter_client.manager import KernelManager

    class CurrentEnv(KernelSpecManager):
        def get_kernel_spec(self, kernel_name):
            return self.kernel_spec_class(resource_dir=ipykernel.kernelspec.RESOURCES,
                                          **ipykernel.kernelspec.get_kernel_dict())

    return KernelManager(kernel_name="python3", kernel_spec_manager=CurrentEnv())


def execute(path: str, timeout: float, grade_file: str) -> tuple[str, str]:
    """Run notebook ``path`` with ``grade_file`` set; return ``(status, message)``.

    Args:
        path: the notebook.
        timeout: seconds for the whole notebook.
        grade_file: where its checks append their results.

    Returns:
        ``("ok", "")``, ``("error", what failed)`` or ``("timeout", where)``.
    """
    import nbformat
    from nbclient import NotebookClient
    from nbclient.exceptions import CellExecutionError, CellTimeoutError, DeadKernelError

    nb = nbformat.read(path, as_version=4)
    folder = os.path.dirname(os.path.abspath(path))
    client = NotebookClient(nb, km=_kernel_manager(), allow_errors=False,
                            resources={"metadata": {"path": folder}})
    deadline = time.monotonic() + timeout
    old = os.environ.get(GRADE_FILE_ENV)
    os.environ[GRADE_FILE_ENV] = grade_file  # the kernel inherits it
    index = 0
    try:
        # The kernel's own log lines (transport warnings) are noise in a grading run;
        # what learner code prints reaches the notebook's outputs, not this stream.
        with client.setup_kernel(stderr=subprocess.DEVNULL):
            for index, cell in enumerate(nb.cells):
                if cell.cell_type != "code":
                    continue
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return "timeout", (f"notebook time limit ({timeout:g} s) reached before "
                                       f"cell {index}")
                client.timeout = max(1, int(remaining))
                client.execute_cell(cell, index)
    except CellTimeoutError:
        return "timeout", f"cell {index} ran past the notebook time limit ({timeout:g} s)"
    except CellExecutionError as exc:
        lines = [ln for ln in str(exc).strip().splitlines() if ln.strip()]
        return "error", f"cell {index}: {lines[-1] if lines else exc}"
    except DeadKernelError as exc:
        return "error", f"cell {index}: the kernel died ({exc})"
    finally:
        if old is None:
            os.environ.pop(GRADE_FILE_ENV, None)
        else:
            os.environ[GRADE_FILE_ENV] = old
    return "ok", ""


def _missing_row(notebook: str, name: str, why: str) -> dict:
    from dpcourse.grading.checks import get_spec

    try:
        spec = get_spec(name)
        total = len(spec.active_criteria({c.requires: None for c in spec.criteria if c.requires}))
        exercise, title, points = spec.exercise, spec.title, spec.points
    except ValueError:
        total, exercise, title, points = 0, "?", name, DEFAULT_POINTS
    return {"notebook": notebook, "check": name, "exercise": exercise, "title": title,
            "passed": 0, "total": total, "points": 0.0, "max_points": points,
            "criteria": [], "status": f"not graded: {why}"}


def grade(paths: list[str], timeout: float = 600.0) -> dict:
    """Execute every notebook in ``paths`` (files or folders) and collect the check results.

    Args:
        paths: notebooks, or folders whose ``*.ipynb`` files are graded in name order.
        timeout: seconds allowed per notebook.

    Returns:
        ``{"notebooks": [...], "results": [...], "points": p, "max_points": m}``.
    """
    import nbformat

    files = []
    for p in paths:
        if os.path.isdir(p):
            files += sorted(os.path.join(p, n) for n in os.listdir(p) if n.endswith(".ipynb"))
        elif os.path.isfile(p):
            files.append(p)
        else:
            raise FileNotFoundError(f"no notebook or folder at {p!r}.")
    notebooks, results = [], []
    for path in files:
        name = os.path.basename(path)
        expected = expected_checks(nbformat.read(path, as_version=4))
        fd, grade_file = tempfile.mkstemp(prefix="dpcourse-grade-", suffix=".jsonl")
        os.close(fd)
        t0 = time.perf_counter()
        try:
            status, message = execute(path, timeout, grade_file)
            with open(grade_file) as f:
                got = [json.loads(line) for line in f if line.strip()]
        finally:
            os.unlink(grade_file)
        notebooks.append({"notebook": name, "path": path, "status": status, "message": message,
                          "seconds": round(time.perf_counter() - t0, 1)})
        latest = {r["check"]: r for r in got}  # a check run twice counts its last run
        for check_name in expected + [n for n in latest if n not in expected]:
            if check_name in latest:
                results.append(dict(latest[check_name], notebook=name, status="graded"))
            else:
                results.append(_missing_row(name, check_name, message or "check never ran"))
    return {"notebooks": notebooks, "results": results,
            "points": round(sum(r["points"] for r in results), 1),
            "max_points": sum(r["max_points"] for r in results)}


def score_table(report: dict) -> str:
    """Return the score table as text: one row per exercise, then notebook problems and a total."""
    rows = [{"notebook": r["notebook"], "exercise": r["exercise"], "check": r["check"],
             "criteria": f"{r['passed']}/{r['total']}",
             "points": f"{r['points']:g}/{r['max_points']:g}"} for r in report["results"]]
    out = [format_table(rows)]
    out.append(f"total: {report['points']:g}/{report['max_points']:g} points")
    for nb in report["notebooks"]:
        if nb["status"] != "ok":
            out.append(f"{nb['notebook']}: {nb['status']}: {nb['message']} (exercises after this "
                       "point score zero)")
    return "\n".join(out)


def cli(args) -> int:
    """Run ``dpcourse grade``: print the table, optionally write JSON; exit 0 once graded."""
    report = grade(args.paths, timeout=args.timeout)
    print(score_table(report))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
        print(f"results written to {args.json}")
    return 0
