"""What lessons 12-16 and the docs beside them say about torch and gloo, asked of torch.

Each test asks torch itself (its autograd, its collectives on 2 CPU ranks over gloo, its
flight recorder, ``torchrun``), never dpcourse's re-implementations; dpcourse only starts
the ranks. Each docstring states the fact and names the text that relies on it.
"""

from __future__ import annotations

import math
import os
import pickle
import socket
import subprocess
import sys
import textwrap
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

import dpcourse


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# --------------------------------------------------------------------------- lesson 15


def _flight_record_of_all_reduces(n=5):
    """``n`` all-reduces on the default group; the collectives the flight recorder still holds."""
    for _ in range(n):
        dist.all_reduce(torch.ones(3))
    trace = pickle.loads(torch._C._distributed_c10d._dump_fr_trace())
    return [(e["collective_seq_id"], e["profiling_name"]) for e in trace.get("entries", [])]


def _run_with_recorder_size(monkeypatch, size, n):
    """Launch 2 gloo ranks with TORCH_FR_BUFFER_SIZE=size (None: unset, torch's default).

    The ranks start with this environment; torch reads the variable once per process, when the
    recorder is first used, so each setting needs ranks of its own.
    """
    for name in ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE"):  # the second: an alias
        monkeypatch.delenv(name, raising=False)
    if size is not None:
        monkeypatch.setenv("TORCH_FR_BUFFER_SIZE", str(size))
    return dpcourse.run(_flight_record_of_all_reduces, n, world_size=2, backend="gloo",
                        device="cpu", timeout=120)


def test_flight_recorder_is_a_ring_buffer_of_the_last_buffer_size_collectives(monkeypatch):
    """Lesson 15, section 7: the flight recorder is a ring buffer: with TORCH_FR_BUFFER_SIZE=2,
    after five gloo all-reduces each rank's record holds only the last two (numbers 4 and 5);
    the older entries were overwritten."""
    records = _run_with_recorder_size(monkeypatch, 2, 5)
    for record in records:
        assert record == [(4, "gloo:all_reduce"), (5, "gloo:all_reduce")], records


@pytest.mark.skipif(tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2]) < (2, 13),
                    reason="a statement about torch 2.13")
def test_flight_recorder_records_gloo_by_default_and_size_0_turns_it_off(monkeypatch):
    """Lesson 15, section 7: in torch 2.13 the flight recorder is on by default and records gloo
    collectives: with TORCH_FR_BUFFER_SIZE unset, each rank holds all 3 of its all-reduces;
    with TORCH_FR_BUFFER_SIZE=0 it holds none. torch's default size is 2000 entries."""
    for record in _run_with_recorder_size(monkeypatch, None, 3):
        assert record == [(i, "gloo:all_reduce") for i in (1, 2, 3)], record
    for record in _run_with_recorder_size(monkeypatch, 0, 3):
        assert record == [], record
    # The default, where torch's flight recorder reads the variable (its C++ header ships with
    # torch): TORCH_FR_BUFFER_SIZE, or the older TORCH_NCCL_TRACE_BUFFER_SIZE, else 2000.
    header = (os.path.dirname(torch.__file__)
              + "/include/torch/csrc/distributed/c10d/FlightRecorder.hpp")
    with open(header) as f:
        source = " ".join(f.read().split())
    assert '{"TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE"}, 2000);' in source


# --------------------------------------------------------------------------- lesson 16

_ALWAYS_FAILING = textwrap.dedent("""
    import os, sys, time
    rank, attempt = int(os.environ["RANK"]), int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    open(os.path.join(sys.argv[1], f"rank {rank} attempt {attempt}"), "w").close()
    if rank == 1:
        sys.exit(1)            # fails in every attempt
    time.sleep(120)            # rank 0 would run on for two minutes unless it is stopped
    open(os.path.join(sys.argv[1], f"rank {rank} attempt {attempt} finished"), "w").close()
""")


