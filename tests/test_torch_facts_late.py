"""More of what lessons 11-16 say about torch, NCCL and gloo, asked of torch itself.

Like ``tests/test_torch_facts.py``: every test asks torch (its defaults, its
optimizers, its layers, its autograd hooks, its process groups), never dpcourse,
and each names the lesson section whose sentence it backs. Facts that need NCCL
are marked ``gpu``.
"""

from __future__ import annotations

import importlib.metadata
import os
import inspect
import re
import subprocess
import sys
import textwrap
import time

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import dpcourse
from test_torch_facts import _nccl_ranks


# An NCCL_DEBUG=INFO line naming a channel's transport: "Channel 00/0 : 0[0] -> 1[1] via P2P/CUMEM"
# (network channels also say "[send]" or "[receive]" before "via").
_CHANNEL_VIA = re.compile(r"->\s*\d+\[\d+\]\s*(?:\[\w+\]\s*)?via (\S+)")

# AdamW and SGD with momentum, both with weight decay: the optimizers lessons 11 and 13 speak of.
_AN_ADAMW_AND_AN_SGD = pytest.mark.parametrize("make_opt", [
    lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1),
    lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, weight_decay=0.01),
], ids=["adamw", "sgd_momentum"])


# --------------------------------------------------------------------------- lesson 08

class _MakesADirectory:
    """Unpickling it calls os.mkdir(path): a stand-in for code a malicious file would run."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return os.mkdir, (self.path,)


class _AllowListed:
    """A plain class a program may allow with torch.serialization.add_safe_globals."""

    def __init__(self, n):
        self.n = n


def test_weights_only_load_runs_no_code_and_takes_primitives_and_allowed_types(tmp_path):
    """Lesson 08, "The training loop": torch.load(..., weights_only=True) loads tensors,
    primitive values and plain containers; it refuses an object whose unpickling would call a
    function, before calling it (the same file loaded with weights_only=False does call it);
    and it refuses other classes unless the program allow-lists them (add_safe_globals)."""
    import io
    import pickle

    target = tmp_path / "made_by_unpickling"
    payload = io.BytesIO()
    torch.save({"w": torch.ones(2), "x": _MakesADirectory(str(target))}, payload)
    payload.seek(0)
    with pytest.raises(pickle.UnpicklingError):
        torch.load(payload, weights_only=True)
    assert not target.exists()
    payload.seek(0)
    torch.load(payload, weights_only=False)  # the payload works: unrestricted loading runs it
    assert target.is_dir()

    plain = io.BytesIO()
    values = (3, 2.5, "name", b"raw", True, None)
    torch.save({"w": torch.ones(2), "values": values, "names": ["a"], "custom": _AllowListed(7)},
               plain)
    plain.seek(0)
    with pytest.raises(pickle.UnpicklingError):
        torch.load(plain, weights_only=True)
    plain.seek(0)
    with torch.serialization.safe_globals([_AllowListed]):  # add_safe_globals, undone on exit
        loaded = torch.load(plain, weights_only=True)
    assert loaded["values"] == values and loaded["names"] == ["a"] and loaded["custom"].n == 7
    assert torch.equal(loaded["w"], torch.ones(2))


# --------------------------------------------------------------------------- lesson 11

def test_ddp_finds_no_unused_parameters_and_assumes_no_static_graph_by_default():
    """Lesson 11, section 3: find_unused_parameters=False and static_graph=False are torch DDP's
    defaults, so a plain DDP(model) takes the one-bucket first step and the rebuild."""
    params = inspect.signature(DDP.__init__).parameters
    assert params["find_unused_parameters"].default is False
    assert params["static_graph"].default is False


class _UsedOnRankZero(nn.Module):
    """Four Linear layers: ``b`` on every rank, ``d`` only where ``use_d``, ``c`` never."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b, self.c, self.d = (nn.Linear(4, 4), nn.Linear(4, 1), nn.Linear(4, 1),
                                          nn.Linear(4, 1))

    def forward(self, x, use_d):
        h = self.a(x)
        return self.b(h) + self.d(h) if use_d else self.b(h)


