"""Run the course on this machine, item by item, and record pass/fail and wall time.

The items are what a learner runs: the GPU-marked tests, every lesson notebook,
every solution notebook, and the terminal demo under ``dpcourse launch``. Each
runs in its own pytest (or command) process, so one failure never hides the
next. The result is a JSON file (one row per item, the machine named) and a
Markdown table printed at the end, the rows of ``docs/hardware.md``.

Usage (``make test-gpu`` runs the first form)::

    python tests/hardware_matrix.py --out hardware.json
    python tests/hardware_matrix.py --only lessons/04 solutions/12 --out part.json
    python tests/hardware_matrix.py --render cpu.json 1gpu.json 2gpu.json   # one table
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import subprocess
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
NBVAL = ["--nbval-lax", "--nbval-current-env", "-p", "no:cacheprovider", "-q"]


def machine() -> dict:
    """Name this machine: GPU count and model, torch and CUDA versions, CPU cores."""
    import torch

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    names = sorted({torch.cuda.get_device_name(i) for i in range(gpus)})
    label = f"{gpus} x {names[0]}" if gpus else f"CPU only, {os.cpu_count()} cores"
    return {"label": label, "gpus": gpus, "gpu_names": names, "torch": torch.__version__,
            "cuda": torch.version.cuda, "python": platform.python_version(),
            "cpu_cores": os.cpu_count()}


def items() -> list[tuple[str, list[str]]]:
    """Every item of the matrix as (name, command), in the order a learner meets them."""
    py = sys.executable
    found = [("tests -m gpu", [py, "-m", "pytest", "tests", "-m", "gpu", "-q", "-p",
                               "no:cacheprovider"])]
    for folder in ("lessons", "solutions"):
        for nb in sorted((ROOT / folder).glob("[0-9][0-9]_*.ipynb")):
            found.append((f"{folder}/{nb.name}", [py, "-m", "pytest", str(nb.relative_to(ROOT)),
                                                  *NBVAL]))
    found.append(("dpcourse launch -m dpcourse.demo",
                  [py, "-m", "dpcourse.cli", "launch", "-m", "dpcourse.demo", "--steps", "5"]))
    return found


def run_item(name: str, cmd: list[str], timeout: float) -> dict:
    """Run one item; return its row (result, wall seconds, the tail of its output on failure)."""
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
        result = "pass" if proc.returncode == 0 else "fail"
        tail = "" if proc.returncode == 0 else (proc.stdout + proc.stderr)[-3000:]
    except subprocess.TimeoutExpired as exc:
        result = "timeout"
        tail = ((exc.stdout or b"").decode(errors="replace") if isinstance(exc.stdout, bytes)
                else (exc.stdout or ""))[-3000:]
    return {"item": name, "result": result, "wall_s": round(time.perf_counter() - t0, 1),
            "tail": tail}


def markdown(rows: list[dict], label: str) -> str:
    """Render the rows as a two-column Markdown table headed by the machine's label."""
    lines = [f"| item | {label} |", "| --- | --- |"]
    lines += [f"| {r['item']} | {r['result']} ({r['wall_s']:.0f} s) |" for r in rows]
    return "\n".join(lines)


def combined(results: list[dict]) -> str:
    """Render several machines' result files as one table: an item per row, a machine per column."""
    # Files of one machine (a run split in parts) join; an item run again takes the later row.
    by_machine: dict[str, dict[str, dict]] = {}
    for r in results:
        rows = by_machine.setdefault(r["machine"]["label"], {})
        rows.update({row["item"]: row for row in r["rows"]})
    labels = list(by_machine)
    results = [{"rows": list(rows.values())} for rows in by_machine.values()]
    names: list[str] = []
    for r in results:
        names += [row["item"] for row in r["rows"] if row["item"] not in names]
    lines = ["| item | " + " | ".join(labels) + " |", "|---" * (len(labels) + 1) + "|"]
    for name in names:
        cells = []
        for r in results:
            row = next((x for x in r["rows"] if x["item"] == name), None)
            cells.append("not run" if row is None else row["result"] if row.get("wall_s") is None
                         else f"{row['result']} ({row['wall_s']:.0f} s)")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="*", default=[],
                        help="run only the items whose name contains one of these")
    parser.add_argument("--out", type=pathlib.Path, help="write the rows and the machine here (JSON)")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per item (default 900)")
    parser.add_argument("--render", nargs="+", type=pathlib.Path, metavar="JSON",
                        help="print one table from result files (written by --out), run nothing")
    args = parser.parse_args(argv)
    if args.render:
        print(combined([json.loads(path.read_text()) for path in args.render]))
        return 0
    if args.out is not None and not args.out.parent.is_dir():
        parser.error(f"--out: folder {args.out.parent} does not exist")
    where = machine()
    print(f"machine: {where['label']}, torch {where['torch']}, CUDA {where['cuda']}", flush=True)
    rows = []
    for name, cmd in items():
        if args.only and not any(o in name for o in args.only):
            continue
        rows.append(run_item(name, cmd, args.timeout))
        print(f"{rows[-1]['result']:>7}  {rows[-1]['wall_s']:7.1f} s  {name}", flush=True)
        if rows[-1]["tail"]:
            print(rows[-1]["tail"], flush=True)
        if args.out is not None:  # after every item: a run cut short keeps what it finished
            args.out.write_text(json.dumps({"machine": where, "rows": rows}, indent=1) + "\n")
    print(markdown(rows, where["label"]))
    return 0 if all(r["result"] == "pass" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