def test_torchrun_stops_the_other_workers_and_restarts_at_most_max_restarts_times(tmp_path):
    """Lesson 16, "An elastic restart": when one worker exits with an error, torchrun stops the
    others (rank 0, sleeping 120 s, never finishes) and starts them all again, up to
    --max-restarts times: with 1, two attempts of each rank, no third, and torchrun fails."""
    script, seen = tmp_path / "worker.py", tmp_path / "seen"
    script.write_text(_ALWAYS_FAILING)
    seen.mkdir()
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--max-restarts", "1",
                           "--nproc-per-node", "2", "--master-addr", "127.0.0.1", "--master-port",
                           str(_free_port()), str(script), str(seen)], capture_output=True,
                          text=True, timeout=280, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode != 0, proc.stderr[-3000:]
    # No "finished" file: rank 0 was stopped in its sleep each time, not waited for.
    assert sorted(os.listdir(seen)) == ["rank 0 attempt 0", "rank 0 attempt 1",
                                        "rank 1 attempt 0", "rank 1 attempt 1"]


# --------------------------------------------------------------------------- docs/mistakes.md


def test_a_tensor_hook_on_a_parameter_runs_before_the_gradient_reaches_grad():
    """docs/mistakes.md (exercise 06): a hook registered with Tensor.register_hook on a
    parameter receives the gradient before it is accumulated: inside the hook p.grad is still
    None in the first backward, and the previous step's value in a later one."""
    p = torch.nn.Parameter(torch.ones(3))
    seen = []
    p.register_hook(lambda g: seen.append((None if p.grad is None else p.grad.clone(), g.clone())))
    (2 * p).sum().backward()
    (3 * p).sum().backward()
    (grad_then, g1), (grad_later, g2) = seen
    assert grad_then is None and torch.equal(g1, torch.full((3,), 2.0))
    assert torch.equal(grad_later, torch.full((3,), 2.0))        # not yet 2 + 3
    assert torch.equal(g2, torch.full((3,), 3.0)) and torch.equal(p.grad, torch.full((3,), 5.0))


def _reduce_scatter_padded(n):
    """Rank r's output of dist.reduce_scatter_tensor on a tensor of n values padded to N chunks."""
    world, rank = dist.get_world_size(), dist.get_rank()
    chunk = -(-n // world)
    padded = torch.zeros(chunk * world)
    padded[:n] = torch.arange(1.0, n + 1) * (rank + 1)
    out = torch.empty(chunk)
    dist.reduce_scatter_tensor(out, padded)
    return out


def test_reduce_scatter_tensor_gives_rank_r_the_rth_equal_chunk_of_a_padded_tensor():
    """docs/mistakes.md (exercise 04's chunk hint): dist.reduce_scatter_tensor gives rank r the
    sum of elements [r * c, (r + 1) * c) with c = ceil(n / N) of a tensor padded to N * c: every
    chunk as long as the first, the padding (zeros) in the last."""
    n = 5
    outs = dpcourse.run(_reduce_scatter_padded, n, world_size=2, backend="gloo", device="cpu",
                        timeout=120)
    total = torch.arange(1.0, n + 1) * 3          # ranks contribute 1x and 2x
    assert torch.equal(outs[0], total[:3])
    assert torch.equal(outs[1], torch.cat([total[3:], torch.zeros(1)]))


# --------------------------------------------------------------------------- exercises 14 and 16


def test_a_hook_on_a_modules_output_runs_before_that_modules_backward():
    """Exercise 14 (and lesson 14's wrapper): a hook registered on a module's output with
    Tensor.register_hook runs once the output's gradient is known, after the backward of the
    layers that used the output and before the module's own parameters get their gradients."""
    torch.manual_seed(0)
    first, second = torch.nn.Linear(4, 4), torch.nn.Linear(4, 1)
    order = []
    for name, layer in (("first", first), ("second", second)):
        layer.weight.register_post_accumulate_grad_hook(lambda p, name=name: order.append(name))
    hidden = first(torch.randn(2, 4))
    hidden.register_hook(lambda g: order.append("first's output"))
    second(hidden).sum().backward()
    assert order == ["second", "first's output", "first"], order


def test_clip_grad_norm_scales_by_max_norm_over_norm_plus_1e_6_capped_at_1():
    """Exercise 16: clip_grad_norm_ returns the total 2-norm of all gradients together (or the
    largest absolute value for inf) and multiplies every gradient in place by
    min(1, max_norm / (total_norm + 1e-6)). Gradients of about 1e-6 make the 1e-6 visible."""
    grads = [torch.tensor([3e-6, 4e-6]), torch.tensor([12e-6])]    # total 2-norm 13e-6
    params = [torch.nn.Parameter(torch.zeros_like(g)) for g in grads]

    def clip(max_norm, norm_type=2.0):
        for p, g in zip(params, grads):
            p.grad = g.clone()
        return torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type=norm_type)

    total = clip(1e-6)
    assert total.item() == pytest.approx(13e-6, rel=1e-6)
    factor = 1e-6 / (13e-6 + 1e-6)                  # 1/14, where max_norm / total is 1/13
    for p, g in zip(params, grads):
        assert torch.allclose(p.grad, g * factor, rtol=1e-5, atol=0)
    assert clip(1.0).item() == pytest.approx(13e-6, rel=1e-6)       # below max_norm:
    assert all(torch.equal(p.grad, g) for p, g in zip(params, grads))  # factor capped at 1
    assert clip(1.0, norm_type=math.inf).item() == pytest.approx(12e-6, rel=1e-6)


