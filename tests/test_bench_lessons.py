"""The GPU recordings the lessons draw from: reading them, and turning a profiler trace into lanes."""

import json

import pytest

from dpcourse.bench.chrome_trace import gpu_timeline
from dpcourse.bench.recorded import hardware, load_recording


def _trace(tmp_path):
    """A tiny Chrome trace: forward, backward and optimizer ranges, four kernels, one of them NCCL."""
    events = [
        {"cat": "user_annotation", "name": "forward", "ts": 0, "dur": 10},
        {"cat": "user_annotation", "name": "backward", "ts": 10, "dur": 20},
        {"cat": "user_annotation", "name": "optimizer", "ts": 30, "dur": 5},
        {"cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": 1, "args": {"correlation": 1}},
        {"cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": 12, "args": {"correlation": 2}},
        {"cat": "cuda_driver", "name": "cuLaunchKernelEx", "ts": 14, "args": {"correlation": 3}},
        {"cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": 31, "args": {"correlation": 4}},
        {"cat": "kernel", "name": "gemm", "ts": 100, "dur": 50, "args": {"correlation": 1, "stream": 7}},
        {"cat": "kernel", "name": "gemm_bwd", "ts": 150, "dur": 100, "args": {"correlation": 2, "stream": 7}},
        {"cat": "kernel", "name": "ncclDevKernel_AllReduce_Sum_f32_RING_LL(x)", "ts": 200, "dur": 80,
         "args": {"correlation": 3, "stream": 17}},
        {"cat": "kernel", "name": "adamw", "ts": 290, "dur": 10, "args": {"correlation": 4, "stream": 7}},
    ]
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"traceEvents": events}))
    return str(path)


def test_gpu_timeline_places_kernels_by_launch_phase(tmp_path):
    out = gpu_timeline(_trace(tmp_path))
    spans = {name: (start, end) for name, start, end in out["spans"]}
    assert spans["forward"] == pytest.approx((0.0, 50e-6))
    assert spans["backward"] == pytest.approx((50e-6, 150e-6))
    assert spans["optimizer"] == pytest.approx((190e-6, 200e-6))
    assert len(out["events"]) == 1
    nccl = out["events"][0]
    assert (nccl["start"], nccl["end"], nccl["stream"]) == pytest.approx((100e-6, 180e-6, 17))
    assert out["n_kernels"] == 4


def test_gpu_timeline_without_kernels_says_so(tmp_path):
    path = tmp_path / "empty.json"
    path.write_text(json.dumps({"traceEvents": []}))
    assert "error" in gpu_timeline(str(path))


def test_every_lesson_recording_names_its_hardware():
    for lesson in ("05", "06", "08", "09"):
        data = load_recording(lesson)
        env = data["environment"]
        assert env["gpus"] and env["nccl"] and env["torch"]
        assert data["hardware"].startswith(f"{len(env['gpus'])} x {env['gpus'][0]}")


def test_missing_recording_says_how_to_make_it(tmp_path):
    with pytest.raises(FileNotFoundError, match="dpcourse.bench.lessons"):
        load_recording("05", results_dir=tmp_path)
    assert hardware({}).startswith("1 x CPU")
