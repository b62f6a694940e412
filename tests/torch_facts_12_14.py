"""What torch and NCCL do, as lessons 12-14 say it: each test asks torch itself.

Self-contained: CPU tests start their ranks with ``torch.multiprocessing`` over gloo, GPU tests
(``@pytest.mark.gpu``) start plain subprocesses over NCCL, one GPU each. NVLink multicast stays
off in every NCCL run (``NCCL_NVLS_ENABLE=0``, ``TORCH_SYMM_MEM_DISABLE_MULTICAST=1``).
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# -- CPU: fully_shard's mixed-precision policy (lesson 14) ------------------------------------


class _CollectiveDtypes(TorchDispatchMode):
    """Record every c10d operator torch dispatches, with the dtypes of its tensors."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func)
        if name.startswith("c10d."):
            tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
            self.calls.append((name.split(".")[1], {t.dtype for t in tensors}))
        return func(*args, **(kwargs or {}))


def _fully_shard_bf16(rank: int, world: int, port: int, queue) -> None:
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    try:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
        fully_shard(model, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                                          reduce_dtype=torch.bfloat16))
        with _CollectiveDtypes() as seen:
            out = model(torch.randn(4, 8))
            out.float().pow(2).mean().backward()
        queue.put((rank, {"calls": seen.calls, "output": out.dtype,
                          "shards": [(p.dtype, p.grad.to_local().dtype) for p in model.parameters()]}))
    finally:
        dist.destroy_process_group()


def test_fully_shard_bf16_policy_reduces_gradients_in_bf16_into_fp32_shards():
    """param_dtype=reduce_dtype=bf16: gather and reduce-scatter move bf16, the fp32 shards get fp32 grads."""
    world, ctx = 2, mp.get_context("spawn")
    queue, port = ctx.Queue(), _free_port()
    procs = [ctx.Process(target=_fully_shard_bf16, args=(r, world, port, queue)) for r in range(world)]
    for p in procs:
        p.start()
    results = dict(queue.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    for r in results.values():
        ops = {name for name, _ in r["calls"]}
        assert {"_allgather_base_", "_reduce_scatter_base_"} <= ops, r["calls"]
        for name, dtypes in r["calls"]:
            if name in ("_allgather_base_", "_reduce_scatter_base_"):
                assert dtypes == {torch.bfloat16}, (name, dtypes)   # gathered and reduced in bf16
        assert r["output"] == torch.bfloat16                          # the forward computed in bf16
        assert r["shards"] and all(p == g == torch.float32 for p, g in r["shards"])  # fp32 master shards


# -- CPU: PyTorch's symmetric-memory all-reduce operators (lesson 12) -------------------------


def test_symm_mem_all_reduce_operators_exist_with_these_signatures():
    """torch.ops.symm_mem.one_shot_all_reduce returns a new tensor; two_shot_all_reduce_ works in place."""
    one = torch.ops.symm_mem.one_shot_all_reduce.default._schema
    two = torch.ops.symm_mem.two_shot_all_reduce_.default._schema
    assert [a.name for a in one.arguments] == ["input", "reduce_op", "group_name"]
    assert [a.name for a in two.arguments] == ["input", "reduce_op", "group_name"]
    assert two.arguments[0].alias_info is not None and two.arguments[0].alias_info.is_write
    assert one.arguments[0].alias_info is None


# -- GPUs: NCCL (lessons 12 and 13) -----------------------------------------------------------


def _nccl_ranks(body: str, tmp_path, env: dict | None = None, world: int = 2) -> list[str]:
    """Run ``body`` on ``world`` ranks over NCCL (rank r on cuda:r); return each rank's stdout."""
    script = textwrap.dedent("""
        import os, torch, torch.distributed as dist
        rank = int(os.environ["RANK"])
        torch.cuda.set_device(rank)
        dist.init_process_group("nccl", device_id=torch.device("cuda", rank))
        try:
        {body}
        finally:
            dist.destroy_process_group()
    """).format(body=textwrap.indent(textwrap.dedent(body), "    "))
    port = _free_port()
    base = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
            "WORLD_SIZE": str(world), "NCCL_NVLS_ENABLE": "0",
            "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", **(env or {})}
    procs = [subprocess.Popen([sys.executable, "-c", script], env={**base, "RANK": str(r)},
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              cwd=tmp_path) for r in range(world)]
    outs = [p.communicate(timeout=180)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), outs
    return outs