def _dtensor_grad_norms():
    """clip_grad_norm_'s total norm of ones(3) on each rank, placed Replicate() and Shard(0)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    norms = {}
    for placement in (Replicate(), Shard(0)):
        p = torch.nn.Parameter(DTensor.from_local(torch.zeros(3), mesh, [placement]))
        p.grad = DTensor.from_local(torch.ones(3), mesh, [placement])
        total = torch.nn.utils.clip_grad_norm_([p], max_norm=100.0)
        norms[type(placement).__name__] = (type(total).__name__, total.full_tensor().item())
    return norms


def test_clip_grad_norm_of_dtensors_sums_over_shard_placements_not_replicate():
    """Exercise 16's answer: on DTensor gradients clip_grad_norm_ reduces over the mesh dimensions
    the gradient is sharded on and not over those it is replicated on: ones(3) on each of 2 ranks
    has total norm sqrt(6) placed Shard(0) (one tensor of 6 ones), sqrt(3) placed Replicate()."""
    for norms in dpcourse.run(_dtensor_grad_norms, world_size=2, backend="gloo", device="cpu",
                              timeout=120):
        assert norms["Shard"] == ("DTensor", pytest.approx(math.sqrt(6), rel=1e-6)), norms
        assert norms["Replicate"] == ("DTensor", pytest.approx(math.sqrt(3), rel=1e-6)), norms


# --------------------------------------------------------------------------- docs/benchmarks.md


def _recv_into_ones():
    """Rank 0 sends 2s; rank 1 receives them into a tensor of ones."""
    t = torch.ones(4)
    if dist.get_rank() == 0:
        dist.send(torch.full((4,), 2.0), dst=1)
    else:
        dist.recv(t, src=0)
    return t


def test_recv_overwrites_its_buffer_and_adds_nothing():
    """docs/benchmarks.md, the ring against NCCL: dist.recv writes what arrives over its buffer;
    it does not add into it, so a ring built on send/recv adds in a separate operation."""
    _, received = dpcourse.run(_recv_into_ones, world_size=2, backend="gloo", device="cpu",
                               timeout=120)
    assert torch.equal(received, torch.full((4,), 2.0))      # not 1 + 2


def _ddp_python_hooks():
    """Hooks torch DDP leaves on its parameters that Python can see; the gradients it averages."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    model = DDP(torch.nn.Linear(4, 2))
    hooks = [(p._backward_hooks, p._post_accumulate_grad_hooks) for p in model.parameters()]
    x = torch.full((3, 4), float(dist.get_rank() + 1))      # different data on each rank
    model(x).sum().backward()
    return hooks, [p.grad.clone() for p in model.parameters()]


def test_torch_ddp_averages_gradients_without_a_python_hook_on_its_parameters():
    """docs/benchmarks.md, our wrapper against torch DDP: torch DDP registers no Python tensor hook
    and no post-accumulate-grad hook on its parameters, yet
    backward leaves every rank the average of the ranks' gradients."""
    (hooks0, grads0), (hooks1, grads1) = dpcourse.run(_ddp_python_hooks, world_size=2,
                                                      backend="gloo", device="cpu", timeout=120)
    for backward_hooks, post_hooks in hooks0 + hooks1:
        assert not backward_hooks and not post_hooks, (backward_hooks, post_hooks)
    weight_grad = torch.full((2, 4), 3 * (1.0 + 2.0) / 2)    # rows of 1s and 2s, 3 each, averaged
    assert torch.equal(grads0[0], weight_grad) and torch.equal(grads1[0], weight_grad)
    assert torch.equal(grads0[1], torch.full((2,), 3.0))


