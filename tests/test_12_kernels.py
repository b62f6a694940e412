"""NVLink all-reduce kernels: the CPU model of their schedule, and the kernels on GPUs.

The CPU tests replay the kernels' block/peer schedule (``schedule.simulate``)
under many interleavings: it sums correctly on 2-4 ranks with the barrier,
the pad is clear after every call, and each way of breaking the protocol
(no barrier, relaxed flags, one buffer for one-shot) gives wrong sums. A
recording launcher shows which later calls reuse a launch plan, and what the
plan hands Triton's launcher.

The GPU tests (``gpu(2)``) compare both kernels with ``dist.all_reduce`` on
every visible GPU (2, or 4 where present): many lengths including
non-multiples of the block, float32/bfloat16/float16, 1,000 back-to-back
calls, the zero-copy path and the DDP plug-in; and ``gpu(1)`` asks Triton's
launcher what it does with a tensor argument and with an address.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist

import dpcourse
from dpcourse.comm import chunk_size, shard_range
from dpcourse.comm.kernels import one_shot_all_reduce, two_shot_all_reduce
from dpcourse.comm.kernels.schedule import block_tiles, grid_size, one_shot_plan, two_shot_plan
from dpcourse.comm.kernels.simulation import simulate

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0


# -- the schedule, on the CPU ------------------------------------------------------------
def _inputs(call: int, rank: int, n: int) -> list[float]:
    return [float(1000 * call + 100 * rank + i) for i in range(n)]


def _expected(call: int, world: int, n: int) -> list[float]:
    return [sum(_inputs(call, r, n)[i] for r in range(world)) for i in range(n)]


def _wrong_calls(results, world, n) -> int:
    return sum(results[c][r] != _expected(c, world, n)
               for c in range(len(results)) for r in range(world))


@pytest.mark.parametrize("kind", ["one_shot", "two_shot"])
@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("n", [1, 2, 7, 13])
def test_simulated_kernel_sums_under_any_interleaving(kind, world, n):
    for seed in range(15):
        m, results = simulate([_inputs(0, r, n) for r in range(world)], kind, calls=4,
                              seed=seed, next_inputs=lambda c, r: _inputs(c, r, n))
        assert _wrong_calls(results, world, n) == 0, f"seed {seed}"
        assert m.pad_is_clear(), "every flag must be taken down by its receiver"


def test_simulated_barrier_raises_and_takes_its_flags_in_any_order():
    # The kernel gives each peer's flag its own thread: on 3 ranks, rank 0's block raises its two
    # flags in either order, and takes the two it receives in either order, and still sums right.
    def order(m, op):
        return tuple(int(line.split("peer ")[1]) for line in m.log
                     if line.startswith("rank 0 block 0: " + op))
    sends, waits = set(), set()
    for seed in range(30):
        m, results = simulate([_inputs(0, r, 4) for r in range(3)], "one_shot", seed=seed)
        assert _wrong_calls(results, 3, 4) == 0 and m.pad_is_clear()
        sends.add(order(m, "send"))
        waits.add(order(m, "wait"))
        log = [line for line in m.log if line.startswith("rank 0 block 0")]
        last_send = max(i for i, line in enumerate(log) if ": send" in line)
        assert all(i > last_send for i, line in enumerate(log) if ": wait" in line)
    assert sends == {(1, 2), (2, 1)} and waits == {(1, 2), (2, 1)}


@pytest.mark.parametrize("kind", ["one_shot", "two_shot"])
@pytest.mark.parametrize("broken", [{"barrier": False}, {"release": False}])
def test_simulated_kernel_races_without_the_protocol(kind, broken):
    n, world = 6, 2
    wrong = [_wrong_calls(simulate([_inputs(0, r, n) for r in range(world)], kind, calls=3,
                                   seed=seed, next_inputs=lambda c, r: _inputs(c, r, n),
                                   **broken)[1], world, n) for seed in range(30)]
    assert sum(w > 0 for w in wrong) >= 20, f"{broken} should race in most schedules: {wrong}"


def test_one_shot_needs_two_buffer_halves():
    n, world = 8, 2
    wrong = [_wrong_calls(simulate([_inputs(0, r, n) for r in range(world)], "one_shot",
                                   calls=4, seed=seed, double_buffer=False,
                                   next_inputs=lambda c, r: _inputs(c, r, n))[1], world, n)
             for seed in range(30)]
    assert sum(w > 0 for w in wrong) >= 10, wrong


SIZES = (6, 3, 9, 4, 7, 2)
MIXED = ("one_shot", "two_shot", "one_shot", "one_shot", "two_shot", "one_shot")


def _sized(call: int, rank: int) -> list[float]:
    return [float(100 * call + 10 * rank + i) for i in range(SIZES[call])]


def _wrong_mixed(world: int, seeds: int, **layout) -> int:
    wrong = 0
    for seed in range(seeds):
        _, results = simulate([_sized(0, r) for r in range(world)], list(MIXED),
                              calls=len(MIXED), seed=seed, next_inputs=_sized, **layout)
        want = [[sum(_sized(c, r)[i] for r in range(world)) for i in range(SIZES[c])]
                for c in range(len(MIXED))]
        wrong += any(results[c][r] != want[c] for c in range(len(MIXED)) for r in range(world))
    return wrong


@pytest.mark.parametrize("world", [2, 3, 4])
def test_mixed_kernels_and_sizes_share_the_workspace_halves(world):
    assert _wrong_mixed(world, 20) == 0


def test_halves_sized_by_each_call_race():
    # half c % 2 starting at the call's own size: a long call's half 0 covers a short
    # call's half 1, which a slow peer may still be reading
    assert _wrong_mixed(2, 40, fixed_halves=False) >= 10


def test_workspace_halves_are_fixed_and_alternate():
    from dpcourse.comm.kernels.workspace import Workspace

    ws = object.__new__(Workspace)  # the layout only: a plain buffer stands in for the mapping
    ws.nbytes, ws.buffer, ws.calls, ws._views = 1024, torch.zeros(1024, dtype=torch.uint8), 0, {}
    starts = []
    for n, dtype in ((10, torch.float32), (128, torch.float32), (3, torch.bfloat16),
                     (256, torch.bfloat16), (1, torch.float32)):
        view = ws.next_half(dtype, n)
        offset = view.data_ptr() - ws.buffer.data_ptr()
        starts.append(offset)
        assert view.numel() == n and offset + n * dtype.itemsize <= (offset // 512 + 1) * 512
    assert starts == [0, 512, 0, 512, 0] and ws.calls == 5
    with pytest.raises(ValueError, match="half"):
        ws.next_half(torch.float32, 129)


@pytest.mark.parametrize("numel,world", [(1, 2), (17, 2), (40, 3), (103, 4), (5, 8)])
def test_two_shot_plan_reduces_every_element_once(numel, world):
    plan = two_shot_plan(numel, world, block=4, max_blocks=3)
    reduced = sorted(i for steps in plan.values() for s in steps if s.op == "reduce"
                     for i in s.index)
    assert reduced == list(range(numel)), "each element is summed by exactly one rank"
    for (rank, _), steps in plan.items():
        start, end = shard_range(numel, world, rank)
        for s in steps:
            if s.op == "reduce":  # a rank reduces only its own slice
                assert all(start <= i < end for i in s.index)


def test_one_shot_plan_and_grid():
    assert grid_size(0, 4, 8) == 1 and grid_size(33, 4, 8) == 8 and grid_size(5, 4, 8) == 2
    assert [list(t) for t in block_tiles(10, 3, 2, 1)] == [[3, 4, 5], [9]]
    plan = one_shot_plan(10, 2, block=3, max_blocks=2)
    ops = [s.op for s in plan[(0, 0)]]
    assert ops == ["copy", "copy", "send", "wait", "reduce", "reduce"]
    assert chunk_size(10, 3) == 4 and chunk_size(10, 3, align=16) == 16


def test_kernels_refuse_cpu_tensors_with_a_clear_error():
    with pytest.raises(ValueError, match="CUDA tensors"):
        one_shot_all_reduce(torch.ones(3))
    with pytest.raises(ValueError, match="CUDA tensors"):
        two_shot_all_reduce(torch.ones(3))


class _RecordingLauncher:
    """Stands in for a kernel's ``DirectLaunch``: records each launch instead of making it."""

    grid, head = 3, ("function", "metadata")

    def __init__(self):
        self.launches = []

    def c_launch(self, *args):
        self.launches.append(args)

    def bind(self, *args):
        return (*self.head, *args)