@pytest.mark.gpu(2)
def test_nccl_reads_nvls_enable_from_the_environment(tmp_path):
    """NCCL_NVLS_ENABLE=0 reaches NCCL: its ENV log says it was set by the environment to 0."""
    env = {"NCCL_DEBUG": "INFO", "NCCL_DEBUG_SUBSYS": "ENV",
           "NCCL_DEBUG_FILE": str(tmp_path / "nccl.%p.log")}
    _nccl_ranks("""
        t = torch.ones(1 << 20, device="cuda")
        dist.all_reduce(t)
        torch.cuda.synchronize()
    """, tmp_path, env)
    logs = [p.read_text() for p in tmp_path.glob("nccl.*.log")]
    assert len(logs) == 2
    assert all("NCCL_NVLS_ENABLE set by environment to 0" in log for log in logs), logs


@pytest.mark.gpu(2)
def test_nccl_all_reduce_refuses_cpu_tensors(tmp_path):
    """Over NCCL, dist.all_reduce of a CPU tensor raises: NCCL moves GPU tensors only."""
    outs = _nccl_ranks("""
        try:
            dist.all_reduce(torch.ones(4))
            print("reduced")
        except (RuntimeError, ValueError) as exc:
            print("refused:", type(exc).__name__)
    """, tmp_path)
    assert all("refused:" in out and "reduced" not in out for out in outs), outs


@pytest.mark.gpu(2)
def test_symm_mem_rendezvous_maps_every_peers_buffer(tmp_path):
    """After rendezvous a rank has a pointer per rank to its buffer and signal pad, reads a peer's data,
    and finds its signal pad zeroed; symm_mem's one-shot all-reduce sums a symmetric tensor and
    refuses an ordinary one."""
    outs = _nccl_ranks("""
        import torch.distributed._symmetric_memory as symm_mem
        world, group_name = dist.get_world_size(), dist.group.WORLD.group_name
        buf = symm_mem.empty(16, dtype=torch.float32, device="cuda")
        handle = symm_mem.rendezvous(buf, group_name)
        pad = handle.get_signal_pad(rank, (handle.signal_pad_size // 4,), torch.int32)
        print("pad zero", bool(pad.eq(0).all().item()))
        buf.fill_(float(rank + 1))
        torch.cuda.synchronize()
        dist.barrier()
        peer = (rank + 1) % world
        seen = handle.get_buffer(peer, (16,), torch.float32).clone()
        torch.cuda.synchronize()
        dist.barrier()
        print("ptrs", len(handle.buffer_ptrs), len(handle.signal_pad_ptrs), "peer", seen[0].item())
        total = torch.ops.symm_mem.one_shot_all_reduce(buf, "sum", group_name)
        torch.cuda.synchronize()
        print("one-shot sum", total[0].item())
        try:
            torch.ops.symm_mem.one_shot_all_reduce(torch.ones(16, device="cuda"), "sum", group_name)
            torch.cuda.synchronize()
            print("ordinary tensor: reduced")
        except RuntimeError:
            print("ordinary tensor: refused")
        dist.barrier()
    """, tmp_path)
    for r, out in enumerate(outs):
        assert "pad zero True" in out, outs
        assert f"ptrs 2 2 peer {float((r + 1) % 2 + 1)}" in out, outs
        assert "one-shot sum 3.0" in out and "ordinary tensor: refused" in out, outs


@pytest.mark.gpu(2)
def test_nccl_kernel_time_includes_waiting_for_a_late_rank(tmp_path):
    """CUDA events around an NCCL all-reduce on the punctual rank span the late rank's delay."""
    outs = _nccl_ranks("""
        import time
        t = torch.ones(1024, device="cuda")
        dist.all_reduce(t)   # warm-up: the communicator is set up
        torch.cuda.synchronize()
        dist.barrier()
        torch.cuda.synchronize()
        if rank == 1:
            time.sleep(0.5)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dist.all_reduce(t)
        end.record()
        torch.cuda.synchronize()
        print("gpu ms", start.elapsed_time(end))
    """, tmp_path)
    ms = [float(out.split("gpu ms")[1].split()[0]) for out in outs]
    assert ms[0] > 300 and ms[1] < 100, ms   # rank 0's collective ran while rank 1 slept


def test_meta_device_records_shapes_and_dtypes_without_data():
    """Under torch.device("meta") modules get parameters of the right shape and dtype, and no data."""
    with torch.device("meta"):
        layer = torch.nn.Linear(1000, 500)
    assert all(p.is_meta for p in layer.parameters())
    assert layer.weight.shape == (500, 1000) and layer.weight.dtype == torch.float32
    with pytest.raises((NotImplementedError, RuntimeError)):
        layer.weight.tolist()   # there are no values to read