def _grads_when_only_rank_0_uses_d():
    """torch DDP with find_unused_parameters=True: rank 0's forward uses ``d``, rank 1's does not."""
    model = DDP(_UsedOnRankZero(), find_unused_parameters=True)
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(dist.get_rank()))
    model(x, dist.get_rank() == 0).sum().backward()
    return {n: None if q.grad is None else q.grad.clone() for n, q in model.module.named_parameters()}


def test_find_unused_parameters_leaves_no_gradient_only_where_no_rank_used_the_parameter():
    """Lesson 11, section 4: with find_unused_parameters=True the ranks learn which parameters
    any rank used: a layer only rank 0 used gets the same averaged gradient on both ranks (rank 1
    adds zeros), while the layer no rank used keeps .grad None on every rank."""
    zero, one = dpcourse.run(_grads_when_only_rank_0_uses_d, world_size=2, device="cpu")
    for grads in (zero, one):
        assert [n for n, g in grads.items() if g is None] == ["c.weight", "c.bias"]
    for name in ("d.weight", "d.bias"):
        assert torch.equal(zero[name], one[name]) and zero[name].abs().sum() > 0


@_AN_ADAMW_AND_AN_SGD
def test_optimizers_skip_parameters_whose_grad_is_none(make_opt):
    """Lesson 11, section 4: an optimizer step leaves a parameter whose .grad is None untouched
    (not even weight decay) and keeps no state for it."""
    used, unused = nn.Parameter(torch.ones(3)), nn.Parameter(torch.ones(3))
    opt = make_opt([used, unused])
    used.grad = torch.full((3,), 0.5)
    opt.step()
    assert not torch.equal(used.detach(), torch.ones(3))
    assert torch.equal(unused.detach(), torch.ones(3)) and unused not in opt.state


@pytest.mark.gpu(2)
def test_nccl_without_p2p_and_shm_connects_through_its_network_transport(tmp_path):
    """Lesson 11, section 2: with NCCL_P2P_DISABLE=1 and NCCL_SHM_DISABLE=1 two GPUs of one host
    connect through NCCL's network transport: every channel NCCL logs goes "via NET/...", none
    via P2P or SHM."""
    env = {"NCCL_DEBUG": "INFO", "NCCL_DEBUG_SUBSYS": "INIT,P2P",
           "NCCL_DEBUG_FILE": str(tmp_path / "nccl.%p.log"),
           "NCCL_P2P_DISABLE": "1", "NCCL_SHM_DISABLE": "1"}
    _nccl_ranks("""
        t = torch.ones(1 << 20, device="cuda")
        dist.all_reduce(t)
        torch.cuda.synchronize()
        print(t[0].item())
    """, tmp_path, env)
    logs = [p.read_text() for p in tmp_path.glob("nccl.*.log")]
    assert len(logs) == 2
    for log in logs:
        transports = _CHANNEL_VIA.findall(log)
        assert transports, log[-3000:]
        assert all(t.startswith("NET/") for t in transports), sorted(set(transports))


# --------------------------------------------------------------------------- lesson 12

def _barrier_seconds(late_s):
    """Rank 1 reaches the second barrier ``late_s`` seconds after rank 0: each rank's time in it."""
    if torch.cuda.is_available() and dist.get_backend() == "nccl":
        torch.cuda.set_device(dist.get_rank())
    dist.barrier()                      # both ranks leave this one together
    if dist.get_rank() == 1:
        time.sleep(late_s)
    start = time.perf_counter()
    dist.barrier()                      # no torch.cuda.synchronize(): what the host waits
    return time.perf_counter() - start


def test_gloo_barrier_returns_only_when_every_rank_has_called_it():
    """Lessons 08 (the rank-0 checkpoint) and 12 ("The signal-pad barrier"): dist.barrier()
    keeps the calling process (the host) until every rank has called it: rank 0 waits out rank
    1's 1.5 s delay."""
    early, late = dpcourse.run(_barrier_seconds, 1.5, world_size=2, device="cpu")
    # rank 0 may leave the first barrier a little after rank 1 on a loaded machine; it still
    # waits most of the 1.5 s, where a barrier that did not wait would take milliseconds
    assert early > 0.75, (early, late)
    assert late < early


