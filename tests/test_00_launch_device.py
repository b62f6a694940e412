"""dpcourse.run(device="cpu") hides the GPUs from the ranks; the more-ranks-than-cores warning
points at the caller's line (a notebook cell by its name, not its file) and the grader's own
launches do not give it.

Rank functions live at module level so that the worker processes can import them.
"""

from __future__ import annotations

import os
import re
import warnings

import pytest
import torch
import torch.distributed as dist

import dpcourse
from dpcourse.device import rank_device, visible_gpus
from dpcourse.launch import resources

pytestmark = pytest.mark.usefixtures("no_leaked_processes")

CVD = "CUDA_VISIBLE_DEVICES"


def what_the_rank_sees():
    t = torch.ones(2, device=rank_device())  # NCCL reduces GPU tensors only
    dist.all_reduce(t)
    return {"backend": dist.get_backend(), "cuda_available": torch.cuda.is_available(),
            "device_count": torch.cuda.device_count(), "cvd": os.environ.get(CVD, "<unset>"),
            "sum": t.tolist()}


def test_device_cpu_hides_every_gpu_from_every_rank():
    ours = os.environ.get(CVD, "<unset>")
    seen = dpcourse.run(what_the_rank_sees, world_size=2, device="cpu")  # backend "auto"
    for r in seen:
        assert r["cuda_available"] is False and r["device_count"] == 0
        assert r["cvd"] == "" and r["backend"] == "gloo" and r["sum"] == [2.0, 2.0]
    assert os.environ.get(CVD, "<unset>") == ours  # only the ranks' environment changed


def test_without_device_the_ranks_environment_is_unchanged():
    parent = os.environ.get(CVD, "<unset>")
    seen = dpcourse.run(what_the_rank_sees, world_size=2, backend="gloo")
    for r in seen:
        assert r["cvd"] == parent
        assert r["device_count"] == visible_gpus()


@pytest.mark.gpu
def test_device_cpu_on_a_gpu_machine_runs_gloo_where_auto_runs_nccl():
    assert dpcourse.run(what_the_rank_sees, world_size=1)[0]["backend"] == "nccl"
    seen = dpcourse.run(what_the_rank_sees, world_size=1, device="cpu")[0]
    assert seen["backend"] == "gloo" and seen["device_count"] == 0


def test_device_cpu_resolves_to_gloo_whatever_gpus_this_process_sees(monkeypatch):
    monkeypatch.setattr("dpcourse.device.visible_gpus", lambda: 4)
    assert dpcourse.resolve_backend("auto", None) == ("nccl", 4)
    assert dpcourse.resolve_backend("auto", None, "cpu") == ("gloo", 2)
    assert dpcourse.resolve_backend("gloo", 3, device="cpu") == ("gloo", 3)


# (GPUs visible, world_size asked) -> (backend, world_size, GPUs hidden from the ranks, line printed)
RANK_RULE = [
    (0, None, ("gloo", 2, False), "2 ranks over gloo on CPU: this machine has no GPU"),
    (0, 4, ("gloo", 4, False), "4 ranks over gloo on CPU: this machine has no GPU"),
    (1, None, ("gloo", 2, True),
     "2 ranks over gloo on CPU: this machine has 1 GPU, and data parallelism needs 2 or more"),
    (1, 4, ("gloo", 4, True), "4 ranks over gloo on CPU: this machine has 1 GPU, fewer than 4"),
    (1, 1, ("nccl", 1, False), "1 rank over nccl, one GPU per rank: this machine has 1 GPU"),
    (2, None, ("nccl", 2, False), "2 ranks over nccl, one GPU per rank: this machine has 2 GPUs"),
    (2, 4, ("gloo", 4, True), "4 ranks over gloo on CPU: this machine has 2 GPUs, fewer than 4"),
    (4, None, ("nccl", 4, False), "4 ranks over nccl, one GPU per rank: this machine has 4 GPUs"),
    (4, 2, ("nccl", 2, False), "2 ranks over nccl, one GPU per rank: this machine has 4 GPUs"),
]


@pytest.mark.parametrize("gpus, world_size, expected, line", RANK_RULE,
                         ids=[f"{g}gpu-ws{w}" for g, w, _, _ in RANK_RULE])
def test_a_lesson_gets_the_ranks_it_needs_on_every_machine(monkeypatch, gpus, world_size,
                                                          expected, line):
    monkeypatch.setattr("dpcourse.device.visible_gpus", lambda: gpus)
    plan = dpcourse.plan_ranks(world_size)
    assert (plan.backend, plan.world_size, plan.hide_gpus) == expected
    assert str(plan) == line
    assert dpcourse.resolve_backend("auto", world_size) == expected[:2]
    monkeypatch.setattr("dpcourse.device.visible_gpus", lambda: 3)  # gpus= wins over this machine
    assert dpcourse.plan_ranks(world_size, gpus=gpus) == plan


