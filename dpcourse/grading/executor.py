"""Execute one notebook for ``dpcourse grade`` (run as ``python -m dpcourse.grading.executor``).

The grader starts this process in its own session with a private working
directory, temp dir and Jupyter runtime dir, and kills it together with its
kernel (and anything the kernel started) at the time limit. This process only
runs the cells and records progress; it decides nothing about scores.

Usage: ``python -m dpcourse.grading.executor IN.ipynb OUT.ipynb PROGRESS [SANDBOX]``.
PROGRESS receives ``ready``, then ``start N`` before and ``done N`` after each code
cell, and a last line ``end STATUS N MESSAGE``.

With SANDBOX (JSON: ``bwrap``, ``package``, ``disable_userns``, ``env``) the kernel, and only the kernel,
runs in a sandbox (:mod:`dpcourse.grading.sandbox`) whose scratch folder is this
process's working directory. Its channel to this process is ZeroMQ over Unix
sockets in that folder (jupyter_client's ``ipc`` transport, relative names, so
both sides use the same ones): the kernel has no network, not even the
machine's loopback. This process, outside the sandbox, writes OUT and PROGRESS
where the kernel cannot reach them.
"""

from __future__ import annotations

import importlib.abc
import json
import os
import subprocess
import sys


class _NoIriSyntax(importlib.abc.MetaPathFinder):
    """Keep jsonschema from importing ``rfc3987_syntax`` into this process.

    nbformat imports jsonschema, which imports ``rfc3987_syntax`` (where installed)
    only to check strings of the ``iri`` format; that import builds a grammar and
    costs about 1.5 s of CPU, once per graded notebook. Notebook validation never
    checks that format, so jsonschema's fallback (the format left unchecked) changes
    nothing here.
    """

    def find_spec(self, name, path=None, target=None):
        if name == "rfc3987_syntax":
            raise ModuleNotFoundError("not needed to read or run notebooks", name=name)
        return None


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
    sys.meta_path.insert(0, _NoIriSyntax())
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
                progress.write(f"done {index}\n")
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


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:5]))
