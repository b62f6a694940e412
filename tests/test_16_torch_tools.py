"""What lesson 16 says about torch's own tools, asked of torch itself.

The 4-rank probes (HSDP on a 2 x 2 mesh, clipping, DCP save) run in one launch and
the 2-rank probes (ZeroRedundancyOptimizer, resharding, mixed precision, DCP load,
DDPOptimizer) in another (module fixtures), so the file stays fast on a small CPU
machine; each test then checks one statement. The collectives are read by wrapping
the functions of ``torch.distributed`` that torch's FSDP calls. The last test
runs ``torchrun`` itself.
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

import dpcourse
from dpcourse.torch_tools import saved_tensor_bytes, trace_collectives


def _mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))


def _batch(step, n=16):
    g = torch.Generator().manual_seed(step)
    return torch.randn(n, 16, generator=g), torch.randn(n, 4, generator=g)


def _four_ranks(folder):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    model = _mlp()
    fully_shard(model, mesh=mesh)
    x, y = (t.chunk(4)[dist.get_rank()] for t in _batch(0))
    with trace_collectives() as events:
        torch.nn.functional.mse_loss(model(x), y).backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=0.1)
    dcp.save(get_model_state_dict(model), checkpoint_id=folder)
    return dict(mesh=mesh.mesh.tolist(), events=events, norm_type=type(norm).__name__,
                norm=norm.full_tensor(), grads=[p.grad.full_tensor() for p in model.parameters()],
                placements=[(str(p.placements), tuple(p.to_local().shape), tuple(p.shape))
                            for p in model.parameters()],
                full=[p.full_tensor() for p in model.parameters()], files=sorted(os.listdir(folder)))


def _zero_share():
    from torch.distributed.optim import ZeroRedundancyOptimizer

    model = _mlp()
    opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.Adam, lr=0.01)
    torch.nn.functional.mse_loss(model(_batch(0)[0]), _batch(0)[1]).backward()
    opt.step()
    held = [id(p) for p in opt.optim.state]
    return dict(mine=[i for i, p in enumerate(model.parameters()) if id(p) in held],
                total=len(list(model.parameters())))


def _gathers_per_step(reshard):
    from torch.distributed.fsdp import fully_shard

    model = _mlp()
    fully_shard(model[0], reshard_after_forward=reshard)
    fully_shard(model)
    x, y = _batch(0, 8)
    torch.nn.functional.mse_loss(model(x), y).backward()   # first step: lazy initialisation
    with trace_collectives() as events:
        torch.nn.functional.mse_loss(model(x), y).backward()
    return sum(e["op"] == "all_gather" for e in events)


def _mixed(reduce_dtype):
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    model = _mlp()
    fully_shard(model, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=reduce_dtype))
    seen = []
    model[0].register_forward_pre_hook(lambda m, a: seen.append(m.weight.dtype))
    x, y = _batch(0, 8)
    with trace_collectives() as events:
        torch.nn.functional.mse_loss(model(x).float(), y).backward()
    return dict(forward=seen[0], wire={e["op"]: e["dtype"] for e in events},
                grad=model[0].weight.grad.dtype)


def _dcp_load(folder):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict
    from torch.distributed.fsdp import fully_shard

    model = _mlp()
    fully_shard(model)
    state = get_model_state_dict(model)
    dcp.load(state, checkpoint_id=folder)
    set_model_state_dict(model, state)
    return [p.full_tensor() for p in model.parameters()]


class _Net(torch.nn.Module):
    def __init__(self, n=8):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(256, 256) for _ in range(n))

    def forward(self, x):
        for layer in self.layers:
            x = torch.relu(layer(x))
        return x


def _graphs(optimize_ddp, cap_mb, layers=8):
    import torch._dynamo

    torch._dynamo.reset()
    torch._dynamo.config.optimize_ddp = optimize_ddp
    torch.manual_seed(0)
    ddp = torch.nn.parallel.DistributedDataParallel(_Net(layers), bucket_cap_mb=cap_mb)
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(sum(1 for n in gm.graph.nodes if n.op == "placeholder"))
        return gm.forward

    torch.compile(ddp, backend=backend)(torch.randn(4, 256)).sum().backward()
    return graphs


def _two_ranks(folder):
    return dict(zero=_zero_share(), gathers={r: _gathers_per_step(r) for r in (True, False)},
                mixed={d: _mixed(d) for d in (torch.float32, torch.bfloat16)}, loaded=_dcp_load(folder),
                graphs={(on, cap, n): _graphs(on, cap, n) for on, cap, n in ((True, 1, 8), (True, 2, 16),
                                                                          (False, 1, 8))})


@pytest.fixture(scope="module")
def probes(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("dcp"))
    four = dpcourse.run(_four_ranks, folder, world_size=4, device="cpu", timeout=240)
    two = dpcourse.run(_two_ranks, folder, world_size=2, device="cpu", timeout=240)
    return four, two


def test_zero_redundancy_optimizer_keeps_state_for_its_share_only(probes):
    """Each rank's inner optimizer holds state for a disjoint part of the parameters; together all."""
    shares = [r["zero"]["mine"] for r in probes[1]]
    assert all(shares) and not set(shares[0]) & set(shares[1])
    assert sorted(shares[0] + shares[1]) == list(range(probes[1][0]["zero"]["total"]))