class _FakeWorkspace:
    """Stands in for a symmetric allocation: a plan only counts calls on it."""

    calls = 0


@pytest.fixture
def plans(monkeypatch):
    """The plan path on the CPU: an empty plan table and a fixed current stream (7)."""
    from dpcourse.comm.kernels import workspace

    monkeypatch.setattr(workspace, "PLANS", {})
    from dpcourse.comm.kernels import allreduce

    monkeypatch.setattr(allreduce, "PLANS", workspace.PLANS)
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda device: 7, raising=False)
    return workspace.PLANS


def test_a_plan_launches_only_calls_shaped_like_its_own(plans, monkeypatch):
    """Which later calls reuse a plan, and what the launcher is given.

    The launch is recorded, not run; the rest of each call is the package's own code.
    """
    from dpcourse.comm.kernels import allreduce, workspace

    monkeypatch.setattr(workspace, "_SYMMETRIC", {})
    launcher = _RecordingLauncher()
    x = torch.zeros(64, dtype=torch.bfloat16)
    home = workspace._SYMMETRIC[x.data_ptr()] = _FakeWorkspace()
    deltas, pad = torch.zeros(2, dtype=torch.int64), torch.zeros(8, dtype=torch.int32)
    allreduce._remember(allreduce.TWO_SHOT, x, None, allreduce.TWO_SHOT_MAX_BLOCKS, None, home,
                        launcher, (x, x), (deltas, pad, pad, 64, 32, 0, 2, 8192, False))

    two_shot_all_reduce(x)
    two_shot_all_reduce(x.view(8, 8))  # the same memory, contiguous: the same launch
    assert launcher.launches == 2 * [(3, 1, 1, 7, "function", "metadata", x.data_ptr(),
                                      x.data_ptr(), deltas.data_ptr(), pad.data_ptr(),
                                      pad.data_ptr(), 64, 32, 0, 2, 8192, False)], \
        "the grid, the current stream, and addresses as integers"

    # Anything that differs from the plan's call takes the full path, whose checks refuse a
    # CPU tensor: no launch.
    for call in (lambda: two_shot_all_reduce(x[:32]),                     # same address, shorter
                 lambda: two_shot_all_reduce(x.view(torch.float16)),     # another dtype
                 lambda: two_shot_all_reduce(x.view(8, 8).t()),          # not contiguous
                 lambda: two_shot_all_reduce(x, op=dist.ReduceOp.MAX),   # another op
                 lambda: two_shot_all_reduce(x, max_blocks=4),           # another grid cap
                 lambda: two_shot_all_reduce(x, group=object()),         # another group
                 lambda: one_shot_all_reduce(x)):                        # another kernel
        with pytest.raises(ValueError):
            call()
    assert len(launcher.launches) == 2
    # The workspaces were released: no plan is left to launch on the address.
    workspace.release_workspaces()
    assert not plans
    with pytest.raises(ValueError, match="CUDA tensors"):
        two_shot_all_reduce(x)
    assert len(launcher.launches) == 2