@pytest.mark.parametrize("gpus", [0, 1, 2, 4, 8])
def test_the_default_world_is_never_a_single_rank(monkeypatch, gpus):
    monkeypatch.setattr("dpcourse.device.visible_gpus", lambda: gpus)
    assert dpcourse.plan_ranks().world_size >= 2


def test_cpu_ranks_chosen_because_gpus_are_too_few_see_no_gpu(monkeypatch):
    """The ranks of a gloo fallback are started with every GPU hidden, as on a CPU machine."""
    import dpcourse.launch.launcher as launcher

    monkeypatch.setattr("dpcourse.device.visible_gpus", lambda: 1)
    started = {}

    class FakeLaunch:
        def __init__(self, spec, timeout, prefix_output):
            started["spec"] = spec

        def start(self):
            pass

        def wait(self):
            return ["ok"] * started["spec"].world_size

        def stop(self):
            pass

    monkeypatch.setattr(launcher, "Launch", FakeLaunch)
    assert dpcourse.run(noop) == ["ok", "ok"]
    spec = started["spec"]
    assert (spec.backend, spec.world_size, spec.hide_gpus) == ("gloo", 2, True)
    dpcourse.run(noop, backend="gloo", world_size=3)
    assert started["spec"].hide_gpus is False  # asked for gloo: the ranks keep seeing the GPUs


def noop():
    return None


@pytest.mark.parametrize("device", ["gpu", "cuda", "CPU", None, 0, torch.device("cpu")])
def test_bad_device_says_which_values_work(device):
    with pytest.raises(ValueError, match=r"unknown device .*device='auto' .*device='cpu'"):
        dpcourse.run(what_the_rank_sees, world_size=2, device=device)


def test_device_cpu_with_nccl_is_refused_saying_what_to_do():
    with pytest.raises(ValueError, match=r"device='cpu' hides every GPU.*backend='gloo'.*"
                                         r"device='auto'"):
        dpcourse.run(what_the_rank_sees, world_size=2, backend="nccl", device="cpu")


def _returns_one() -> int:
    return 1


def test_more_ranks_than_cores_warning_points_at_the_callers_line(monkeypatch):
    monkeypatch.setattr(resources.os, "cpu_count", lambda: 1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        line = _line_after_this() + 1
        assert dpcourse.run(_returns_one, world_size=2, backend="gloo") == [1, 1]
    [w] = [w for w in caught if issubclass(w.category, RuntimeWarning)]
    assert issubclass(w.category, resources.OversubscriptionWarning)
    assert "2 ranks on 1 CPU core" in str(w.message)
    assert (w.filename, w.lineno) == (__file__, line)


def _line_after_this() -> int:
    import sys

    return sys._getframe(1).f_lineno


def test_no_warning_inside_expected_oversubscription(monkeypatch):
    monkeypatch.setattr(resources.os, "cpu_count", lambda: 1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        resources.check_resources(2, "gloo")  # the control: warns
        with resources.expected_oversubscription():
            resources.check_resources(2, "gloo")
        resources.check_resources(2, "gloo")  # and again after the block
    assert [issubclass(w.category, resources.OversubscriptionWarning) for w in caught] == [True] * 2


def test_the_graders_ranks_give_no_oversubscription_warning(monkeypatch):
    """Exercise 13's check runs 3 ranks: on fewer cores, the learner must not hear of it."""
    from dpcourse.grading import check

    monkeypatch.setattr(resources.os, "cpu_count", lambda: 1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = check("sharded_step", _returns_one, quiet=True)
    assert "TypeError" in result.criterion("shard_gradients_averaged").detail  # it did run
    assert not [w for w in caught if issubclass(w.category, RuntimeWarning)]


CELL = """import dpcourse
from dpcourse.launch import resources
resources.os.cpu_count = lambda: 1   # this kernel only: two ranks now outnumber the cores
def one():
    return 1
print(dpcourse.run(one, world_size=2, backend="gloo"))
"""


def test_warning_in_a_notebook_names_the_cell_not_its_file():
    jupyter_client = pytest.importorskip("jupyter_client")

    km = jupyter_client.KernelManager(kernel_name="python3")
    km.start_kernel(cwd=os.path.dirname(os.path.abspath(__file__)))
    kc = km.client()
    kc.start_channels()
    try:
        kc.wait_for_ready(timeout=120)
        msg_id = kc.execute(CELL)
        out, err = [], []
        while True:
            msg = kc.get_iopub_msg(timeout=180)
            if msg["parent_header"].get("msg_id") != msg_id:
                continue
            if msg["msg_type"] == "stream":
                (out if msg["content"]["name"] == "stdout" else err).append(msg["content"]["text"])
            if msg["msg_type"] == "status" and msg["content"]["execution_state"] == "idle":
                break
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)
    err = "".join(err)
    assert "[1, 1]" in "".join(out)
    assert re.match(r"Cell In\[1\]:6: OversubscriptionWarning: 2 ranks on 1 CPU core", err), err
    assert "ipykernel" not in err and os.sep not in err.split("OversubscriptionWarning")[0]