def test_reshard_after_forward_false_gathers_once_per_step(probes):
    """A unit with reshard_after_forward=False is all-gathered once per step, not twice."""
    for r in probes[1]:
        # True: the inner unit twice (forward, backward) and the root once; False: each once.
        assert r["gathers"][True] == 3 and r["gathers"][False] == 2, r["gathers"]


def test_hsdp_places_parameters_replicate_then_shard(probes):
    """fully_shard on a 2-D mesh: placements (Replicate(), Shard(0)); ranks laid out row by row."""
    for r in probes[0]:
        assert r["mesh"] == [[0, 1], [2, 3]]
        for placement, local, full in r["placements"]:
            assert placement == "(Replicate(), Shard(dim=0))" and 2 * local[0] == full[0]


def test_hsdp_reduce_scatters_in_shard_group_then_all_reduces_across(probes):
    """One HSDP step: all-gather and reduce-scatter in the row, then an all-reduce of the shard in the column."""
    for rank, r in enumerate(probes[0]):
        row, col = divmod(rank, 2)
        ops = [(e["op"], e["ranks"]) for e in r["events"]]
        assert ops == [("all_gather", [2 * row, 2 * row + 1]), ("reduce_scatter", [2 * row, 2 * row + 1]),
                       ("all_reduce", [col, col + 2])]
        assert r["events"][2]["nbytes"] * 2 == r["events"][1]["nbytes"]


def test_clip_grad_norm_of_dtensor_grads_equals_one_process(probes):
    """clip_grad_norm_ returns a DTensor total norm; norm and clipped gradients equal one process's."""
    model = _mlp()
    x, y = _batch(0)
    torch.nn.functional.mse_loss(model(x), y).backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=0.1)
    assert norm > 0.1   # the clipping changes the gradients
    for r in probes[0]:
        assert r["norm_type"] == "DTensor"
        assert torch.allclose(r["norm"], norm, rtol=1e-6, atol=0)
        for got, p in zip(r["grads"], model.parameters()):
            assert torch.allclose(got, p.grad, rtol=1e-5, atol=1e-7)


def test_dcp_writes_a_file_per_rank_and_metadata(probes):
    """dcp.save on 4 ranks writes __<rank>_0.distcp for each rank and one .metadata."""
    assert probes[0][0]["files"] == [".metadata"] + [f"__{r}_0.distcp" for r in range(4)]


def test_dcp_saved_on_4_ranks_loads_on_2(probes):
    """A DCP checkpoint of a 2 x 2 HSDP model loads into 1-D FSDP on 2 ranks with equal parameters."""
    saved = probes[0][0]["full"]
    for r in probes[1]:
        assert all(torch.equal(a, b) for a, b in zip(r["loaded"], saved))


def test_mixed_precision_policy_reduce_dtype_sets_reduce_scatter_dtype(probes):
    """param_dtype=bf16: bf16 forward and gathers; the reduce-scatter moves reduce_dtype; shards' grads fp32."""
    for r in probes[1]:
        for reduce_dtype, m in r["mixed"].items():
            assert m["forward"] == torch.bfloat16 and m["wire"]["all_gather"] == "torch.bfloat16"
            assert m["wire"]["reduce_scatter"] == str(reduce_dtype)
            assert m["grad"] == torch.float32