def test_a_copying_plan_alternates_the_workspace_halves(plans, monkeypatch):
    """A plan for ordinary tensors: the caller's tensor, the workspace's two halves in turn,
    and no plan left once the group's workspace is replaced or released."""
    from dpcourse.comm.kernels import allreduce, workspace

    real = workspace.Workspace

    def fake_workspace(nbytes, group, device):
        ws = object.__new__(real)  # the layout only: a plain CPU buffer
        ws.nbytes, ws.buffer = nbytes, torch.zeros(nbytes, dtype=torch.uint8)
        ws.calls, ws._views, ws.group = 0, {}, group
        return ws

    monkeypatch.setattr(workspace, "_CACHE", {})
    monkeypatch.setattr(workspace, "Workspace", fake_workspace)
    monkeypatch.setattr(workspace, "process_group", lambda group: "pg")
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(dist, "barrier", lambda group=None: None)
    launcher = _RecordingLauncher()
    x = torch.zeros(16, dtype=torch.bfloat16)
    ws = workspace.get_workspace(64, None, x.device)

    def remember():
        allreduce._remember(allreduce.ONE_SHOT, x, None, allreduce.ONE_SHOT_MAX_BLOCKS, None, ws,
                            launcher, ws.halves(x.dtype, 16), (16, 0, 2, 8192))

    remember()
    for _ in range(3):
        one_shot_all_reduce(x)
    halves = [h.data_ptr() for h in ws.halves(x.dtype, 16)]
    assert halves[1] - halves[0] == ws.nbytes // 2
    assert [a[6:8] for a in launcher.launches] == [(x.data_ptr(), halves[0]),
                                                    (x.data_ptr(), halves[1]),
                                                    (x.data_ptr(), halves[0])], \
        "the caller's tensor, the halves in turn"
    assert ws.calls == 3
    # A larger call replaces the group's workspace: the plans go with it.
    assert workspace.get_workspace(1 << 22, None, x.device) is not ws and not plans
    with pytest.raises(ValueError, match="CUDA tensors"):
        one_shot_all_reduce(x)
    remember()
    workspace.release_workspaces()  # so does releasing them
    assert not plans
    assert len(launcher.launches) == 3


def test_benchmarks_know_the_kernel_rows(monkeypatch):
    from dpcourse.bench.allreduce import _resolve
    from dpcourse.bench.ddp import COMM_STREAM_TWO_SHOT_BLOCKS, KERNEL_VARIANTS, _wrap

    rows = ["one_shot", "two_shot", "two_shot_symm", "torch_one_shot", "torch_two_shot"]
    assert list(_resolve(["library"] + rows)) == ["library"] + rows
    with pytest.raises(ValueError, match="two_shot_symm"):
        _resolve(["three_shot"])
    assert KERNEL_VARIANTS == ("overlapped_one_shot", "overlapped_two_shot",
                               "overlapped_one_shot_comm_stream", "overlapped_two_shot_comm_stream")
    from dpcourse import ddp
    from dpcourse.comm import OnCommStream, kernels

    monkeypatch.setattr(ddp, "DataParallelOverlapped", lambda model, **kwargs: kwargs)
    for variant in KERNEL_VARIANTS:
        fn = _wrap(variant, torch.nn.Linear(2, 2), torch.device("cpu"), 25.0, None,
                   None)["all_reduce"]
        kernel = (kernels.one_shot_all_reduce if "one_shot" in variant
                  else kernels.two_shot_all_reduce)
        if variant == "overlapped_two_shot_comm_stream":
            assert isinstance(fn, OnCommStream) and fn.all_reduce.func is kernel
            assert fn.all_reduce.keywords == {"max_blocks": COMM_STREAM_TWO_SHOT_BLOCKS}
        elif variant.endswith("comm_stream"):
            assert isinstance(fn, OnCommStream) and fn.all_reduce is kernel
        else:
            assert fn is kernel
    with pytest.raises(ValueError, match="overlapped_two_shot"):
        _wrap("overlapped_three_shot", torch.nn.Linear(2, 2), torch.device("cpu"), 25.0, None, None)


