"""What lessons 00-05 and their exercises say about torch and gloo, asked of torch itself.

Like ``tests/test_torch_facts.py``: every test asks torch (its collectives, its DDP, its
sampler, its modules and optimizers), never dpcourse, and each docstring names the lesson
or exercise sentence it backs. The probes that need a process group run in one launch of
2 gloo ranks (a module fixture), so the file stays quick on a small CPU machine.
"""

from __future__ import annotations

import inspect
import os
import pickle
import socket
import subprocess
import sys
import textwrap
import threading
import time
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data.distributed import DistributedSampler

import dpcourse
from test_torch_facts import ddp_bucket_sizes

MiB = 2**20


def _torch_at_least(major: int, minor: int) -> bool:
    return tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2]) >= (major, minor)


# --------------------------------------------------------------------------- 2-rank probes


def _probe_default_op():
    """all_reduce with no op: its signature's default, and what every rank holds after it."""
    t = torch.tensor([dist.get_rank() + 1.0])
    dist.all_reduce(t)
    default = inspect.signature(dist.all_reduce).parameters["op"].default
    return dict(after=t.item(), default_is_sum=default == dist.ReduceOp.SUM)


def _probe_blocking_send():
    """Rank 0's dist.send, on a thread: still running 1 s later while rank 1 has posted no recv?"""
    store = dist.distributed_c10d._get_default_store()
    t = torch.full((4,), 7.0) if dist.get_rank() == 0 else torch.zeros(4)
    if dist.get_rank() == 0:
        sender = threading.Thread(target=dist.send, args=(t, 1))
        sender.start()
        time.sleep(1.0)
        waiting = sender.is_alive()  # no receive posted yet
        store.set("recv_may_start", "1")
        sender.join(60)
        return dict(send_waiting_without_recv=waiting, send_done_after_recv=not sender.is_alive())
    store.wait(["recv_may_start"])
    dist.recv(t, 0)
    return dict(received=t.tolist())


def _probe_ddp_parameters():
    """DDP over a model built differently on every rank: its parameters after construction,
    and after a later change on rank 1 followed by a forward."""
    torch.manual_seed(dist.get_rank())  # a different model on every rank
    model = torch.nn.Linear(4, 2)
    before = model.weight.detach().clone()
    ddp = DDP(model)
    after_construction = model.weight.detach().clone()
    rank0 = after_construction.clone()
    dist.broadcast(rank0, src=0)
    with torch.no_grad():
        model.weight.add_(float(dist.get_rank()))  # rank 1 moves away from rank 0's weights
    changed = model.weight.detach().clone()
    ddp(torch.randn(3, 4)).sum().backward()
    return dict(differed=not torch.equal(before, rank0), equal_to_rank0=torch.equal(after_construction, rank0),
                kept_after_forward=torch.equal(model.weight.detach(), changed))


def _probe_buffer_flag():
    """torch 2.13's forward_sync_buffers and the old broadcast_buffers: the defaults, which name
    warns, and whether rank-dependent buffers equal rank 0's right after construction."""
    names = set(inspect.signature(DDP.__init__).parameters)
    out = dict(has_broadcast_buffers="broadcast_buffers" in names,
               has_forward_sync_buffers="forward_sync_buffers" in names)
    plain = DDP(torch.nn.Linear(2, 2))
    out["default_on"] = plain.broadcast_buffers is True
    if not out["has_forward_sync_buffers"]:
        return out
    out["default_new_flag"] = plain.forward_sync_buffers is True
    for name, kw in (("default", {}), ("forward_sync_buffers", dict(forward_sync_buffers=False)),
                     ("broadcast_buffers", dict(broadcast_buffers=False))):
        norm = torch.nn.BatchNorm1d(4)
        with torch.no_grad():
            norm.running_mean.fill_(float(dist.get_rank() + 1))  # the ranks' buffers differ
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            ddp = DDP(torch.nn.Sequential(torch.nn.Linear(4, 4), norm), **kw)
        mean = norm.running_mean.clone()
        rank0 = mean.clone()
        dist.broadcast(rank0, src=0)
        out[name] = dict(warns=any("deprecated" in str(w.message) for w in caught),
                         flag=ddp.forward_sync_buffers, alias=ddp.broadcast_buffers,
                         rank0_buffers_at_construction=torch.equal(mean, rank0))
    return out


