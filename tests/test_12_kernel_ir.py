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


def _signature(pointers: str, constexprs: dict, two_shot: bool) -> dict:
    """The argument types the launch passes, by name, in the kernels' order."""
    signature = {"x": pointers, "buf": pointers, "buf_deltas": "*i64", "pad": "*i32",
                 "pad_deltas": "*i64", "numel": "i32"}
    if two_shot:
        signature["slice_len"] = "i32"
    signature.update({name: "constexpr" for name in constexprs})
    return signature


def _ttir(fn, pointers: str, constexprs: dict, two_shot: bool, num_warps: int = 16,
          attrs: dict | None = None) -> str:
    """Compile ``fn`` to Triton IR with the argument types the launch passes; return its text.

    ``attrs``: what Triton's launch knows of an argument, {(position,): attributes}.
    """
    backend = nvidia.CUDABackend(TARGET)
    options = backend.parse_options({"num_warps": num_warps})
    signature = _signature(pointers, constexprs, two_shot)
    context = ir.context()
    ir.load_dialects(context)
    backend.load_dialects(context)
    source = ASTSource(fn, signature, constexprs=constexprs, attrs=attrs)
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


def _function(ttir: str, name: str) -> list[str]:
    """The lines of the first function in ``ttir`` whose symbol holds ``name``."""
    lines = ttir.splitlines()
    start = next(i for i, line in enumerate(lines) if "tt.func" in line and name in line)
    end = next((i for i in range(start + 1, len(lines)) if "tt.func" in lines[i]), len(lines))
    return [line.strip() for line in lines[start:end]]


@pytest.mark.parametrize("kernel", ["one_shot", "two_shot"])
def test_barrier_is_release_and_acquire_compare_and_swap_at_system_scope_between_block_barriers(
        kernel):
    """Lesson 12, "The signal-pad barrier": a send is a compare-and-swap with release semantics
    at system scope, a wait one with acquire semantics at system scope; block_barrier puts a
    barrier of the block's threads (tl.debug_barrier, gpu.barrier in the IR) before the sends
    and another after the waits; the kernels call block_barrier."""
    if kernel == "one_shot":
        text = _ttir(tk.one_shot_kernel, "*bf16", {"RANK": 0, "WORLD": 4, "BLOCK": 8192},
                     two_shot=False)
    else:
        text = _ttir(tk.two_shot_kernel, "*bf16",
                     {"RANK": 0, "WORLD": 4, "BLOCK": 8192, "COPY": True}, two_shot=True)
    entry = _function(text, f"@{kernel}_kernel(")
    assert any("tt.call" in line and "block_barrier" in line for line in entry)

    send = [line for line in _function(text, ".send_signal") if "tt.atomic_cas" in line]
    wait = [line for line in _function(text, ".wait_signal") if "tt.atomic_cas" in line]
    assert len(send) == 1 and "tt.atomic_cas release, sys," in send[0], send
    assert len(wait) == 1 and "tt.atomic_cas acquire, sys," in wait[0], wait

    barrier = _function(text, ".block_barrier")
    steps = [("barrier" if line.startswith("gpu.barrier") else
              "send" if "tt.call" in line and ".send_signal" in line else
              "wait" if "tt.call" in line and ".wait_signal" in line else None)
             for line in barrier]
    assert [step for step in steps if step] == ["barrier", "send", "wait", "barrier"], barrier


def test_triton_specialises_a_pointer_on_16_byte_alignment():
    """Lesson 12, "Queued calls, and a plan per tensor": a kernel's compiled variant depends on its
    arguments' addresses: at launch Triton marks a pointer whose address is a multiple of 16
    ("D"), and that mark compiles into the IR as tt.divisibility = 16 on the argument."""
    import torch
    from triton._C.libtriton import native_specialize_impl

    backend = nvidia.CUDABackend
    x = torch.zeros(64)  # a fresh allocation: aligned far beyond 16 bytes
    assert x.data_ptr() % 16 == 0
    # What the launch computes for a tensor argument: (its type, its specialization)
    assert native_specialize_impl(backend, x, False, True, True) == ("*fp32", "D")
    assert native_specialize_impl(backend, x[1:], False, True, True) == ("*fp32", "")  # 4 bytes on
    assert native_specialize_impl(backend, x[4:], False, True, True) == ("*fp32", "D")
    assert backend.parse_attr("D") == [["tt.divisibility", 16]] and backend.parse_attr("") == []

    constexprs = {"RANK": 0, "WORLD": 2, "BLOCK": 8192}
    for attrs, marked in ((None, False), ({(0,): backend.parse_attr("D")}, True)):
        entry = _function(_ttir(tk.one_shot_kernel, "*bf16", constexprs, two_shot=False,
                                attrs=attrs), "@one_shot_kernel(")[0]
        assert ("%x: !tt.ptr<bf16> {tt.divisibility = 16 : i32}" in entry) == marked, entry


def test_tritons_launcher_checks_every_pointer_argument():
    """Lesson 12, "Queued calls, and a plan per tensor": the launcher Triton generates for a kernel
    passes every pointer argument, and only those, through getPointer, which calls data_ptr() on
    a tensor and has the CUDA driver check the address (cuPointerGetAttribute). On a GPU,
    tests/test_12_kernels.py asks the compiled launcher itself."""
    import re

    from triton.backends.nvidia.driver import make_launcher

    for two_shot in (False, True):
        constexprs = {"RANK": 0, "WORLD": 2, "BLOCK": 8192}
        if two_shot:
            constexprs["COPY"] = False
        signature = _signature("*bf16", constexprs, two_shot)
        # As Triton's CudaLauncher calls it: constants keyed by position
        names = list(signature)
        source = make_launcher({(names.index(k),): v for k, v in constexprs.items()},
                               signature, None)
        checked = re.findall(r"getPointer\(_arg(\d+), (\d+)\)", source)
        pointers = [i for i, kind in enumerate(signature.values()) if kind.startswith("*")]
        assert [int(a) for a, _ in checked] == pointers == [0, 1, 2, 3, 4], checked
        assert all(a == b for a, b in checked)
    helper = source[source.index("static inline DevicePtrInfo getPointer"):]
    helper = helper[:helper.index("cleanup:")]
    assert "PyObject_CallMethodNoArgs(obj, data_ptr_str)" in helper
    assert "cuPointerGetAttribute(" in helper and "cannot be accessed from Triton" in helper
    assert helper.index("PyLong_Check(obj)") < helper.index("PyObject_CallMethodNoArgs")