def test_a_kernel_variant_takes_its_grid_cap_from_its_name(monkeypatch, capsys, tmp_path):
    from dpcourse import cli, ddp
    from dpcourse.bench.ddp import kernel_variant, _wrap
    from dpcourse.comm import OnCommStream, kernels

    assert kernel_variant("overlapped_two_shot_comm_stream_32_blocks") == (
        "overlapped_two_shot_comm_stream", 32)
    assert kernel_variant("overlapped_one_shot") == ("overlapped_one_shot", None)
    for name in ("overlapped_two_shot_0_blocks", "overlapped_two_shot_x_blocks",
                 "overlapped_32_blocks", "overlapped", "zero1", "overlapped_two_shot_blocks"):
        assert kernel_variant(name) is None, name
    monkeypatch.setattr(ddp, "DataParallelOverlapped", lambda model, **kwargs: kwargs)

    def wrapped(variant):
        return _wrap(variant, torch.nn.Linear(2, 2), torch.device("cpu"), 25.0, None,
                     None)["all_reduce"]
    fn = wrapped("overlapped_two_shot_comm_stream_32_blocks")
    assert isinstance(fn, OnCommStream) and fn.all_reduce.func is kernels.two_shot_all_reduce
    assert fn.all_reduce.keywords == {"max_blocks": 32}
    fn = wrapped("overlapped_one_shot_16_blocks")
    assert fn.func is kernels.one_shot_all_reduce and fn.keywords == {"max_blocks": 16}
    # The command refuses a name that is no variant before it starts any rank.
    assert cli.main(["bench", "ddp", "--variants", "overlapped,overlapped_four_shot_8_blocks",
                     "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "'overlapped_four_shot_8_blocks'" in err and "'overlapped'" not in err

    class Started(Exception):
        pass

    def start(*args, **kwargs):
        raise Started(args[1])
    monkeypatch.setattr(dpcourse, "run", start)
    with pytest.raises(Started, match="overlapped_two_shot_comm_stream_32_blocks"):
        cli.main(["bench", "ddp", "--out", str(tmp_path),
                  "--variants", "overlapped,overlapped_two_shot_comm_stream_32_blocks"])


def test_multicast_stays_off(monkeypatch):
    from dpcourse.comm.kernels import require_multicast_off

    monkeypatch.delenv("TORCH_SYMM_MEM_DISABLE_MULTICAST", raising=False)
    require_multicast_off()
    import os

    assert os.environ["TORCH_SYMM_MEM_DISABLE_MULTICAST"] == "1"
    monkeypatch.setenv("NCCL_NVLS_ENABLE", "1")
    with pytest.raises(RuntimeError, match="multicast"):
        require_multicast_off()


# -- the kernels, on GPUs ----------------------------------------------------------------
@pytest.mark.gpu
def test_tritons_launcher_asks_a_tensor_for_its_pointer_and_checks_it_but_not_an_address():
    """Why a plan passes integer addresses: what Triton's launcher does with each kind of argument;
    and why it skips Triton's runner: what the runner asks for at every launch.

    Given an object with ``data_ptr()`` (a tensor) as any of the five pointer arguments, the
    compiled kernel's launcher calls it on every launch and has the driver check the pointer
    (host memory is refused, in every position); given an integer it launches with it
    unchecked. The kernel launched is empty, so the host address passed as an integer is never
    touched.
    """
    from dpcourse.comm.kernels import triton_allreduce as tk

    x = torch.zeros(16, device="cuda")
    args = (x, x, x, x, x, 16, 16)
    compiled = tk.empty_kernel[(1,)](*args, RANK=0, WORLD=2, BLOCK=16, COPY=False)
    launch = compiled[(1, 1, 1)]

    class Counted:
        def __init__(self):
            self.calls = 0

        def data_ptr(self):
            self.calls += 1
            return x.data_ptr()

    counted = [Counted() for _ in range(5)]   # the kernel's five pointer arguments
    launch(*counted, *args[5:], 0, 2, 16, False)
    launch(*counted, *args[5:], 0, 2, 16, False)
    assert [c.calls for c in counted] == [2] * 5, "data_ptr() of each, at every launch"
    host = torch.zeros(16)
    for i in range(5):   # host memory is refused in any pointer position
        with pytest.raises(ValueError, match=rf"\(at {i}\) cannot be accessed from Triton"):
            launch(*args[:i], host, *args[i + 1:], 0, 2, 16, False)
    launch(host.data_ptr(), *args[1:], 0, 2, 16, False)   # an integer: not checked
    torch.cuda.synchronize()

    # The runner asks the compiled kernel for its launch metadata at every launch;
    # DirectLaunch, which the plans call, goes to the launcher without asking.
    asked, metadata = [], compiled.launch_metadata
    compiled.launch_metadata = lambda *a: (asked.append(1), metadata(*a))[1]
    for _ in range(2):
        launch(*args, 0, 2, 16, False)
    assert len(asked) == 2
    from dpcourse.comm.kernels.triton_launch import DirectLaunch

    direct = DirectLaunch(compiled, 1)
    for _ in range(2):
        direct(*args, 0, 2, 16, False, stream=torch.cuda.current_stream().cuda_stream)
    torch.cuda.synchronize()
    assert len(asked) == 2


@pytest.mark.gpu
def test_a_post_accumulate_grad_hook_runs_on_the_stream_of_the_backward():
    """Lesson 12, "What the kernels did to a DDP step": inside a parameter's post-accumulate-grad
    hook (where a DDP wrapper launches a bucket's reduction) the current stream is the one the
    forward and backward ran on, not the default stream."""
    side = torch.cuda.Stream()
    model = torch.nn.Linear(64, 64).cuda()
    seen = []
    model.weight.register_post_accumulate_grad_hook(
        lambda p: seen.append(torch.cuda.current_stream()))
    x = torch.randn(8, 64, device="cuda")
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        model(x).sum().backward()
    torch.cuda.synchronize()
    assert seen == [side] and side != torch.cuda.default_stream()


def symm_mem_views() -> dict:
    """What torch's symmetric memory reports on this rank: addresses, and its kernels' inputs."""
    import torch.distributed._symmetric_memory as symm_mem

    from dpcourse.comm.kernels.workspace import require_multicast_off

    require_multicast_off()
    rank, world = dist.get_rank(), dist.get_world_size()
    group_name = dist.group.WORLD.group_name
    buf = symm_mem.empty(16, dtype=torch.float32, device=torch.device("cuda", rank))
    handle = symm_mem.rendezvous(buf, group_name)
    peer = (rank + 1) % world
    refused = {}
    for op in ("one_shot_all_reduce", "two_shot_all_reduce_"):
        try:
            getattr(torch.ops.symm_mem, op)(torch.ones(16, device=buf.device), "sum", group_name)
            torch.cuda.synchronize()
            refused[op] = False
        except RuntimeError:
            refused[op] = True
    dist.barrier()
    return dict(world=world, ptrs=len(handle.buffer_ptrs),
                own=handle.buffer_ptrs[rank] == buf.data_ptr(),
                peer=handle.get_buffer(peer, (16,), torch.float32).data_ptr()
                == handle.buffer_ptrs[peer],
                distinct=len(set(handle.buffer_ptrs)) == world, refused=refused)


@pytest.mark.gpu(2)
def test_buffer_ptrs_hold_each_ranks_buffer_and_torchs_kernels_refuse_an_ordinary_tensor():
    """Lesson 12, "What a kernel can see of its peer's memory": handle.buffer_ptrs[p] is where
    this GPU sees rank p's buffer (its own entry is the buffer's address, a peer's entry is the
    address of that peer's buffer as get_buffer maps it); and both of torch's symmetric-memory
    all-reduces, one_shot_all_reduce and two_shot_all_reduce_, refuse an ordinary tensor."""
    for rank, res in enumerate(dpcourse.run(symm_mem_views, world_size=GPUS, backend="nccl")):
        assert res["ptrs"] == res["world"] and res["own"] and res["peer"], (rank, res)
        assert res["distinct"], (rank, res)
        assert res["refused"] == {"one_shot_all_reduce": True, "two_shot_all_reduce_": True}, res


KERNELS = {"one_shot": one_shot_all_reduce, "two_shot": two_shot_all_reduce}
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}
# Around the tile (4096 fp32 / 8192 bf16 elements), the 16-element alignment and the
# grid-stride loop (64 blocks x 4096 = 262144 elements per sweep).
LENGTHS = (1, 2, 3, 15, 16, 17, 1000, 4095, 4096, 4097, 8191, 8193, 65537, 262143,
           262145, 3 * 262144 + 5, (1 << 22) + 3)


def kernels_vs_nccl() -> list:
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", rank)
    out = []
    for n in LENGTHS:
        for dtype in DTYPES:
            for data in ("int", "normal"):
                g = torch.Generator().manual_seed(n * 7 + rank)
                if data == "int":
                    x = torch.randint(-8, 9, (n,), generator=g).to(dtype).to(dev)
                else:
                    x = torch.randn(n, generator=g).to(dtype).to(dev)
                ref = x.clone()
                dist.all_reduce(ref)
                for name, fn in KERNELS.items():
                    got = x.clone()
                    fn(got)
                    every = [torch.empty_like(got) for _ in range(world)]
                    dist.all_gather(every, got)
                    same = all(torch.equal(every[0], e) for e in every)
                    err = ((got.float() - ref.float()).abs().max().item() if n else 0.0)
                    exact = torch.equal(got, ref)
                    out.append((name, n, str(dtype), data, exact, err, same))
    return out


@pytest.mark.gpu(2)
def test_kernels_match_nccl_all_reduce():
    rows = dpcourse.run(kernels_vs_nccl, world_size=GPUS, backend="nccl", timeout=600)
    for rank, res in enumerate(rows):
        for name, n, dtype, data, exact, err, same in res:
            label = f"{name} n={n} {dtype} {data} rank {rank}"
            assert same, f"{label}: ranks disagree (every rank must get the same bits)"
            if data == "int":  # small integers: every order of addition is exact
                assert exact, f"{label}: max error {err}"
            else:
                assert err <= TOL[getattr(torch, dtype.split('.')[-1])] * 8, label


def back_to_back(calls: int) -> list:
    """``calls`` calls per kernel and dtype, inputs changing every call, no host sync.

    ``two_shot_symm`` reduces a tensor in symmetric memory in place, through its own
    launch plan after the first call.
    """
    from dpcourse.comm.kernels import symmetric_empty

    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", rank)
    out = []
    for n in (4097, 300_001):
        for dtype in (torch.float32, torch.bfloat16):
            g = torch.Generator().manual_seed(rank)
            base = torch.randint(-8, 9, (n,), generator=g).to(dtype).to(dev)
            ref = base.clone()
            dist.all_reduce(ref)
            for name, fn in {**KERNELS, "two_shot_symm": two_shot_all_reduce}.items():
                sums = torch.empty(calls, dtype=torch.float64, device=dev)
                x = (symmetric_empty(n, dtype=dtype) if name == "two_shot_symm"
                     else torch.empty_like(base))
                for i in range(calls):
                    torch.add(base, i % 16, out=x)
                    fn(x)
                    # each call's error, kept on the device: a race in any call shows here
                    sums[i] = (x.double() - ref.double() - world * (i % 16)).abs().max()
                out.append((name, n, str(dtype), sums.nonzero().flatten().tolist()[:10]))
    return out


def mixed_back_to_back(calls: int) -> list:
    """Kernels and sizes change from call to call (as DDP buckets do), no host sync."""
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", rank)
    sizes = (4097, 300_001, 17, 65536, 1_000_003)
    bases, refs = [], []
    for i, n in enumerate(sizes):
        g = torch.Generator().manual_seed(10 * i + rank)
        bases.append(torch.randint(-8, 9, (n,), generator=g).float().to(dev))
        refs.append(bases[-1].clone())
        dist.all_reduce(refs[-1])
    errors = torch.empty(calls, dtype=torch.float64, device=dev)
    for i in range(calls):
        j = (7 * i) % len(sizes)
        x = bases[j] + (i % 16)
        KERNELS[("one_shot", "two_shot")[(i // 3) % 2]](x)
        errors[i] = (x.double() - refs[j].double() - world * (i % 16)).abs().max()
    return errors.nonzero().flatten().tolist()[:10]


@pytest.mark.gpu(2)
def test_kernels_stay_correct_when_sizes_and_kernels_change_every_call():
    for rank, wrong in enumerate(dpcourse.run(mixed_back_to_back, 1000, world_size=GPUS,
                                              backend="nccl", timeout=600)):
        assert not wrong, f"rank {rank}: wrong in calls {wrong}"


@pytest.mark.gpu(2)
def test_kernels_stay_correct_over_1000_back_to_back_calls():
    for rank, res in enumerate(dpcourse.run(back_to_back, 1000, world_size=GPUS,
                                            backend="nccl", timeout=600)):
        for name, n, dtype, wrong in res:
            assert not wrong, f"{name} n={n} {dtype} rank {rank}: wrong in calls {wrong}"


def launch_entries() -> dict:
    """Each way DirectLaunch may launch (Triton's C launcher, its runner): 300 mixed calls."""
    import triton

    from dpcourse.comm.kernels import triton_launch as tk
    from dpcourse.comm.kernels.workspace import PLANS

    out, known = {}, tk.C_LAUNCH_VERSIONS
    for entry, versions in (("c", known), ("runner", ())):
        tk.C_LAUNCH_VERSIONS = versions  # read when a launcher is made
        tk._LAUNCHERS.clear()
        PLANS.clear()
        wrong = mixed_back_to_back(300)
        took = {"c" if launcher.c_launch is launcher.compiled.run.launch
                else "runner" if launcher.c_launch.__name__ == "through_runner" else "?"
                for launcher in tk._LAUNCHERS.values()}
        out[entry] = (wrong, took)
    tk.C_LAUNCH_VERSIONS = known
    out["this_triton_is_known"] = triton.__version__.startswith(known)
    return out


@pytest.mark.gpu(2)
def test_the_c_launcher_and_tritons_runner_both_reduce_correctly():
    """The C launcher (the Triton versions checked) and Triton's runner (any other)."""
    for rank, res in enumerate(dpcourse.run(launch_entries, world_size=GPUS, backend="nccl",
                                            timeout=600)):
        assert res["c"][0] == [] and res["runner"][0] == [], f"rank {rank}: {res}"
        assert res["runner"][1] == {"runner"}
        assert res["c"][1] == ({"c"} if res["this_triton_is_known"] else {"runner"})


def zero_copy() -> list:
    from dpcourse.comm.kernels import symmetric_empty

    rank = dist.get_rank()
    out = []
    for n in (5, 4097, 1 << 20):
        # Two symmetric tensors of one size, reduced in turn: each call after the first of a
        # tensor takes its own launch plan, which must launch on that tensor and no other.
        pair = [symmetric_empty(n, dtype=torch.float32) for _ in range(2)]
        for call in range(3):
            for k, t in enumerate(pair):
                t.copy_(torch.arange(n, dtype=torch.float32) * (rank + 1) * (k + 1 + call))
                ref = t.clone()
                dist.all_reduce(ref)
                two_shot_all_reduce(t)
                torch.testing.assert_close(t, ref)
        out.append(n)
    return out


@pytest.mark.gpu(2)
def test_two_shot_reduces_a_symmetric_tensor_in_place():
    assert dpcourse.run(zero_copy, world_size=GPUS, backend="nccl")[0] == [5, 4097, 1 << 20]


def ddp_with_kernel(kernel: str) -> dict:
    from ddp_helpers import global_batch, loss_of, make_model, state_of

    from dpcourse.comm import OnCommStream
    from dpcourse.data import shard_batch
    from dpcourse.ddp import DataParallelOverlapped

    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", rank)
    base = make_model("gpt").to(dev)
    fn = KERNELS[kernel.removesuffix("_comm_stream")]
    if kernel.endswith("_comm_stream"):
        fn = OnCommStream(fn)
    ours = DataParallelOverlapped(copy.deepcopy(base), bucket_cap_mb=0.002, all_reduce=fn)
    ref = torch.nn.parallel.DistributedDataParallel(copy.deepcopy(base), device_ids=[rank])
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (ours, ref)]
    diffs = []
    for step in range(3):
        xs, ys = (t.to(dev) for t in global_batch("gpt", step))
        for model, opt in zip((ours, ref), opts):
            loss_of("gpt", model, shard_batch(xs, rank, world), shard_batch(ys, rank, world)).backward()
            opt.step()
            opt.zero_grad()
        a, b = state_of(ours), state_of(ref)
        diffs.append(max((a[k] - b[k]).abs().max().item() for k in a))
    return {"diffs": diffs}


@pytest.mark.gpu(2)
@pytest.mark.parametrize("kernel", ["one_shot", "two_shot", "two_shot_comm_stream"])
def test_overlapped_ddp_with_the_kernel_matches_torch_ddp(kernel):
    for res in dpcourse.run(ddp_with_kernel, kernel, world_size=GPUS, backend="nccl"):
        assert max(res["diffs"]) < 1e-4, res


def test_on_comm_stream_reduces_a_cpu_tensor_by_a_direct_call():
    from dpcourse.comm import OnCommStream
    from dpcourse.comm.collective import sum_over_ranks

    calls = []
    x = torch.ones(3)
    assert sum_over_ranks(x, all_reduce=OnCommStream(lambda t, group=None: calls.append(t)),
                          async_op=True) is None
    assert calls == [x]


@pytest.mark.gpu
def test_on_comm_stream_runs_after_the_callers_work_and_before_what_waits():
    """The all-reduce runs on another stream, after what the caller queued, before what waits;
    every OnCommStream of the process shares that stream."""
    from dpcourse.comm import OnCommStream
    from dpcourse.comm.collective import sum_over_ranks

    streams = []

    def doubling(tensor, group=None):  # stands in for a kernel: enqueues on the current stream
        streams.append(torch.cuda.current_stream())
        torch.cuda._sleep(10**7)  # a slow reduction: a missing wait would read too early
        tensor.mul_(2)

    x = torch.ones(1 << 20, device="cuda")
    torch.cuda._sleep(10**7)  # the caller's work is still running when the call is made ...
    x.fill_(3)
    work = sum_over_ranks(x, all_reduce=OnCommStream(doubling), async_op=True)
    assert streams[0] != torch.cuda.current_stream()
    work.wait()
    assert torch.equal(x, torch.full_like(x, 6.0))  # ... and the reduction came after it
    OnCommStream(doubling)(x)  # another wrapper: the same stream, so the calls keep their order
    assert streams[1] == streams[0] and torch.equal(x, torch.full_like(x, 12.0))


# -- the exercise's plumbing, on the CPU ---------------------------------------------------
def test_learner_kernel_travels_as_source_and_knows_a_stub():
    import pickle

    from dpcourse.comm.kernels.exercise import LearnerKernel, kernel, tl

    @kernel
    def my_kernel(x, n, BLOCK: tl.constexpr):
        """A docstring."""
        return x

    assert isinstance(my_kernel, LearnerKernel) and my_kernel.name == "my_kernel"
    assert my_kernel.source.startswith("def my_kernel(") and "@kernel" not in my_kernel.source
    again = pickle.loads(pickle.dumps(my_kernel))
    assert (again.name, again.source) == (my_kernel.name, my_kernel.source)
    assert not my_kernel.is_stub()
    stub = LearnerKernel("k", 'def k(x):\n    raise NotImplementedError("Exercise 12.1")\n')
    assert stub.is_stub()


def check_nvlink_kernels(one_shot_kernel, two_shot_kernel=None, *, quiet: bool = False) -> dict:
    """Run ``check("nvlink_kernels", ...)``; return ``{"skipped", "message", "results"}``.

    ``results`` is ``{kind: {criterion: passed}}`` for each kernel given, empty when skipped.
    """
    from dpcourse.grading.checks.ex12_nvlink_kernels import NvlinkKernels
    from dpcourse.grading.runner import check

    extras = {"two_shot": two_shot_kernel} if two_shot_kernel is not None else {}
    result = check("nvlink_kernels", one_shot_kernel, quiet=quiet, **extras)
    if result.not_graded:  # nothing ran: no criterion has a verdict
        return {"skipped": True, "message": result.not_graded, "results": {}}
    return {"skipped": False, "message": "",
            "results": {kind: {c.name.removeprefix(f"{kind}_"): result.criterion(c.name).passed
                               for c in NvlinkKernels.criteria if c.name.startswith(kind)}
                        for kind in ("one_shot", *extras)}}


@pytest.mark.skipif(GPUS >= 2, reason="checks the message shown on machines without 2 GPUs")
def test_exercise_check_skips_with_a_message_without_gpus(capsys):
    from dpcourse.comm.kernels.exercise import LearnerKernel

    k = LearnerKernel("one_shot_kernel", "def one_shot_kernel(x):\n    pass\n")
    report = check_nvlink_kernels(k)
    assert report["skipped"] and "at least 2 CUDA GPUs" in capsys.readouterr().out


def _solution_kernels():
    """The module of solution 12's ``@kernel`` cells (one_shot_kernel, two_shot_kernel)."""
    import json
    import pathlib
    import sys
    import tempfile

    root = pathlib.Path(__file__).resolve().parents[1]
    cells = json.loads((root / "solutions" / "12_nvlink_kernels.ipynb").read_text())["cells"]
    src = "\n\n".join("".join(c["source"]) for c in cells
                      if c["cell_type"] == "code" and "@kernel" in "".join(c["source"]))
    with tempfile.TemporaryDirectory() as tmp:
        path = pathlib.Path(tmp) / "solution12.py"
        path.write_text("from dpcourse.comm.kernels.exercise import block_barrier, kernel, "
                        "peer_delta, tl\n" + src)
        sys.path.insert(0, tmp)
        try:
            import solution12
        finally:
            sys.path.remove(tmp)
    return solution12


@pytest.mark.gpu(2)
def test_exercise_check_passes_the_solution_kernels():
    solution12 = _solution_kernels()
    report = check_nvlink_kernels(solution12.one_shot_kernel, solution12.two_shot_kernel,
                                  quiet=True)
    assert all(all(v.values()) for v in report["results"].values()), report


# -- exercise 12's two-shot: the sums must be loaded from their owners, not pushed ----------
def _buffers_after_a_call(inputs, ws: int, pushed: bool, own_sum: bool = True) -> list[dict]:
    """What each rank returns for each two-shot case: its result and its buffer half."""
    from dpcourse.comm.kernels.allreduce import ALIGN
    from dpcourse.grading.checks.ex12_nvlink_kernels import _cases, make_input

    ranks = [{"cases": [], "buffer": []} for _ in range(ws)]
    for _, n, dtype, how, seed in _cases(inputs):
        probe, length = inputs["probes"][str(n)], chunk_size(n, ws, align=ALIGN)
        mine = [make_input(seed, r, n, dtype, how)[probe] for r in range(ws)]
        total = sum(m.float() for m in mine).to(mine[0].dtype)
        for r, got in enumerate(ranks):
            owned = probe // length == r
            if pushed:  # lesson 12: the owners stored their sums into this rank's buffer
                buffer = torch.where(owned, torch.zeros_like(total), total)
            else:
                buffer = torch.where(owned, total if own_sum else mine[r], mine[r])
            got["cases"].append(total)
            got["buffer"].append(buffer)
    return ranks


@pytest.mark.parametrize("ws", [2, 4])
def test_exercise_12_tells_a_pulling_two_shot_from_lesson_12s_pushing_one(ws):
    import random

    from dpcourse.grading.checks.ex12_nvlink_kernels import _judge_pulls
    from dpcourse.grading.checks import get_spec

    (inputs,) = get_spec("nvlink_kernels").make_inputs(random.Random(ws), 1)
    verdicts = {how: _judge_pulls(ws, inputs, _buffers_after_a_call(inputs, ws, **kw))
                for how, kw in (("pulls", {"pushed": False}), ("pushes", {"pushed": True}),
                                ("keeps no sum", {"pushed": False, "own_sum": False}))}
    assert verdicts["pulls"] and all(v.passed for v in verdicts["pulls"])
    assert all(not v.passed for v in verdicts["pushes"])
    assert "stored into it (pushed)" in verdicts["pushes"][0].detail
    # A rank that keeps its sum only in x: its peers could not have loaded it. (With one or
    # a few elements a small-integer sum can equal the rank's own input by chance.)
    assert all(not v.passed for v in verdicts["keeps no sum"] if int(v.case.split()[0]) > 16)
    assert "does not hold its sum" in verdicts["keeps no sum"][0].detail


def test_exercise_12_credits_two_shot_only_once_it_pulls():
    from dpcourse.grading.checks import get_spec

    spec = get_spec("nvlink_kernels")
    two_shot = [c for c in spec.criteria if c.name.startswith("two_shot_")]
    assert {c.name for c in two_shot if c.needs == ("two_shot_pulls_the_sums",)} == {
        c.name for c in two_shot} - {"two_shot_pulls_the_sums"}
    assert all(not c.needs for c in spec.criteria if c.name.startswith("one_shot_"))


@pytest.mark.gpu(2)
def test_exercise_12_check_fails_lesson_12s_pushing_two_shot_on_placement_only():
    from dpcourse.comm.kernels import kernel_source
    from dpcourse.comm.kernels.exercise import LearnerKernel
    from dpcourse.grading import check
    from dpcourse.grading.checks.ex12_nvlink_kernels import CRITERIA

    # Lesson 12's printed kernel handed in as the answer: right sums, but pushed.
    two_shot = kernel_source("two_shot_kernel")  # "@triton.jit" first: the check adds its own
    pushing = LearnerKernel("two_shot_kernel", two_shot[two_shot.index("def "):] + "\n\n"
                            + kernel_source("copy_other_slices") + "\n")
    result = check("nvlink_kernels", _solution_kernels().one_shot_kernel, two_shot=pushing,
                   quiet=True)
    pulls = result.criterion("two_shot_pulls_the_sums")
    assert not pulls.passed and "(pushed)" in pulls.detail, pulls
    for c in CRITERIA:  # every sum was right, yet none of two-shot's criteria is credited
        assert result.criterion(f"one_shot_{c.name}").passed
        two = result.criterion(f"two_shot_{c.name}")
        assert not two.passed and two.detail.startswith("not credited"), two