def _probe_all_gather_object():
    """The all_gathers torch's all_gather_object issues for pieces of different sizes."""
    from torch.distributed import distributed_c10d as c10d

    calls, original = [], c10d.all_gather

    def recorded(tensor_list, tensor, *args, **kwargs):
        calls.append(dict(outputs=len(tensor_list), numel=tensor.numel(),
                          output_numels=[t.numel() for t in tensor_list]))
        return original(tensor_list, tensor, *args, **kwargs)

    mine = list(range(1000)) if dist.get_rank() == 0 else list(range(10))
    everyone = [None] * dist.get_world_size()
    c10d.all_gather = recorded
    try:
        dist.all_gather_object(everyone, mine)
    finally:
        c10d.all_gather = original
    return dict(calls=calls, everyone_ok=everyone == [list(range(1000)), list(range(10))],
                pickled=[len(pickle.dumps(list(range(n)))) for n in (1000, 10)])


def _probe_first_bucket():
    # ten 256 KiB gradients, 2.5 MiB in all: far below a 25 MiB cap, above 1 MiB
    return dict(default=ddp_bucket_sizes({}, width=256),
                cap25=ddp_bucket_sizes({"bucket_cap_mb": 25}, width=256))


def _probe_all():
    return {name: fn() for name, fn in (
        ("default_op", _probe_default_op), ("blocking_send", _probe_blocking_send),
        ("ddp_parameters", _probe_ddp_parameters), ("buffer_flag", _probe_buffer_flag),
        ("all_gather_object", _probe_all_gather_object), ("first_bucket", _probe_first_bucket))}


@pytest.fixture(scope="module")
def ranks():
    """The probes' results on each of 2 gloo ranks (CPU, no GPU visible)."""
    return dpcourse.run(_probe_all, world_size=2, backend="gloo", device="cpu", timeout=240)


# =================================================================== lessons 00 and 01


def test_all_reduce_sums_by_default(ranks):
    """Lesson 01, "Summing instead of averaging" (and lesson 00's first all-reduce): with no
    ``op``, all_reduce leaves every rank with the sum (1 + 2 = 3 on 2 ranks), its default
    being ReduceOp.SUM."""
    for r in ranks:
        assert r["default_op"] == dict(after=3.0, default_is_sum=True)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


_ENV_INIT = textwrap.dedent("""
    import torch.distributed as dist
    try:
        dist.init_process_group("gloo")
    except Exception as exc:
        print("error:", exc)
    else:
        print("rank", dist.get_rank(), "world", dist.get_world_size())
        dist.destroy_process_group()
""")