# ------------------------------------------------------------------ docs/mistakes.md, torch DDP


def _torch_ddp_on_different_models(kind):
    """Wrap a model that differs between the ranks in torch DDP; the error this rank gets."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    rank = dist.get_rank()
    if kind == "shapes":
        model = torch.nn.Linear(4, 3 if rank == 0 else 5)
    else:  # "count": 2 layers (4 parameters) on rank 0, 3 layers (6) on rank 1
        model = torch.nn.Sequential(*[torch.nn.Linear(4, 4) for _ in range(2 + rank)])
    # a group with a short timeout: the rank that passes the check then waits for its peer
    # in the parameters' broadcast, and gives up after 5 s instead of the default 30 minutes
    group = dist.new_group(backend="gloo", timeout=timedelta(seconds=5))
    try:
        DDP(model, process_group=group)
    except RuntimeError as err:
        return str(err)
    return "wrapped"


def test_torch_ddp_refuses_different_models_with_these_messages():
    """docs/mistakes.md, "The data-parallel wrappers": torch DDP refuses models that differ between
    the ranks at construction, with the messages quoted there: for a shape, rank 1 says
    "[1]: params[0] in this process with sizes [5, 4] appears not to match sizes of the same param
    in process 0."; for a count, "DDP expects same model across all ranks, but Rank 1 has 6
    params, while rank 0 has inconsistent 4 params."."""
    shapes = dpcourse.run(_torch_ddp_on_different_models, "shapes", world_size=2, backend="gloo",
                          device="cpu", timeout=120)
    assert ("[1]: params[0] in this process with sizes [5, 4] appears not to match sizes of the"
            " same param in process 0.") in shapes[1], shapes
    count = dpcourse.run(_torch_ddp_on_different_models, "count", world_size=2, backend="gloo",
                         device="cpu", timeout=120)
    assert any("DDP expects same model across all ranks, but Rank 1 has 6 params, while rank 0 "
               "has inconsistent 4 params." in msg for msg in count), count


# ---- README and docs


def _all_reduce_3_against_4(timeout_s):
    """All-reduce 3 elements on rank 0 and 4 on rank 1 in a group with ``timeout_s``; the error."""
    group = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))
    try:
        dist.all_reduce(torch.ones(3 + dist.get_rank()), group=group)
    except RuntimeError as err:
        return str(err)
    return None


def test_detail_fails_a_shape_mismatch_on_every_rank_naming_both_shapes_before_the_timeout():
    """README, claim 24: under TORCH_DISTRIBUTED_DEBUG=DETAIL an all-reduce of 3 elements against
    4 fails on both ranks with torch's mismatch message, which names each rank's operation and
    shape, instead of waiting for the group's 60 s timeout (no "Timed out" in either error; a
    rank that waited for the timeout would also outlast this launch's 45 s)."""
    saved = os.environ.get("TORCH_DISTRIBUTED_DEBUG")
    os.environ["TORCH_DISTRIBUTED_DEBUG"] = "DETAIL"   # read when a rank starts
    try:
        errors = dpcourse.run(_all_reduce_3_against_4, 60, world_size=2, backend="gloo",
                              device="cpu", timeout=45)
    finally:
        os.environ.pop("TORCH_DISTRIBUTED_DEBUG")
        if saved is not None:
            os.environ["TORCH_DISTRIBUTED_DEBUG"] = saved
    for e in errors:
        assert e is not None and "Detected mismatch between collectives on ranks" in e, errors
        assert e.count("OpType=ALLREDUCE") == 2, e
        assert "TensorShape=[3]" in e and "TensorShape=[4]" in e and "Timed out" not in e, e


