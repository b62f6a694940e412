"""Execute one notebook for ``dpcourse grade``: :func:`execute` (the grader's side) starts
``python -m dpcourse.grading.executor IN.ipynb OUT.ipynb PROGRESS [SANDBOX]`` in its own
session, watches PROGRESS and kills it, its kernel and all they started at the time limit.

PROGRESS receives ``ready``, ``start N`` before each code cell, and a last
line ``end STATUS N MESSAGE``. With SANDBOX (JSON: ``bwrap``, ``package``,
``disable_userns``, ``env``) only the kernel runs in the sandbox, with this process's
working directory as its scratch; they talk ZeroMQ over Unix sockets there (``ipc``
transport), so the kernel needs no network, not even loopback. OUT and PROGRESS are
written by this process, where the kernel cannot reach them.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

import psutil

from dpcourse.grading.report import strip_ansi
from dpcourse.launch import reaper

KERNEL_START = 60.0  # seconds for the kernel to come up, on top of the notebook's time limit


def _kernel_manager_class(sandbox: dict | None = None):
    """An async kernel manager whose kernel runs this very interpreter (in ``sandbox``, if given)."""
    import ipykernel.kernelspec
    from jupyter_client.kernelspec import KernelSpecManager
    from jupyter_client.manager import AsyncKernelManager

    class CurrentEnv(KernelSpecManager):
        def get_kernel_spec(self, kernel_name):
            return self.kernel_spec_class(resource_dir=ipykernel.kernelspec.RESOURCES,
                                          **ipykernel.kernelspec.get_kernel_dict())

    class Manager(AsyncKernelManager):
        def __init__(self, **kwargs):
            kwargs.setdefault("kernel_spec_manager", CurrentEnv())
            if sandbox is not None:
                # Unix sockets named relative to the shared working directory: short
                # (a socket path has a ~100-byte limit) and the same on both sides.
                kwargs.update(transport="ipc", connection_file="kernel.json", ip="kernel-ipc")
            super().__init__(**kwargs)

        def format_kernel_cmd(self, extra_arguments=None):
            cmd = super().format_kernel_cmd(extra_arguments)
            if sandbox is None:
                return cmd
            from dpcourse.grading.sandbox import Sandbox

            return Sandbox(sandbox["bwrap"], sandbox["package"],
                           sandbox.get("disable_userns", True)).command(
                cmd, os.getcwd(), sandbox.get("env"))

    return Manager


def main(src: str, dst: str, progress_path: str, sandbox: str | None = None) -> int:
    # jsonschema's check of the "iri" format, which notebooks never use, costs ~1.5 s of CPU
    # to import: a None in sys.modules makes its import fail, and jsonschema goes without.
    sys.modules["rfc3987_syntax"] = None
    import nbformat
    from nbclient import NotebookClient
    from nbclient.exceptions import CellExecutionError, DeadKernelError

    progress = open(progress_path, "a", buffering=1)
    nb = nbformat.read(src, as_version=4)

    def save():
        nbformat.write(nb, dst + ".tmp")
        os.replace(dst + ".tmp", dst)

    client = NotebookClient(nb, timeout=None, allow_errors=False,
                            kernel_manager_class=_kernel_manager_class(
                                json.loads(sandbox) if sandbox else None),
                            resources={"metadata": {"path": os.getcwd()}})
    status, index, message = "ok", -1, ""
    try:
        with client.setup_kernel(stderr=subprocess.DEVNULL):
            progress.write("ready\n")
            for index, cell in enumerate(nb.cells):
                if cell.cell_type != "code":
                    continue
                progress.write(f"start {index}\n")
                try:
                    client.execute_cell(cell, index)
                finally:
                    save()
    except CellExecutionError as exc:
        lines = [ln for ln in str(exc).strip().splitlines() if ln.strip()]
        status, message = "error", lines[-1] if lines else type(exc).__name__
    except DeadKernelError as exc:
        status, message = "died", f"the kernel died ({exc})"
    except Exception as exc:  # noqa: BLE001 - anything else ends this notebook, not the run
        status, message = "error", f"{type(exc).__name__}: {exc}"
    save()
    progress.write(f"end {status} {index} {message.replace(chr(10), ' ')}\n")
    progress.close()
    return 0


@dataclass
class Execution:
    """How a notebook's run ended."""

    status: str          # ok, error, timeout, died, unreadable
    stop: int | None     # index of the cell that failed or was running, if any
    message: str
    executed: object = None  # the executed notebook (nbformat), if any
    cell_seconds: float = 0.0  # from the kernel being ready to the end of the run