def test_init_process_group_reads_rank_and_world_size_from_the_environment():
    """Lesson 00, "The same program from a terminal": a script launched by torchrun calls
    ``init_process_group(backend)`` with no rank or world size; torch then reads RANK and
    WORLD_SIZE (and MASTER_ADDR, MASTER_PORT) from the environment, and fails without them:
    without any one of the four, the error names the missing variable."""
    names = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    base = {k: v for k, v in os.environ.items() if k not in names + ("LOCAL_RANK",)}
    env = dict(base, RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
    envs = [env] + [{k: v for k, v in env.items() if k != name} for name in names]
    # the five interpreters start together: each spends most of its time importing torch
    procs = [subprocess.Popen([sys.executable, "-c", _ENV_INIT], env=e, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for e in envs]
    outs = [p.communicate(timeout=120) for p in procs]
    assert outs[0][0].strip() == "rank 0 world 1", outs[0][1][-2000:]
    for name, (out, err) in zip(names, outs[1:]):
        assert out.startswith("error:"), (name, out + err[-2000:])
        assert f"environment variable {name} expected, but not set" in out, (name, out)


_TWO_GLOO_PROCESSES = textwrap.dedent("""
    import datetime, sys, time, torch, torch.distributed as dist
    rank, port, seconds = int(sys.argv[1]), sys.argv[2], float(sys.argv[3])
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2, timeout=datetime.timedelta(seconds=seconds))
    store = dist.distributed_c10d._get_default_store()
""")


def _two_gloo_processes(body: str, pg_timeout_s: float) -> list[tuple[int, str, str]]:
    """Run ``body`` in 2 plain processes joined over gloo (not dpcourse's ranks, which stay
    alive after an exception); return each one's (exit status, stdout, stderr)."""
    script = _TWO_GLOO_PROCESSES + textwrap.dedent(body)
    port = str(_free_port())
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    procs = [subprocess.Popen([sys.executable, "-c", script, str(r), port, str(pg_timeout_s)],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for r in range(2)]
    outs = [p.communicate(timeout=120 + 2 * pg_timeout_s) for p in procs]
    return [(p.returncode, out, err) for p, (out, err) in zip(procs, outs)]


_RAISES_AND_EXITS = """
    dist.barrier()  # both processes are up
    if rank == 1:
        store.wait(["rank0_in_barrier"])
        time.sleep(0.5)  # rank 0 is inside its barrier by now
        raise FileNotFoundError("shard-0001.bin is missing")  # uncaught: the process exits
    store.set("rank0_in_barrier", "1")
    t0 = time.perf_counter()
    try:
        dist.barrier()  # waits for rank 1, which raises instead
        print("no error")
    except RuntimeError as err:
        print(f"{time.perf_counter() - t0:.3f} {err}")
    from dpcourse.launch.teardown import destroy_and_exit
    destroy_and_exit(0)
"""


def test_a_partner_that_raises_and_exits_fails_the_waiting_collective_at_once():
    """Lesson 00, "When a rank fails": when the failing rank's process exits (an uncaught
    exception, in a plain script), its gloo partner, already waiting in a barrier, fails at once
    with a connection error ("Connection closed by peer"), long before the process group's
    timeout (60 s here)."""
    (code0, out0, err0), (code1, _, err1) = _two_gloo_processes(_RAISES_AND_EXITS, 60)
    assert code1 != 0 and "FileNotFoundError: shard-0001.bin is missing" in err1, err1[-2000:]
    assert code0 == 0, err0[-2000:]
    seconds, message = out0.split(" ", 1)
    assert "Connection closed by peer" in message or "Connection reset by peer" in message, out0
    assert float(seconds) < 30  # far below the timeout: it did not wait for it


_MISMATCHED = """
    t = torch.zeros(1)
    t0 = time.perf_counter()
    try:
        if rank == 0:
            dist.all_reduce(t)   # waits for an all-reduce from rank 1...
        else:
            dist.recv(t, src=0)  # ...which waits for a message from rank 0
        print("no error")
    except RuntimeError as err:
        print(f"{time.perf_counter() - t0:.3f} {err}")
    from dpcourse.launch.teardown import destroy_and_exit
    destroy_and_exit(0)
"""


def test_mismatched_collectives_wait_until_the_process_group_timeout():
    """Lesson 00, "When a rank fails": two live ranks that disagree about the next call (rank 0
    in an all-reduce, rank 1 in a recv from rank 0) both wait until the process group's timeout
    (3 s here), then both fail with a timeout error."""
    for code, out, err in _two_gloo_processes(_MISMATCHED, 3):
        assert code == 0, err[-2000:]
        seconds, message = out.split(" ", 1)
        assert "Timed out" in message, out
        assert 2.9 <= float(seconds) < 60


def test_adam_state_is_two_moments_shaped_like_the_parameter_and_a_scalar_step():
    """Lesson 01, "What every rank holds": after its first step, torch's Adam keeps for each
    parameter tensor two running averages of the parameter's shape and float32 dtype
    (exp_avg, exp_avg_sq), twice the weights' bytes, plus a one-element step counter."""
    model = torch.nn.Sequential(torch.nn.Linear(5, 3), torch.nn.Linear(3, 1))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    model(torch.randn(4, 5)).sum().backward()
    opt.step()
    for p in model.parameters():
        state = opt.state[p]
        assert set(state) == {"step", "exp_avg", "exp_avg_sq"}
        for key in ("exp_avg", "exp_avg_sq"):
            assert state[key].shape == p.shape and state[key].dtype == torch.float32
        assert state["step"].numel() == 1 and state["step"].dim() == 0


def test_mean_loss_of_an_empty_shard_is_nan_and_its_gradient_zero():
    """Exercise 01: the mean loss over an empty shard is 0/0, NaN, and the gradient autograd
    computes from it is zero."""
    layer = torch.nn.Linear(3, 1)
    loss = F.mse_loss(layer(torch.zeros(0, 3)), torch.zeros(0, 1))
    assert loss.isnan()
    loss.backward()
    assert all(p.grad is not None and torch.equal(p.grad, torch.zeros_like(p)) for p in layer.parameters())


# =================================================================== lesson 02


def test_ddp_copies_rank0_parameters_at_construction_only(ranks):
    """Lesson 02, introduction and "Broadcast before every forward": torch DDP makes every rank's
    parameters rank 0's when it is built; after that it copies no parameters (a parameter
    changed on rank 1 afterwards is still rank 1's own after a forward and backward)."""
    for r in ranks:
        assert r["ddp_parameters"]["equal_to_rank0"] and r["ddp_parameters"]["kept_after_forward"]
    assert ranks[1]["ddp_parameters"]["differed"]  # rank 1 really started from other weights


def test_ddp_buffer_flag_is_forward_sync_buffers_and_broadcast_buffers_is_deprecated(ranks):
    """Lesson 02, introduction: torch DDP's flag for syncing buffers before every forward is
    ``forward_sync_buffers`` in torch 2.13, on by default; ``broadcast_buffers`` still sets it,
    with a warning that the name is deprecated. ``broadcast_buffers=False`` also skips the copy
    of rank 0's buffers at construction, ``forward_sync_buffers=False`` does not."""
    for rank, r in enumerate(ranks):
        flag = r["buffer_flag"]
        assert flag["has_broadcast_buffers"] and flag["default_on"]
        if not _torch_at_least(2, 13):
            continue
        assert flag["has_forward_sync_buffers"] and flag["default_new_flag"]
        assert flag["default"] == dict(warns=False, flag=True, alias=True,
                                       rank0_buffers_at_construction=True)
        assert flag["forward_sync_buffers"] == dict(warns=False, flag=False, alias=False,
                                                    rank0_buffers_at_construction=True)
        # rank 0 holds its own buffers anyway: rank 1 shows that nothing was copied
        assert flag["broadcast_buffers"] == dict(warns=True, flag=False, alias=False,
                                                 rank0_buffers_at_construction=rank == 0)


@pytest.mark.skipif(not _torch_at_least(2, 13), reason="a statement about torch 2.13")
def test_tensor_collectives_are_deprecated_in_2_13():
    """Lesson 02, first code cell: torch 2.13 marks all_gather_into_tensor and
    reduce_scatter_tensor deprecated (a FutureWarning) in favour of all_gather_single and
    reduce_scatter_single."""
    for old, new in (("all_gather_into_tensor", "all_gather_single"),
                     ("reduce_scatter_tensor", "reduce_scatter_single")):
        assert callable(getattr(dist, new))
        with pytest.warns(FutureWarning, match=f"{old}` is deprecated"):
            try:  # no process group here: the warning comes before the call fails
                getattr(dist, old)(torch.zeros(2), torch.zeros(2))
            except (RuntimeError, ValueError):
                pass


def test_batchnorm_has_three_buffers():
    """Lesson 02, "Broadcast before every forward": BatchNorm1d keeps three buffers, its running
    mean, its running variance and its batch counter, and they get no gradient."""
    norm = torch.nn.BatchNorm1d(4)
    assert [n for n, _ in norm.named_buffers()] == ["running_mean", "running_var", "num_batches_tracked"]
    assert not any(b.requires_grad for b in norm.buffers())


def _mismatched_sizes():
    t = torch.ones(3 + dist.get_rank())  # 3 elements on rank 0, 4 on rank 1
    dist.all_reduce(t)
    return t.tolist()


def test_gloo_all_reduce_of_different_sizes_does_not_fail_on_every_rank():
    """Exercise 02: torch does not refuse an all-reduce whose tensors differ in size between
    ranks: over gloo one rank returns from it and the other waits until it is stopped."""
    with pytest.raises(dpcourse.RankTimeoutError) as caught:
        dpcourse.run(_mismatched_sizes, world_size=2, backend="gloo", device="cpu", timeout=8)
    assert len(caught.value.waiting) == 1


def _all_gather_of_different_sizes():
    n = 3 + dist.get_rank()  # 3 elements on rank 0, 4 on rank 1
    outs = [torch.zeros(n) for _ in range(dist.get_world_size())]
    dist.all_gather(outs, torch.ones(n))
    return [o.tolist() for o in outs]


def test_gloo_all_gather_needs_one_size_on_every_rank():
    """Exercise 02: dist.all_gather wants tensors of one size on every rank: with 3 elements on
    rank 0 and 4 on rank 1 it does not complete over gloo (a rank is aborted or left waiting)."""
    with pytest.raises((dpcourse.RankDiedError, dpcourse.RankTimeoutError)):
        dpcourse.run(_all_gather_of_different_sizes, world_size=2, backend="gloo", device="cpu", timeout=10)


def test_all_gather_object_pads_every_piece_to_the_longest(ranks):
    """Exercise 02, after the check: torch's all_gather_object first all-gathers the pieces'
    sizes, then pads every pickled piece to the longest for one all_gather, and trims."""
    for r in ranks:
        probe = r["all_gather_object"]
        longest = max(probe["pickled"])
        assert probe["everyone_ok"]
        assert [c["numel"] for c in probe["calls"]] == [1, longest]  # the sizes, then the padded pieces
        assert probe["calls"][1]["output_numels"] == [longest, longest]


# =================================================================== lesson 03


def _first_orders(seed_line="", runs=2):
    """The first shuffled epoch of a DataLoader with no generator, in `runs` fresh processes."""
    code = (f"import torch; from torch.utils.data import DataLoader; {seed_line}"
            "print(next(iter(DataLoader(list(range(64)), batch_size=64, shuffle=True))).tolist())")
    return [subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                           check=True).stdout for _ in range(runs)]


def test_shuffle_without_generator_follows_each_process_global_seed():
    """Lesson 03, "The bug every first data-parallel script has": a DataLoader with
    shuffle=True and no generator draws its own order in every fresh process, unless the script
    calls torch.manual_seed with the same seed in every process: then every process reads the
    same order."""
    first, second = _first_orders()
    assert sorted(eval(first)) == list(range(64))
    assert first != second
    seeded = _first_orders("torch.manual_seed(0); ")
    assert seeded[0] == seeded[1] and sorted(eval(seeded[0])) == list(range(64))


def test_distributed_sampler_takes_every_nth_index_starting_at_its_rank():
    """Lesson 03, "Three ways to train": torch's DistributedSampler shuffles the indices with
    the same seed on every rank and gives rank r every N-th index of that order, from the r-th."""
    n, world, seed = 24, 3, 7
    g = torch.Generator()
    g.manual_seed(seed)  # epoch 0: seed + 0
    order = torch.randperm(n, generator=g).tolist()
    for rank in range(world):
        sampler = DistributedSampler(range(n), num_replicas=world, rank=rank, shuffle=True, seed=seed)
        assert list(sampler) == order[rank::world]
        plain = DistributedSampler(range(n), num_replicas=world, rank=rank, shuffle=False)
        assert list(plain) == list(range(rank, n, world))


def test_parameters_yield_a_tied_weight_once():
    """Lesson 03, "Counting the collectives": a weight shared by two modules (a tied embedding)
    appears once in module.parameters()."""
    emb, head = torch.nn.Embedding(10, 4), torch.nn.Linear(4, 10, bias=False)
    head.weight = emb.weight
    model = torch.nn.ModuleDict(dict(emb=emb, head=head))
    assert len(list(model.parameters())) == 1
    assert len(list(model.named_parameters(remove_duplicate=False))) == 2


def test_unused_parameter_has_no_gradient():
    """Exercise 03, part 2: a parameter the forward did not use has ``grad is None`` after
    backward."""
    used, unused = torch.nn.Linear(2, 1), torch.nn.Linear(2, 1)
    used(torch.randn(3, 2)).sum().backward()
    assert all(p.grad is not None for p in used.parameters())
    assert all(p.grad is None for p in unused.parameters())


# =================================================================== lesson 04


def test_gloo_send_waits_for_the_matching_receive(ranks):
    """Lesson 04, "The code" (and exercise 04): over gloo, dist.send does not return while its
    receiver has posted no matching receive; it returns once the receive is posted."""
    assert ranks[0]["blocking_send"] == dict(send_waiting_without_recv=True, send_done_after_recv=True)
    assert ranks[1]["blocking_send"] == dict(received=[7.0] * 4)


def test_view_shares_memory_and_needs_compatible_strides():
    """Exercise 04: ``tensor.view(-1)`` shares memory with the tensor, is refused on a
    transposed one, and a contiguous parameter's gradient is contiguous."""
    t = torch.zeros(2, 3)
    t.view(-1)[4] = 1.0
    assert t[1, 1] == 1.0
    with pytest.raises(RuntimeError):
        t.T.view(-1)
    w = torch.nn.Parameter(torch.randn(3, 2))
    (w.T @ torch.randn(3, 5)).sum().backward()  # through a transposed use of w
    assert w.grad.is_contiguous()


# =================================================================== lesson 05


def test_small_first_bucket_only_with_the_default_cap(ranks):
    """Lesson 05, introduction (and exercise 05, part 2): with bucket_cap_mb left at its
    default, torch DDP's rebuilt buckets start with one of about 1 MiB; with bucket_cap_mb=25
    given explicitly, 2.5 MiB of gradients go out as one bucket."""
    for r in ranks:
        sizes = r["first_bucket"]
        assert sizes["cap25"] == [10 * 256 * 256 * 4]
        assert len(sizes["default"]) == 2 and sum(sizes["default"]) == 10 * 256 * 256 * 4
        assert MiB <= sizes["default"][0] < MiB + 256 * 256 * 4  # closes once past 1 MiB


def _new_group_on_rank_0_only():
    """Rank 0 alone creates the group {0}; then both ranks create {0, 1} and all-reduce on it."""
    if dist.get_rank() == 0:
        dist.new_group([0])  # rank 1, not a member, skips this new_group call
    pair = dist.new_group([0, 1])
    t = torch.ones(1)
    dist.all_reduce(t, group=pair)
    return t.item()


def _new_group_on_every_rank():
    dist.new_group([0])  # every rank calls it, members or not
    pair = dist.new_group([0, 1])
    t = torch.ones(1)
    dist.all_reduce(t, group=pair)
    return t.item()


def test_new_group_must_be_called_by_every_rank_members_or_not():
    """Lesson 04, "Run it, check it, count its bytes" (the comments on ``dist.new_group``): every
    rank of the world must call new_group, members or not: when rank 1 skips the creation of the
    group {0}, both ranks wait forever in the creation of the next group, {0, 1}; when both call
    it, the all-reduce on {0, 1} gives 2."""
    assert dpcourse.run(_new_group_on_every_rank, world_size=2, backend="gloo", device="cpu") == [2.0, 2.0]
    with pytest.raises(dpcourse.RankTimeoutError) as caught:
        dpcourse.run(_new_group_on_rank_0_only, world_size=2, backend="gloo", device="cpu", timeout=10)
    assert caught.value.waiting == [0, 1]
    assert all("new_group" in caught.value.stacks[rank] for rank in (0, 1))
