"""All-reduce kernels on NVLink: Triton over PyTorch's symmetric memory (GPU only).

Importable anywhere; the kernels need CUDA GPUs with peer access and Triton,
which is imported only when a kernel is launched. On CPU the functions raise
a clear error, and :mod:`~dpcourse.comm.kernels.schedule` simulates their
block/peer schedule in plain Python.

Importing changes no process state. NVLink multicast stays off: creating a
workspace calls :func:`require_multicast_off`, which sets the variables that
keep it off where they are unset and refuses values that allow it. Where the
variables must hold from the start, setting them is the caller's job: call
:func:`require_multicast_off` before the process group starts (in each rank,
as :mod:`~dpcourse.comm.kernels.selfcheck` does, or before starting the ranks,
which inherit the environment).
"""

from dpcourse.comm.kernels.allreduce import one_shot_all_reduce, two_shot_all_reduce
from dpcourse.comm.kernels.workspace import (release_workspaces, require_multicast_off,
                                             symmetric_empty)

__all__ = ["one_shot_all_reduce", "two_shot_all_reduce", "symmetric_empty",
           "release_workspaces", "require_multicast_off", "kernel_source"]


def kernel_source(name: str) -> str:
    """Return the source of function or class ``name`` in the Triton kernels or their launcher.

    Read from the files (``triton_allreduce.py``, ``triton_launch.py``), so Triton
    need not be importable (a CPU machine).

    Args:
        name: e.g. ``"block_barrier"``, ``"one_shot_kernel"``, ``"two_shot_kernel"``,
            ``"DirectLaunch"``.
    """
    import ast
    import pathlib

    files = ("triton_allreduce.py", "triton_launch.py")
    for path in (pathlib.Path(__file__).with_name(f) for f in files):
        text = path.read_text()
        for node in ast.parse(text).body:
            if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and node.name == name:
                start = node.decorator_list[0].lineno if node.decorator_list else node.lineno
                return "\n".join(text.splitlines()[start - 1:node.end_lineno])
    raise ValueError(f"no function or class {name!r} in {' or '.join(files)}.")