def test_ddp_optimizer_splits_the_graph_at_bucket_boundaries(probes):
    """optimize_ddp: one graph per bucket, counted from the end, the first capped at 1 MiB; off: one graph."""
    layer = (256 * 256 + 256) * 4

    def buckets(layers, cap_mb):
        first = -(-(1 << 20) // layer)                 # layers until the first bucket reaches 1 MiB
        per = -(-(cap_mb << 20) // layer)              # and until a later one reaches the cap
        return 1 + -(-max(layers - first, 0) // per)

    for r in probes[1]:
        g = r["graphs"]
        assert len(g[(False, 1, 8)]) == 1 and g[(False, 1, 8)][0] == 8 * 2 + 1
        for cap, layers in ((1, 8), (2, 16)):
            got = g[(True, cap, layers)]
            assert len(got) == buckets(layers, cap), (cap, layers, got)
            assert sum(got) - len(got) == layers * 2   # every parameter once, plus each graph's input


def _when_gradients_are_ready(optimize_ddp, layers=8):
    """One compiled DDP step's backward, in order: each compiled graph's backward starting, and
    each all-reduce DDP launches (with the layers of its bucket)."""
    import torch._dynamo
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    torch._dynamo.reset()
    torch._dynamo.config.optimize_ddp = optimize_ddp
    torch.manual_seed(0)
    ddp = torch.nn.parallel.DistributedDataParallel(_Net(layers), bucket_cap_mb=1)
    layer_of = {id(p): i for i, layer in enumerate(ddp.module.layers) for p in layer.parameters()}
    events = []

    def hook(state, bucket):   # DDP calls it once a bucket's gradients are all ready
        events.append(("all_reduce", sorted({layer_of[id(p)] for p in bucket.parameters()})))
        return allreduce_hook(state, bucket)

    ddp.register_comm_hook(None, hook)
    # aot_eager: AOTAutograd turns each graph into one autograd node, as torch.compile's
    # default compiler does, and runs it without generating code.
    compiled = torch.compile(ddp, backend="aot_eager")
    compiled(torch.randn(4, 256)).sum().backward()   # first step: DDP rebuilds its buckets
    events.clear()
    loss = compiled(torch.randn(4, 256)).sum()
    seen, stack = set(), [loss.grad_fn]
    while stack:                                     # find each compiled graph's backward node
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if node.name() == "CompiledFunctionBackward":
            node.register_prehook(lambda grads: events.append(("backward", None)))
        stack.extend(child for child, _ in node.next_functions)
    loss.backward()
    return events


def _ready_with_and_without_ddp_optimizer():
    return {on: _when_gradients_are_ready(on) for on in (True, False)}


def test_ddp_optimizer_launches_a_buckets_all_reduce_before_the_earlier_graphs_backward():
    """Lesson 16, "torch.compile with DDP": with one compiled graph (optimize_ddp off) its
    backward is one autograd node, and DDP launches every all-reduce only after it; split at
    the bucket boundaries (on), the last piece's backward readies its bucket, whose all-reduce
    (of the last layers only) starts before the first piece's backward runs."""
    for rank in dpcourse.run(_ready_with_and_without_ddp_optimizer, world_size=2,
                             backend="gloo", device="cpu", timeout=240):
        whole, split = rank[False], rank[True]
        assert [kind for kind, _ in whole].count("backward") == 1, whole
        assert whole[0][0] == "backward" and len(whole) > 2, whole
        kinds = [kind for kind, _ in split]
        assert kinds.count("backward") == 2 and kinds[0] == "backward", split
        second = kinds.index("backward", 1)
        early = [layers for kind, layers in split[:second] if kind == "all_reduce"]
        assert early and all(set(layers) <= {4, 5, 6, 7} for layers in early), split
        assert kinds[second + 1:].count("all_reduce") >= 1, split


def test_checkpoint_saves_fewer_tensors_and_reruns_the_forward():
    """Lesson 16, activation checkpointing: non-reentrant checkpoint keeps fewer saved bytes;
    of the checkpointed region autograd keeps only its input (every saved tensor passes the
    saved_tensors_hooks pack function); the forward starts again in backward; same grads."""
    from torch.utils.checkpoint import checkpoint

    def run(ckpt):
        model = _mlp()
        starts = []
        model.register_forward_pre_hook(lambda m, a: starts.append(1))
        x, y = _batch(0, 64)
        with saved_tensor_bytes() as saved:
            out = checkpoint(model, x, use_reentrant=False) if ckpt else model(x)
            loss = torch.nn.functional.mse_loss(out, y)
        loss.backward()
        return saved["bytes"], len(starts), [p.grad for p in model.parameters()]

    (plain, n_plain, g_plain), (ck, n_ck, g_ck) = run(False), run(True)
    assert ck < plain and (n_plain, n_ck) == (1, 2)
    assert all(torch.allclose(a, b, rtol=0, atol=1e-7) for a, b in zip(g_plain, g_ck))

    # What autograd keeps from the checkpointed region itself: its input, and nothing else.
    x = _batch(0, 64)[0]
    for ckpt in (False, True):
        packed = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: packed.append(t) or t,
                                                      lambda t: t):
            _ = checkpoint(_mlp(), x, use_reentrant=False) if ckpt else _mlp()(x)
        if ckpt:
            assert len(packed) == 1 and packed[0].data_ptr() == x.data_ptr(), packed
        else:
            assert len(packed) > 1   # the plain forward keeps activations too


def test_checkpoint_stops_recomputing_once_backward_has_what_it_needs():
    """By default the recomputation stops after the last saved tensor; with early stop off it runs to the end."""
    from torch.utils.checkpoint import checkpoint, set_checkpoint_early_stop

    calls = []

    def fn(x):
        y = torch.sin(x)          # the only tensor saved for backward
        calls.append("after")     # reached in the forward; in the recomputation only without early stop
        return y + 1

    x = torch.randn(3, requires_grad=True)
    checkpoint(fn, x, use_reentrant=False).sum().backward()
    assert calls == ["after"]
    calls.clear()
    with set_checkpoint_early_stop(False):
        checkpoint(fn, x, use_reentrant=False).sum().backward()
    assert calls == ["after", "after"]


def test_ddp_optimizer_is_on_by_default():
    """torch._dynamo.config.optimize_ddp defaults to True (DDPOptimizer)."""
    code = "import torch._dynamo.config as c; print(c.optimize_ddp)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "True", out.stderr[-2000:]


WORKER = textwrap.dedent("""
    import os
    import sys
    import torch.distributed as dist
    from dpcourse.launch.teardown import destroy_and_exit
    from dpcourse.torch_tools import init_attempt_process_group
    init_attempt_process_group("gloo")
    restart = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    # A file per worker and attempt: the two workers' prints can interleave on one pipe.
    open(os.path.join(sys.argv[1], f"rank {dist.get_rank()} attempt {restart}"), "w").close()
    # torchrun's store, as the workers reach it (MASTER_ADDR, MASTER_PORT), without a prefix.
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                          is_master=False)
    if restart == 0 and dist.get_rank() == 1:
        store.set("set by attempt 0", "1")
        os._exit(1)
    if restart == 1 and store.check(["set by attempt 0"]):
        open(os.path.join(sys.argv[1], f"rank {dist.get_rank()} finds attempt 0's key"),
             "w").close()
    dist.barrier()
    destroy_and_exit(0)  # no interpreter finalization, where gloo's threads can abort a worker
""")


def test_torchrun_restarts_every_worker_after_one_fails(tmp_path):
    """Lesson 16, "An elastic restart": --max-restarts 1: one worker's failure restarts both,
    with TORCHELASTIC_RESTART_COUNT=1; torchrun's store outlives the attempt: a key a worker of
    the failed attempt set is still there for both workers of the next.

    The worker joins each attempt's process group under a store prefix of its own
    (``dpcourse.torch_tools.init_attempt_process_group``), as the lesson's does.
    """
    script, seen = tmp_path / "worker.py", tmp_path / "seen"
    script.write_text(WORKER)
    seen.mkdir()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--max-restarts", "1",
                           "--nproc-per-node", "2", "--master-addr", "127.0.0.1", "--master-port",
                           str(port), str(script), str(seen)], capture_output=True, text=True,
                          timeout=240,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = sorted(os.listdir(seen))
    assert {"rank 1 attempt 0", "rank 0 attempt 1", "rank 1 attempt 1"} <= set(lines), lines
    assert {"rank 0 finds attempt 0's key", "rank 1 finds attempt 0's key"} <= set(lines), lines
    assert not any("attempt 2" in line for line in lines)


def test_torchrun_rendezvous_is_static_on_master_addr_and_port_by_default():
    """Lesson 16, "An elastic restart": without --rdzv-backend torchrun uses static rendezvous,
    whose endpoint is --master-addr:--master-port."""
    from torch.distributed.run import get_rdzv_endpoint, parse_args

    saved = {k: os.environ.pop(k) for k in list(os.environ) if k.startswith("PET_")}
    try:  # torchrun also reads its options from PET_* variables; none may be set here
        args = parse_args(["--nproc-per-node", "2", "--master-addr", "127.0.0.1",
                           "--master-port", "29511", "worker.py"])
    finally:
        os.environ.update(saved)
    assert args.rdzv_backend == "static"
    assert get_rdzv_endpoint(args) == "127.0.0.1:29511"