def _reducer_ops_in_backward():
    """Profiler counts of a torch DDP backward (after the first, which rebuilds the buckets)."""
    from collections import Counter

    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.profiler import ProfilerActivity, profile

    torch.manual_seed(0)
    model = DDP(torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 1)))
    x = torch.randn(4, 8)
    model(x).sum().backward()
    for p in model.parameters():
        p.grad = None
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        model(x).sum().backward()
    names = Counter(e.name for e in prof.events())
    kept = ("torch::distributed::reducer::mul_out", "aten::mul",
            "torch::distributed::reducer::copy_")
    return {k: names[k] for k in kept}, len(list(model.parameters()))


def test_ddp_writes_each_gradient_times_one_over_world_size_into_its_bucket_in_one_op():
    """docs/benchmarks.md, "dividing as the hook copies": with its defaults torch DDP's reducer
    puts each gradient into its bucket with one mul_out (the gradient times 1/world size, written
    straight into the bucket: one read and one write of the gradient), once per parameter, and
    never with a plain copy (its reducer::copy_ range, the path without that multiplication)."""
    for counts, n in dpcourse.run(_reducer_ops_in_backward, world_size=2, backend="gloo",
                                  device="cpu", timeout=120):
        assert n == 4
        assert counts == {"torch::distributed::reducer::mul_out": n, "aten::mul": n,
                          "torch::distributed::reducer::copy_": 0}, counts


_LOAD_ONE_BATCH = textwrap.dedent("""
    import os, stat, torch
    from torch.utils.data import DataLoader, Dataset

    class Rows(Dataset):
        def __len__(self):
            return 4
        def __getitem__(self, i):
            return torch.full((3,), float(i))

    def sockets(root):
        return sorted(os.path.relpath(os.path.join(d, f), root) for d, _, files in os.walk(root)
                      for f in files if stat.S_ISSOCK(os.lstat(os.path.join(d, f)).st_mode))

    print("strategy", torch.multiprocessing.get_sharing_strategy())
    try:
        batches = iter(DataLoader(Rows(), batch_size=2, num_workers=1, timeout=5))
        batch = next(batches)   # the worker, kept alive by the iterator, still holds its socket
        print("batch", batch[:, 0].tolist(), "sockets", sockets(os.environ["TMPDIR"]))
    except RuntimeError as err:
        print("error", err)
""")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux's sharing strategy")
def test_dataloader_workers_hand_batches_over_af_unix_sockets_made_under_tmpdir(tmp_path):
    """docs/mistakes.md, DataLoader workers under a long TMPDIR: a worker hands each batch over an
    AF_UNIX socket that multiprocessing makes in a pymp-* folder under TMPDIR (torch's sharing
    strategy on Linux is file_descriptor). Where that socket's path is too long to bind, no error
    reaches the loading process: it waits for the batch until the DataLoader's own timeout (5 s
    here; by default it has none), while the worker's traceback says the path is too long."""
    import ast
    import tempfile

    def load(tmpdir):
        return subprocess.run([sys.executable, "-c", _LOAD_ONE_BATCH], capture_output=True,
                              text=True, timeout=120, env=dict(os.environ, TMPDIR=tmpdir))

    with tempfile.TemporaryDirectory(dir="/tmp") as short:
        out = load(short)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.splitlines()
    assert lines[0] == "strategy file_descriptor", out.stdout
    batch, found = lines[1].split(" sockets ")
    assert batch == "batch [0.0, 1.0]", out.stdout
    sockets = ast.literal_eval(found)      # a printed list of relative paths
    assert sockets and all(s.startswith("pymp-") and "/listener-" in s for s in sockets), sockets

    long_dir = tmp_path / ("t" * max(1, 110 - len(str(tmp_path))))   # socket paths past 107
    long_dir.mkdir()
    out = load(str(long_dir))
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.splitlines()[1] == "error DataLoader timed out after 5 seconds", out.stdout
    assert "AF_UNIX path too long" in out.stderr, out.stderr[-3000:]


def test_a_collective_without_a_process_group_says_the_default_group_is_not_initialized():
    """docs/mistakes.md (a ring that reaches torch's real module): in a process that never called
    init_process_group, dist.all_reduce raises "Default process group has not been initialized"."""
    code = ("import torch, torch.distributed as dist\n"
            "try:\n"
            "    dist.all_reduce(torch.ones(1))\n"
            "except Exception as err:\n"
            "    print(type(err).__name__, err)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "Default process group has not been initialized" in out.stdout, out.stdout
