"""Launching the Triton all-reduce kernels from the host, with little Python per call.

Imported only on a CUDA machine, like the kernels
(:mod:`dpcourse.comm.kernels.triton_allreduce`). :func:`launch_one_shot` and
:func:`launch_two_shot` launch a kernel on the current stream and return its
:class:`DirectLaunch`, which the plans of :mod:`dpcourse.comm.kernels.allreduce`
call again on every later call.
"""

from __future__ import annotations

import torch
import triton

from dpcourse.comm.kernels.triton_allreduce import one_shot_kernel, two_shot_kernel


# Triton versions whose C launcher DirectLaunch calls directly (checked on GPUs:
# tests/test_12_kernels.py); any other version launches through Triton's runner.
C_LAUNCH_VERSIONS = ("3.6.",)


class DirectLaunch:
    """One compiled kernel variant over one grid, launched with nothing around Triton's launcher.

    ``compiled[grid](*args)``, Triton's own runner, runs Python on every
    launch before its C launcher does (it asks the compiled kernel for launch
    metadata, among other things). On a small all-reduce that costs the host
    microseconds, about as long as the kernel takes. Here the launch goes
    straight to the C launcher, with no launch metadata and no hooks (tools that
    register Triton launch hooks do not see these launches), for a Triton in
    :data:`C_LAUNCH_VERSIONS` and a kernel that needs no scratch memory. The C
    launcher's arguments are private to Triton and change between versions, so
    any other version launches through the runner: correct, at the runner's cost.

    Call ``launch(*args, stream=stream)``; or, for a launch repeated on the same
    arguments, ``launch.c_launch(launch.grid, 1, 1, stream, *launch.bind(*args))``.
    """

    __slots__ = ("compiled", "c_launch", "grid", "head")

    head: tuple  # what comes between the stream and the kernel's arguments

    def __init__(self, compiled, grid: int):
        self.compiled, self.grid = compiled, grid  # Triton's own launch: compiled[(grid, 1, 1)]
        # the launcher object, read only from a version known to have it (it loads the binary)
        run = compiled.run if triton.__version__.startswith(C_LAUNCH_VERSIONS) else None
        if run is not None and not run.global_scratch_size and not run.profile_scratch_size:
            self.c_launch = run.launch
            # function, cooperative grid, programmatic dependent launch, global and profile
            # scratch, packed metadata, launch metadata, enter hook, exit hook
            self.head = (compiled.function, run.launch_cooperative_grid, run.launch_pdl, None,
                         None, compiled.packed_metadata, None, None, None)
        else:
            runner = compiled[(grid, 1, 1)]

            def through_runner(grid_x, grid_y, grid_z, stream, *args):
                runner(*args, stream=stream)

            self.c_launch, self.head = through_runner, ()

    def bind(self, *args) -> tuple:
        """Return what follows the stream in ``c_launch``'s arguments for a launch on ``args``."""
        return (*self.head, *args)

    def __call__(self, *args, stream: int) -> None:
        self.c_launch(self.grid, 1, 1, stream, *self.bind(*args))


# Launchers of compiled kernels, keyed by everything Triton specialises a kernel on.
_LAUNCHERS: dict = {}


def _launch(kernel, grid: int, args: tuple, constexprs: tuple, num_warps: int) -> DirectLaunch:
    """Launch ``kernel`` over ``grid`` blocks on the current stream; return its direct launcher.

    The launcher takes ``*args, *constexprs`` and a stream, and launches the
    same compiled variant, skipping Triton's dispatch.

    Triton's ``kernel[grid](...)`` inspects every argument on each call to find
    the compiled variant (about as long as the kernel takes on a small
    message). Which variant runs depends on the constexpr values, on each
    pointer's 16-byte alignment and on each integer's value (1, a multiple of
    16, or neither); the key below holds those exactly (integers by value), so
    a launcher is only reused for calls that would compile to the same kernel.
    """
    device = args[0].get_device()
    key = (kernel, grid, num_warps, constexprs, device,
           *((a.dtype, a.data_ptr() % 16 == 0) if isinstance(a, torch.Tensor) else a
             for a in args))
    launcher = _LAUNCHERS.get(key)
    if launcher is not None:
        launcher(*args, *constexprs, stream=torch._C._cuda_getCurrentRawStream(device))
        return launcher
    names = kernel.arg_names[len(args):]
    compiled = kernel[(grid,)](*args, **dict(zip(names, constexprs)), num_warps=num_warps)
    if len(_LAUNCHERS) >= 256:  # bounded: a few sizes and dtypes per run in practice
        _LAUNCHERS.clear()
    launcher = _LAUNCHERS[key] = DirectLaunch(compiled, grid)
    return launcher


def launch_one_shot(x, buf, buf_deltas, pad, pad_deltas, rank, world, grid, block, num_warps,
                    kernel=None):
    """Launch :func:`one_shot_kernel` (or ``kernel``, same parameters); return its launcher."""
    return _launch(one_shot_kernel if kernel is None else kernel, grid,
            (x, buf, buf_deltas, pad, pad_deltas, x.numel()), (rank, world, block), num_warps)


def launch_two_shot(x, buf, buf_deltas, pad, pad_deltas, slice_len, rank, world, grid, block,
                    num_warps, copy, kernel=None):
    """Launch :func:`two_shot_kernel` (or ``kernel``, same parameters); return its launcher."""
    return _launch(two_shot_kernel if kernel is None else kernel, grid,
            (x, buf, buf_deltas, pad, pad_deltas, x.numel(), slice_len),
            (rank, world, block, copy), num_warps)