@pytest.mark.gpu(2)
def test_nccl_barrier_blocks_the_host_until_every_rank_arrives():
    """Lesson 12, "The signal-pad barrier": over NCCL too, dist.barrier() returns to the host of
    rank 0 only after rank 1 has called it, 1.5 s later."""
    early, late = dpcourse.run(_barrier_seconds, 1.5, world_size=2, backend="nccl", timeout=120)
    assert early > 0.75, (early, late)


# --------------------------------------------------------------------------- lesson 13

def _step_whole_and_in_chunks(make_opt, sizes=(4, 4, 2), steps=3):
    """Step one tensor with one optimizer, and its chunks each with an optimizer of their own."""
    gen = torch.Generator().manual_seed(0)
    start = torch.randn(sum(sizes), generator=gen)
    grads = [torch.randn(sum(sizes), generator=gen) for _ in range(steps)]
    whole = nn.Parameter(start.clone())
    chunks = [nn.Parameter(c.clone()) for c in start.split(sizes)]
    opts = [make_opt([whole])] + [make_opt([c]) for c in chunks]
    for g in grads:
        whole.grad = g.clone()
        for c, gc in zip(chunks, g.split(sizes)):
            c.grad = gc.clone()
        for opt in opts:
            opt.step()
    return whole.detach(), torch.cat([c.detach() for c in chunks])


@_AN_ADAMW_AND_AN_SGD
def test_adamw_and_sgd_update_each_element_from_its_own_gradient_and_state(make_opt):
    """Lesson 13, "Cutting every tensor into N pieces": AdamW and SGD (with momentum and weight
    decay) give the same bits whether a tensor is stepped whole or cut into chunks, each chunk
    with an optimizer of its own: where the tensor is cut changes nothing."""
    whole, chunked = _step_whole_and_in_chunks(make_opt)
    assert torch.equal(whole, chunked)


def test_adamw_step_counter_is_a_4_byte_scalar_per_tensor():
    """Lesson 13, "One training run, four ways": beside its two moments, AdamW keeps one step
    counter per parameter tensor, a 0-dimensional float32 tensor of 4 bytes."""
    model = nn.Sequential(nn.Linear(5, 3), nn.Linear(3, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(4, 5)).sum().backward()
    opt.step()
    steps = [opt.state[p]["step"] for p in model.parameters()]
    assert len(steps) == 4
    assert all(s.dim() == 0 and s.dtype == torch.float32 and s.element_size() == 4 for s in steps)


# --------------------------------------------------------------------------- lesson 14

def _layers():
    return nn.Sequential(nn.Embedding(10, 8), nn.LayerNorm(8),
                         nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 8)))


def test_torch_layers_draw_their_initial_weights_in_reset_parameters():
    """Lesson 14, "Building a model that never exists whole": torch's Linear, LayerNorm and
    Embedding draw their initial values in reset_parameters(), so a model built on the meta device
    and materialised by calling each layer's reset_parameters() in registration order from the
    same seed equals the normal build exactly."""
    torch.manual_seed(0)
    normal = _layers()
    with torch.device("meta"):
        lazy = _layers()
    assert all(p.is_meta for p in lazy.parameters())
    lazy.to_empty(device="cpu")
    torch.manual_seed(0)
    for module in lazy.modules():
        if hasattr(module, "reset_parameters"):
            module.reset_parameters()
    for (name, a), (_, b) in zip(normal.state_dict().items(), lazy.state_dict().items()):
        assert torch.equal(a, b), name


# --------------------------------------------------------------------------- lesson 15