def _env(folder: str) -> dict:
    """The settings of a kernel whose Jupyter, IPython and matplotlib files go under ``folder``."""
    from dpcourse.grading.runner import SKIP_ENV

    env = {"JUPYTER_PLATFORM_DIRS": "1", "PYDEVD_DISABLE_FILE_VALIDATION": "1",
           SKIP_ENV: "1"}  # the notebook's own check() calls defer to the grader
    for key, sub in (("JUPYTER_RUNTIME_DIR", ".runtime"), ("IPYTHONDIR", ".ipython"),
                     ("MPLCONFIGDIR", ".mpl")):
        env[key] = os.path.join(folder, sub)
        os.makedirs(env[key], exist_ok=True)
    return env


def _progress(path: str) -> list[str]:
    try:
        with open(path) as f:
            return f.read().splitlines()
    except OSError:
        return []


def _running(lines: list[str]) -> int | None:
    """The cell the progress ``lines`` last saw start, if any."""
    started = [int(ln.split()[1]) for ln in lines if ln.startswith("start ")]
    return started[-1] if started else None


def execute(nb, timeout: float, sandbox=None) -> Execution:
    """Run notebook ``nb`` in an owned kernel (in ``sandbox``, a
    :class:`~dpcourse.grading.sandbox.Sandbox`, if given); kill all at ``timeout`` s of cell time."""
    import nbformat

    work = tempfile.mkdtemp(prefix="dpcourse-grade-")
    src, dst, progress = (os.path.join(work, n) for n in ("in.ipynb", "out.ipynb", "progress"))
    run_dir = os.path.join(work, "run")
    os.makedirs(run_dir)
    nbformat.write(nb, src)
    argv = [sys.executable, "-m", "dpcourse.grading.executor", src, dst, progress]
    if sandbox is not None:
        argv.append(json.dumps({"bwrap": sandbox.bwrap, "package": sandbox.package,
                                "disable_userns": sandbox.disable_userns,
                                "env": _env(run_dir)}))
    before = {p.pid for p in psutil.Process().children()}
    proc = None
    try:
        with open(os.path.join(work, "executor.log"), "wb") as log:
            env = {k: v for k, v in os.environ.items() if not k.startswith("DPCOURSE_")}
            env.update(_env(work), TMPDIR=os.path.join(work, "tmp"))
            os.makedirs(env["TMPDIR"])
            proc = subprocess.Popen(argv, cwd=run_dir, env=env, stdin=subprocess.DEVNULL,
                                    stdout=log, stderr=log, start_new_session=True)
        started, deadline = time.monotonic(), None
        while True:
            lines = _progress(progress)
            if deadline is None and "ready" in lines:
                deadline = time.monotonic() + timeout
            if proc.poll() is not None:
                break
            now = time.monotonic()
            if deadline is None and now - started > KERNEL_START:
                return Execution("error", None, f"the kernel did not start within "
                                 f"{KERNEL_START:g} s")
            if deadline is not None and now > deadline:
                cell = _running(lines)
                reaper.kill_tree([proc.pid])
                reaper.kill_new_children(before)
                return Execution("timeout", cell, f"cell {cell} was still running at the time "
                                 f"limit ({timeout:g} s); it and everything it started were "
                                 "stopped", _read(dst), time.monotonic() - deadline + timeout)
            reaper.reap(keep=before | {proc.pid})  # orphans the notebook left, as they end
            time.sleep(0.1)
        spent = time.monotonic() - deadline + timeout if deadline is not None else 0.0
        lines = _progress(progress)
        end = [ln for ln in lines if ln.startswith("end ")]
        if not end:
            return Execution("died", _running(lines), f"the notebook's process ended during "
                             f"cell {_running(lines)} (killed?)", _read(dst), spent)
        _, status, index, *message = end[-1].split(" ", 3)
        if status == "ok":
            return Execution("ok", None, "", _read(dst), spent)
        return Execution(status, int(index), f"cell {index}: {strip_ansi(''.join(message))}",
                         _read(dst), spent)
    finally:
        if proc is not None:
            reaper.kill_tree([proc.pid])
        reaper.kill_new_children(before)
        shutil.rmtree(work, ignore_errors=True)


def _read(path: str):
    import nbformat

    try:
        return nbformat.read(path, as_version=4)
    except Exception:  # noqa: BLE001 - a notebook cut short, or overwritten by the kernel
        return None


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:5]))
