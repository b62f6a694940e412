"""Lesson 12's Triton kernels compile to Triton IR for an H100/H200 target, without a GPU.

Triton's front end (parsing, types, constexpr evaluation) runs on any machine; only
running a kernel needs a GPU. These tests compile every kernel, and solution 12's
two learner kernels, to Triton IR for sm_90 on 2 to 72 ranks, so a type error or
a wrong name in a kernel shows here before any GPU time is spent. They need Triton,
which the CPU build of torch does not install: ``make kernel-ir`` unpacks the
Triton wheel the GPU machines use into ``.cache/`` and runs this file with it.
Without Triton, or without its CUDA backend, they are skipped.
"""

from __future__ import annotations

import pytest

triton = pytest.importorskip("triton")
nvidia = pytest.importorskip("triton.backends.nvidia.compiler")

from triton._C.libtriton import ir  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler.compiler import ASTSource  # noqa: E402

from dpcourse.comm.kernels import triton_allreduce as tk  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)  # H100 and H200
WORLDS = (2, 3, 4, 8, 72)  # 72: one NVLink domain of the largest kind; lanes round up to 128


def _ttir(fn, pointers: str, constexprs: dict, two_shot: bool, num_warps: int = 16) -> str:
    """Compile ``fn`` to Triton IR with the argument types the launch passes; return its text."""
    backend = nvidia.CUDABackend(TARGET)
    options = backend.parse_options({"num_warps": num_warps})
    signature = {"x": pointers, "buf": pointers, "buf_deltas": "*i64", "pad": "*i32",
                 "pad_deltas": "*i64", "numel": "i32"}
    if two_shot:
        signature["slice_len"] = "i32"
    signature.update({name: "constexpr" for name in constexprs})
    context = ir.context()
    ir.load_dialects(context)
    backend.load_dialects(context)
    source = ASTSource(fn, signature, constexprs=constexprs)
    module = source.make_ir(TARGET, options, backend.get_codegen_implementation(options),
                            backend.get_module_map(), context)
    return str(module)


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("dtype", ["*bf16", "*fp32"])
def test_kernels_compile_for_every_world_size(world, dtype):
    """One-shot, two-shot (copying or in place) and the empty kernel, first and last rank."""
    for rank in (0, world - 1):
        one = _ttir(tk.one_shot_kernel, dtype, {"RANK": rank, "WORLD": world, "BLOCK": 8192},
                    two_shot=False)
        # the barrier's lanes: one pointer per rank, rounded up to a power of two
        assert f"tensor<{triton.next_power_of_2(world)}x!tt.ptr<i32>>" in one
        for copy in (True, False):
            _ttir(tk.two_shot_kernel, dtype,
                  {"RANK": rank, "WORLD": world, "BLOCK": 8192, "COPY": copy}, two_shot=True)
    _ttir(tk.empty_kernel, dtype, {"RANK": 0, "WORLD": world, "BLOCK": 16, "COPY": False},
          two_shot=True)


def test_solution_kernels_compile():
    """Solution 12's learner kernels, through the exercise's ``@kernel`` and ``jit()``."""
    from test_12_kernels import _solution_kernels

    solution = _solution_kernels()
    constexprs = {"RANK": 1, "WORLD": 4, "BLOCK": 8192}
    _ttir(solution.one_shot_kernel.jit(), "*bf16", constexprs, two_shot=False)
    _ttir(solution.two_shot_kernel.jit(), "*bf16", {**constexprs, "COPY": True}, two_shot=True)
