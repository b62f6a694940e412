"""What exercise 12 gives the learner: ``tl``, the ``@kernel`` decorator and the host-side launchers.

The learner writes Triton kernels in a notebook::

    from dpcourse.comm.kernels.exercise import block_barrier, kernel, peer_delta, tl

    @kernel
    def one_shot_kernel(x, buf, buf_deltas, pad, pad_deltas, numel,
                        RANK: tl.constexpr, WORLD: tl.constexpr, BLOCK: tl.constexpr):
        ...

``@kernel`` keeps the function's source, not a compiled kernel, so the kernel
can travel to other processes (the check's ranks) and be compiled there:
:meth:`LearnerKernel.jit` writes the source into a module next to the
imports it needs and applies ``triton.jit``. On a machine without Triton,
``tl`` is a stand-in that only makes the definitions valid Python; compiling
raises a clear error.
"""

from __future__ import annotations

import hashlib
import importlib.util
import inspect
import os
import tempfile
import textwrap
import types

try:
    import triton.language as tl
except ImportError:  # a machine without Triton: definitions work, kernels cannot be compiled
    tl = types.SimpleNamespace(constexpr=object)

HEADER = """\
import triton
import triton.language as tl
from dpcourse.comm.kernels.triton_allreduce import (block_barrier, peer_delta, send_signal,
                                                    wait_signal)

"""


def _unavailable(*args, **kwargs):
    raise RuntimeError("this is a Triton function: it runs inside a kernel on a GPU.")


block_barrier = peer_delta = send_signal = wait_signal = _unavailable


class LearnerKernel:
    """A kernel written in a notebook, kept as source until :meth:`jit` compiles it."""

    def __init__(self, name: str, source: str):
        self.name, self.source = name, source
        self._jit = None

    @classmethod
    def from_function(cls, fn) -> "LearnerKernel":
        """Capture ``fn``'s source without its decorators."""
        lines = textwrap.dedent(inspect.getsource(fn)).splitlines()
        start = next(i for i, line in enumerate(lines) if line.lstrip().startswith("def "))
        return cls(fn.__name__, "\n".join(lines[start:]) + "\n")

    def __reduce__(self):  # travels as text
        return (LearnerKernel, (self.name, self.source))

    def __call__(self, *args, **kwargs):
        _unavailable()

    def is_stub(self) -> bool:
        """Return whether the body is still the exercise's ``NotImplementedError`` stub."""
        return "NotImplementedError" in self.source

    def jit(self):
        """Compile-ready ``triton.jit`` function built from the source (needs Triton)."""
        if self._jit is None:
            try:
                import triton  # noqa: F401
            except ImportError as err:
                raise RuntimeError("compiling a kernel needs Triton and a CUDA GPU.") from err
            text = HEADER + "@triton.jit\n" + self.source
            digest = hashlib.sha1(text.encode()).hexdigest()[:12]
            folder = os.path.join(tempfile.gettempdir(), "dpcourse-kernels")
            os.makedirs(folder, exist_ok=True)
            path = os.path.join(folder, f"learner_{self.name}_{digest}.py")
            if not os.path.exists(path):  # Triton reads the source from this file
                tmp = f"{path}.{os.getpid()}.tmp"  # every rank writes its own, then renames
                with open(tmp, "w") as f:
                    f.write(text)
                os.replace(tmp, path)
            spec = importlib.util.spec_from_file_location(f"learner_{digest}", path)
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
            self._jit = getattr(module, self.name)
        return self._jit


def kernel(fn) -> LearnerKernel:
    """Decorate a learner's Triton kernel (use instead of ``@triton.jit`` in the exercise)."""
    return LearnerKernel.from_function(fn)


def all_reduce_with(learner_kernel: LearnerKernel, kind: str):
    """Return ``fn(tensor, group=None)`` summing in place with the learner's kernel.

    The host side is the package's (workspace, grid, launch); only the kernel is the learner's.

    Args:
        learner_kernel: a :class:`LearnerKernel` with the parameters of the package's
            ``one_shot_kernel`` or ``two_shot_kernel``.
        kind: ``"one_shot"`` or ``"two_shot"``.
    """
    from dpcourse.comm.kernels.allreduce import one_shot_all_reduce, two_shot_all_reduce

    host = {"one_shot": one_shot_all_reduce, "two_shot": two_shot_all_reduce}[kind]
    compiled = learner_kernel.jit()

    def all_reduce(tensor, group=None):
        host(tensor, group=group, kernel=compiled)

    return all_reduce


def last_buffer_half(tensor):
    """Return a copy of this rank's workspace half that the last kernel call used.

    After a two-shot call on ``tensor`` (not in symmetric memory), that half holds
    what the kernel left in this rank's buffer: exercise 12's check reads it to see
    which rank stored each slice's sum there. ``tensor.numel()`` elements, in its dtype.
    """
    from dpcourse.comm.kernels.schedule import half_offset
    from dpcourse.comm.kernels.workspace import get_workspace

    ws = get_workspace(0, None, tensor.device)  # the cached one: a call made it
    half_len = (ws.nbytes // 2) // tensor.element_size()
    return ws.view(tensor.dtype, tensor.numel(),
                   offset=half_offset(ws.calls - 1, half_len)).clone()