def test_debug_level_is_read_when_torch_distributed_is_imported():
    """Lesson 15, the helpers: torch reads TORCH_DISTRIBUTED_DEBUG from the environment of the
    process that imports torch.distributed; setting it later, even before init_process_group,
    leaves the level OFF."""
    late = textwrap.dedent("""
        import os
        import torch.distributed as dist
        os.environ["TORCH_DISTRIBUTED_DEBUG"] = "DETAIL"
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        print(dist.get_debug_level())
        dist.destroy_process_group()
    """)
    early = "import torch.distributed as dist; print(dist.get_debug_level())"
    env = {k: v for k, v in os.environ.items() if k != "TORCH_DISTRIBUTED_DEBUG"}

    def level(code, extra):
        out = subprocess.run([sys.executable, "-c", code], env={**env, **extra},
                             capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr[-2000:]
        return out.stdout.split()[-1]

    assert level(early, {"TORCH_DISTRIBUTED_DEBUG": "DETAIL"}) == "DebugLevel.DETAIL"
    assert level(late, {}) == "DebugLevel.OFF"


@pytest.mark.gpu(2)
def test_nccl_tools_print_what_lesson_15_reads_beside_the_watchdog(tmp_path):
    """Lesson 15, section 7 (the statements tests/test_15_debugging.py leaves out), on 2 GPUs:
    NCCL_DEBUG=INFO prints NCCL's version and the transport of every channel; after a skipped
    all-reduce the rank that skipped it is signalled to dump its flight record; under
    TORCH_NCCL_BLOCKING_WAIT=1 torch takes the waiting rank's process down; and torch warns that
    TORCH_NCCL_TRACE_BUFFER_SIZE is deprecated in favour of TORCH_FR_BUFFER_SIZE."""
    import json

    from dpcourse.bench import record_debugging

    only = ["nccl_debug_info", "skipped_collective", "blocking_wait", "flight_recorder"]
    assert record_debugging.main(["--out", str(tmp_path), "--only", *only]) == 0
    (path,) = tmp_path.glob("lesson15-2x-*.json")
    runs = json.loads(path.read_text())["scenarios"]

    def out(name, rank):
        r = runs[name]["ranks"][rank]
        return "\n".join(r["stdout"] + r["stderr"])

    for rank in (0, 1):
        info = out("nccl_debug_info", rank)
        assert "NCCL version" in info and _CHANNEL_VIA.search(info), info[-3000:]
    assert "Observed flight recorder dump signal from another rank" in out("skipped_collective", 1)
    assert "taking the entire process down" in out("blocking_wait", 0)
    assert runs["blocking_wait"]["ranks"][0]["status"] != "exit status 0"
    assert "TORCH_NCCL_TRACE_BUFFER_SIZE is deprecated; use TORCH_FR_BUFFER_SIZE" in \
        out("flight_recorder", 0) + out("flight_recorder", 1)


# --------------------------------------------------------------------------- lesson 16

def test_torchrun_is_torch_distributed_run():
    """Lesson 16, the table: the torchrun command is torch.distributed.run's main()."""
    scripts = importlib.metadata.entry_points(group="console_scripts", name="torchrun")
    assert [e.value for e in scripts] == ["torch.distributed.run:main"]


def test_saved_tensors_hooks_pack_every_tensor_autograd_saves():
    """Lesson 16, "Activation checkpointing": every tensor autograd saves for backward goes
    through the pack function of torch.autograd.graph.saved_tensors_hooks, and comes back through
    unpack when backward needs it. sin(a * b): mul saves a and b, sin saves a * b."""
    packed, unpacked = [], []

    def pack(t):
        packed.append(t.detach().clone())
        return t

    def unpack(t):
        unpacked.append(1)
        return t

    a = torch.randn(5, requires_grad=True)
    b = torch.randn(5, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        y = torch.sin(a * b)
    assert len(packed) == 3 and not unpacked
    for want in (a.detach(), b.detach(), (a * b).detach()):
        assert sum(torch.equal(t, want) for t in packed) == 1
    y.sum().backward()
    assert len(unpacked) == 3
    assert torch.allclose(a.grad, torch.cos(a * b).detach() * b.detach())


def test_ddp_optimizer_documents_that_one_graph_readies_every_gradient_at_once():
    """Lesson 16, "torch.compile with DDP": DDPOptimizer's documentation says why it splits the
    graph: one compiled backward makes all gradients ready at the same time, so DDP's hooks fire
    only after it and no all-reduce overlaps backward compute."""
    from torch._dynamo.backends.distributed import DDPOptimizer

    doc = " ".join(DDPOptimizer.__doc__.split())
    assert "all gradients become 'ready' at the same time" in doc
    assert "Hooks fire after the whole fused backward function executes" in doc
    assert "boundaries of gradient-allreduce buckets" in doc


# ---- exercises and grader messages

def _skip_then_go_on():
    """Under DETAIL, in groups with a 2 s timeout: rank 1 all-reduces a flag that rank 0 skips;
    then rank 0 skips it again but goes on to an all-reduce of 5 elements."""
    from datetime import timedelta

    def attempt(fn):
        try:
            fn()
            out = None
        except RuntimeError as err:
            out = str(err)
        dist.barrier()  # the default group: both ranks start the next case together
        return out

    def flag_on_rank_1(then_five):
        group = dist.new_group(backend="gloo", timeout=timedelta(seconds=2))
        if dist.get_rank() == 1:
            dist.all_reduce(torch.ones(1), op=dist.ReduceOp.MAX, group=group)
        elif then_five:
            dist.all_reduce(torch.ones(5), group=group)  # rank 0's next collective

    return dict(level=str(dist.get_debug_level()),
                alone=attempt(lambda: flag_on_rank_1(False)),
                going_on=attempt(lambda: flag_on_rank_1(True)))


def test_detail_on_a_rank_other_than_0_blames_rank_0_and_a_later_collective_is_a_mismatch(
        monkeypatch):
    """Exercise 15, job C: under TORCH_DISTRIBUTED_DEBUG=DETAIL a rank other than 0 that waits in
    a collective rank 0 skipped reports, at the group's timeout, that it reached the monitored
    barrier and waited in vain for rank 0 (its send to rank 0 timed out); rank 0 returns
    untouched. Had rank 0 gone on to another collective of the group, DETAIL would have raised a
    mismatch on both ranks at once instead: job C's ranks 0 and 2 issue none before the timeout."""
    monkeypatch.setenv("TORCH_DISTRIBUTED_DEBUG", "DETAIL")  # the ranks start with it
    zero, one = dpcourse.run(_skip_then_go_on, world_size=2, backend="gloo", device="cpu",
                             timeout=120)
    assert zero["level"] == one["level"] == "DebugLevel.DETAIL"
    assert zero["alone"] is None
    assert one["alone"].startswith(
        "Rank 1 successfully reached monitoredBarrier, but received errors while waiting for "
        "send/recv from rank 0. Please check rank 0 logs for faulty rank."), one["alone"]
    assert "Timed out waiting 2000ms for send operation to complete" in one["alone"]
    assert "failed to pass monitoredBarrier" not in one["alone"]
    for r in (zero, one):
        assert "Detected mismatch between collectives on ranks" in r["going_on"], r["going_on"]


def _hook_buffers_and_grads():
    """torch DDP over a bias-free Linear with a comm hook that copies the bucket's buffer before
    all-reducing it as the default hook does; also this rank's plain autograd gradient."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    torch.manual_seed(0)
    model = nn.Linear(4, 1, bias=False)
    plain = nn.Linear(4, 1, bias=False)
    plain.load_state_dict(model.state_dict())
    ddp = DDP(model)
    seen = []

    def hook(state, bucket):
        seen.append(bucket.buffer().clone())
        return default_hooks.allreduce_hook(state, bucket)

    ddp.register_comm_hook(None, hook)
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(1 + dist.get_rank()))
    ddp(x).sum().backward()
    plain(x).sum().backward()
    return dict(buffer=seen[0], local=plain.weight.grad.flatten(), after=model.weight.grad)


def test_a_comm_hooks_bucket_buffer_holds_this_ranks_undivided_float32_gradient():
    """Exercise 11: with a comm hook registered, bucket.buffer() holds this rank's own float32
    gradient, neither divided by the world size nor summed: the hook does the whole reduction
    (torch's allreduce_hook divides, then sums, and the gradient becomes the mean)."""
    zero, one = dpcourse.run(_hook_buffers_and_grads, world_size=2, backend="gloo", device="cpu",
                             timeout=120)
    assert not torch.equal(zero["local"], one["local"])
    mean = (zero["local"] + one["local"]) / 2
    for r in (zero, one):
        assert r["buffer"].dtype == torch.float32
        assert torch.equal(r["buffer"], r["local"])
        assert torch.allclose(r["after"].flatten(), mean, atol=1e-6)


def _bf16_sum_over_gloo():
    mine = torch.randn(1000, generator=torch.Generator().manual_seed(dist.get_rank()))
    t = mine.to(torch.bfloat16)
    dist.all_reduce(t)
    return t


def test_gloo_all_reduce_of_bfloat16_rounds_the_sum_to_bfloat16():
    """Exercise 11, after the check: over gloo an all-reduce of bfloat16 tensors adds them in
    bfloat16: the result is the exact sum of the two ranks' values rounded to bfloat16, which
    differs from the exact sum in many elements."""
    x0, x1 = (torch.randn(1000, generator=torch.Generator().manual_seed(r)).to(torch.bfloat16)
              for r in range(2))
    exact = x0.float() + x1.float()
    for got in dpcourse.run(_bf16_sum_over_gloo, world_size=2, backend="gloo", device="cpu",
                            timeout=120):
        assert got.dtype == torch.bfloat16
        assert torch.equal(got, exact.to(torch.bfloat16))
        assert (got.float() != exact).sum() > 100


def test_torchs_default_dtype_is_float32_which_keeps_24_bits():
    """Exercise 02's keeps_dtype hint: torch's default dtype is float32, whose significand has 24
    bits (23 stored): a tensor made without a dtype is float32, and an int64 or float64 value
    that needs more bits comes back from it changed."""
    assert torch.get_default_dtype() == torch.float32
    assert torch.tensor([1.5]).dtype == torch.float32 and torch.zeros(2).dtype == torch.float32
    assert torch.finfo(torch.float32).eps == 2.0 ** -23
    assert torch.tensor([2 ** 24 + 1]).float().long().item() != 2 ** 24 + 1
    assert torch.tensor([1 + 2.0 ** -30], dtype=torch.float64).float().double().item() == 1.0
    assert torch.tensor([2 ** 24 - 1]).float().long().item() == 2 ** 24 - 1


def test_a_zero_gradient_moves_a_parameter_under_weight_decay_or_built_up_momentum():
    """Exercise 03's unused_parameter_keeps_no_grad hint: unlike .grad None (which optimizers
    skip), a gradient of zeros still moves a parameter under SGD with weight decay, and under
    SGD with momentum once earlier steps have built the momentum up."""
    decayed = nn.Parameter(torch.ones(3))
    decayed.grad = torch.zeros(3)
    torch.optim.SGD([decayed], lr=0.1, weight_decay=0.1).step()
    assert (decayed.detach() < 1).all()

    moving, resting = nn.Parameter(torch.ones(3)), nn.Parameter(torch.ones(3))
    opt = torch.optim.SGD([moving, resting], lr=0.1, momentum=0.9)
    moving.grad, resting.grad = torch.ones(3), torch.ones(3)
    opt.step()                                   # both build up momentum
    before = moving.detach().clone(), resting.detach().clone()
    moving.grad, resting.grad = torch.zeros(3), None
    opt.step()
    assert (moving.detach() < before[0]).all()   # zeros: the momentum still moves it
    assert torch.equal(resting.detach(), before[1])  # None: skipped


def test_joinable_is_abstract_and_its_constructor_sets_the_config_join_reads():
    """Exercise 10's hints: Joinable is an abstract class whose join_hook, join_device and
    join_process_group (the last two properties) a subclass must define; Joinable's constructor
    sets the join config (disabled until a Join fills it in), and notify_join_context refuses a
    joinable whose constructor did not run it."""
    from torch.distributed.algorithms.join import Join, Joinable, JoinHook

    assert Joinable.__abstractmethods__ == {"__init__", "join_hook", "join_device",
                                            "join_process_group"}
    assert isinstance(inspect.getattr_static(Joinable, "join_device"), property)
    assert isinstance(inspect.getattr_static(Joinable, "join_process_group"), property)

    class Wrapper(Joinable):
        def __init__(self, call_joinable_init):
            if call_joinable_init:
                super().__init__()

        def join_hook(self, **kwargs):
            return JoinHook()

        @property
        def join_device(self):
            return torch.device("cpu")

        @property
        def join_process_group(self):
            return None

    assert Wrapper(True)._join_config.enable is False
    assert Join.notify_join_context(Wrapper(True)) is None  # disabled: no collective
    with pytest.raises(AssertionError, match="calls the ``Joinable`` constructor"):
        Join.notify_join_context(Wrapper(False))
