"""What lesson 15 says about torch and gloo when a distributed job goes wrong, asked of torch.

Every failure is planted on 2 CPU ranks over gloo, each in a process group of its own
with a timeout of a few seconds, so nothing waits for gloo's default 30 minutes. The
probes without debug settings run in one launch, those under
``TORCH_DISTRIBUTED_DEBUG=DETAIL`` in a second (torch reads the variable when a rank
starts); a rank that dies runs in two bare processes, since a launcher would stop its
partner. The tests check torch's own messages, never dpcourse's.
"""

from __future__ import annotations

import os
import pickle
import socket
import subprocess
import sys
import textwrap
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

import dpcourse

TIMEOUT_S = 2.0  # each probe's process-group timeout


def _group(seconds=TIMEOUT_S):
    return dist.new_group(backend="gloo", timeout=timedelta(seconds=seconds))


def _attempt(fn):
    """Run ``fn()``; return what it returned or its error's first line, and the seconds taken."""
    t0 = time.perf_counter()
    try:
        out = dict(result=fn(), error=None)
    except RuntimeError as err:
        out = dict(result=None, error=str(err).splitlines()[0] if str(err) else type(err).__name__)
    out["seconds"] = time.perf_counter() - t0
    dist.barrier()  # the default group (long timeout): both ranks start the next probe together
    return out


def _skip(group):
    if dist.get_rank() == 0:
        dist.all_reduce(torch.ones(3), group=group)  # rank 1 never calls it


def _order(group):
    t = torch.ones(3)
    if dist.get_rank() == 0:
        dist.all_reduce(t, group=group)
        dist.broadcast(t, 0, group=group)
    else:
        dist.broadcast(t, 0, group=group)
        dist.all_reduce(t, group=group)


def _shape(group):
    t = torch.ones(3 + dist.get_rank())  # rank 0: 3 elements, rank 1: 4
    dist.all_reduce(t, group=group)
    return t.tolist()


def _recv_first(group):
    t, other = torch.zeros(2), 1 - dist.get_rank()
    dist.recv(t, src=other, group=group)  # both ranks receive first: nobody sends
    dist.send(t, dst=other, group=group)


def _batched_exchange(group):
    mine, theirs, other = torch.full((2,), float(dist.get_rank())), torch.zeros(2), 1 - dist.get_rank()
    ops = [dist.P2POp(dist.isend, mine, other, group), dist.P2POp(dist.irecv, theirs, other, group)]
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    return theirs.tolist()


def _exchange_by_rank(group):
    """Even ranks send first and then receive, odd ranks receive first and then send."""
    rank = dist.get_rank()
    mine, theirs, other = torch.full((2,), float(rank)), torch.zeros(2), 1 - rank
    if rank % 2 == 0:
        dist.send(mine, dst=other, group=group)
        dist.recv(theirs, src=other, group=group)
    else:
        dist.recv(theirs, src=other, group=group)
        dist.send(mine, dst=other, group=group)
    return theirs.tolist()


def _late_rank(group, late_s=2.5):
    if dist.get_rank() == 1:
        time.sleep(late_s)  # a slow step on one rank: a checkpoint write, a data stall
    t = torch.ones(1)
    dist.all_reduce(t, group=group)
    return t.item()


def _monitored(group):
    if dist.get_rank() == 0:
        dist.monitored_barrier(group=group, timeout=timedelta(seconds=TIMEOUT_S))


def _flight_record(group):
    """Rank 0 issues two all-reduces, rank 1 only the first; each rank's recorded collectives."""
    dist.all_reduce(torch.ones(3), group=group)
    try:
        _skip(group)  # rank 0's second all-reduce waits in vain until the timeout
    except RuntimeError:
        pass  # the record is read below
    trace = pickle.loads(torch._C._distributed_c10d._dump_fr_trace())
    name = dist.distributed_c10d._get_process_group_name(group)
    return [(e["collective_seq_id"], e["profiling_name"]) for e in trace["entries"]
            if e["process_group"][0] == name]


def _probe_plain():
    return dict(
        skip=_attempt(lambda: _skip(_group())),
        order=_attempt(lambda: _order(_group())),
        shape=_attempt(lambda: _shape(_group())),
        recv_first=_attempt(lambda: _recv_first(_group())),
        batched=_attempt(lambda: _batched_exchange(_group())),
        by_rank=_attempt(lambda: _exchange_by_rank(_group())),
        monitored=_attempt(lambda: _monitored(_group(10))),
        short=_attempt(lambda: _late_rank(_group(1))),
        long=_attempt(lambda: _late_rank(_group(10))),
        flight=_attempt(lambda: _flight_record(_group())),
        debug_level=str(dist.get_debug_level()),
    )


def _probe_detail():
    return dict(skip=_attempt(lambda: _skip(_group())),
                order=_attempt(lambda: _order(_group())),
                shape=_attempt(lambda: _shape(_group())),
                debug_level=str(dist.get_debug_level()))


def _launch(probe, **env):
    """Launch ``probe`` on 2 gloo ranks that start with ``env`` set (a value None: unset)."""
    saved = {k: os.environ.pop(k, None) for k in env}
    os.environ.update({k: v for k, v in env.items() if v is not None})
    try:
        return dpcourse.run(probe, world_size=2, backend="gloo", device="cpu", timeout=120)
    finally:
        for k, v in saved.items():
            os.environ.pop(k, None)
            if v is not None:
                os.environ[k] = v


@pytest.fixture(scope="module")
def plain():
    # The flight recorder's size set, as in the lesson: no dependence on a version's default.
    return _launch(_probe_plain, TORCH_DISTRIBUTED_DEBUG="OFF", TORCH_FR_BUFFER_SIZE="100")


@pytest.fixture(scope="module")
def detail():
    return _launch(_probe_detail, TORCH_DISTRIBUTED_DEBUG="DETAIL")


def test_skipped_collective_times_out_at_the_group_timeout(plain):
    """Lesson 15, section 1: a rank that skips a collective leaves the others waiting in it
    until the group's timeout; gloo then raises a RuntimeError that names no rank."""
    waiting, skipper = plain[0]["skip"], plain[1]["skip"]
    assert skipper["error"] is None
    assert waiting["error"].endswith("Timed out waiting 2000ms for recv operation to complete"), \
        waiting
    assert "rank" not in waiting["error"].lower()
    assert TIMEOUT_S - 0.1 <= waiting["seconds"]


def test_detail_names_the_rank_that_skipped(detail):
    """Lesson 15, section 1: under TORCH_DISTRIBUTED_DEBUG=DETAIL the waiting rank's error says
    which rank failed to arrive (torch runs a monitored barrier before each collective)."""
    assert [r["debug_level"] for r in detail] == ["DebugLevel.DETAIL"] * 2
    assert "Ranks 1 failed to pass monitoredBarrier" in detail[0]["skip"]["error"], detail[0]


def test_monitored_barrier_names_the_missing_rank(plain):
    """Lesson 15, section 1: on gloo, rank 0's dist.monitored_barrier names the rank that did not
    arrive within its timeout."""
    assert plain[0]["debug_level"] == "DebugLevel.OFF"
    assert "Rank 1 failed to pass monitoredBarrier in 2000 ms" in plain[0]["monitored"]["error"]


def test_collectives_in_different_orders_time_out_without_detail(plain):
    """Lesson 15, section 2: gloo does not pair an all-reduce with a broadcast: without debug
    settings both ranks fail (the first by timing out; its partner may instead see the connection
    close), and neither message mentions a mismatch."""
    errors = [r["order"]["error"] for r in plain]
    assert all(errors) and not any("mismatch" in e for e in errors), errors
    assert any("Timed out" in e for e in errors), errors  # the other may see its partner leave


def test_detail_names_collectives_in_different_orders(detail):
    """Lesson 15, section 2: under DETAIL the first collective raises at once on both ranks and
    the message names each rank's operation."""
    for r in detail:
        e = r["order"]["error"]
        assert "Detected mismatch between collectives on ranks" in e, e
        assert "OpType=ALLREDUCE" in e and "OpType=BROADCAST" in e
        assert r["order"]["seconds"] < TIMEOUT_S  # no waiting for the timeout


def test_shape_mismatch_without_detail_is_a_timeout(plain):
    """Lesson 15, section 3: all-reducing 3 elements on one rank and 4 on the other gives no
    shape error without debug settings: a rank fails with a timeout."""
    errors = [r["shape"]["error"] for r in plain]
    assert any(e and "Timed out" in e for e in errors), errors
    assert not any(e and ("shape" in e.lower() or "mismatch" in e) for e in errors), errors


def test_detail_names_the_shapes(detail):
    """Lesson 15, section 3: under DETAIL the message names both shapes."""
    e = detail[0]["shape"]["error"]
    assert "TensorShape=[3]" in e and "TensorShape=[4]" in e and "Tensor shapes: 3vs 4" in e, e


def test_both_ranks_receiving_first_deadlock_until_timeout(plain):
    """Lesson 15, section 5: two ranks that both call dist.recv before dist.send wait for each
    other until the timeout; batch_isend_irecv posts both sides at once and completes."""
    errors = [r["recv_first"]["error"] for r in plain]
    assert all(errors) and any("Timed out" in e for e in errors), errors
    assert all(r["recv_first"]["seconds"] >= TIMEOUT_S - 0.1 for r in plain)
    assert [r["batched"]["result"] for r in plain] == [[1.0, 1.0], [0.0, 0.0]]


def test_ordering_send_and_recv_by_rank_completes_the_exchange(plain):
    """Lesson 15, section 5: ordering by rank (even ranks send first, odd ranks receive first)
    fixes the deadlock: both ranks get the other's tensor, well inside the group's timeout."""
    assert [r["by_rank"]["error"] for r in plain] == [None, None]
    assert [r["by_rank"]["result"] for r in plain] == [[1.0, 1.0], [0.0, 0.0]]
    assert all(r["by_rank"]["seconds"] < TIMEOUT_S / 2 for r in plain)


def test_a_timeout_shorter_than_a_slow_step_fails_a_correct_program(plain):
    """Lesson 15, section 6: rank 1 reaches the all-reduce 2.5 s late: a 1 s group timeout fails
    rank 0, a 10 s one gives the sum on both ranks."""
    assert "Timed out waiting 1000ms" in plain[0]["short"]["error"]
    assert [r["long"]["result"] for r in plain] == [2.0, 2.0]


def test_gloo_flight_recorder_shows_the_rank_that_fell_behind(plain):
    """Lesson 15, section 7: the flight recorder (TORCH_FR_BUFFER_SIZE=100, as the lesson sets
    it) records gloo collectives too; each rank's record ends at its last collective's sequence
    number."""
    records = [r["flight"]["result"] for r in plain]
    assert records[0] == [(1, "gloo:all_reduce"), (2, "gloo:all_reduce")], records
    assert records[1] == [(1, "gloo:all_reduce")], records


_DYING = textwrap.dedent("""
    import os, sys, time, datetime, torch, torch.distributed as dist
    rank, port = int(sys.argv[1]), sys.argv[2]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2, timeout=datetime.timedelta(seconds=20))
    t = torch.ones(3)
    dist.all_reduce(t)
    if rank == 1:
        os._exit(1)  # dies mid-step
    t0 = time.perf_counter()
    try:
        dist.all_reduce(t)
        print("no error")
    except RuntimeError as err:
        print(f"{time.perf_counter() - t0:.3f} {err}")
""")


def test_a_dead_partner_fails_the_next_collective_at_once():
    """Lesson 15, section 4: when a gloo rank's process dies, its partner's next collective fails
    within seconds with a connection error, not at the 20 s timeout."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    procs = [subprocess.Popen([sys.executable, "-c", _DYING, str(r), port], env=env, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE) for r in range(2)]
    out = [p.communicate(timeout=60)[0] for p in procs]
    assert procs[1].returncode == 1
    seconds, message = out[0].split(" ", 1)
    assert "Connection" in message and "peer" in message, out[0]
    assert float(seconds) < 10


# ------------------------------------------------------------------ exercise 15's check
# The solution's cells, then one planted cell that redefines a single name: the grader takes the
# last definition of each name, so each run grades the solution with one mistake in it.

_PLANTED = {
    "causes": '''
def diagnosis():
    return {"A": "order_mismatch", "B": "p2p_deadlock", "C": "skipped_collective",
            "D": "dead_rank", "E": "timeout_too_short", "F": "shape_mismatch"}
''',
    "histogram": '''
def global_histogram(labels, num_classes, group=None):
    counts = torch.bincount(labels)  # the job's bug: the length comes from the data
    dist.all_reduce(counts, group=group)
    return counts
''',
    "exchange": '''
def pass_to_the_right(tensor, group=None):
    rank, n = dist.get_rank(group), dist.get_world_size(group)
    out = torch.empty_like(tensor)
    dist.recv(out, src=(rank - 1) % n, group=group)  # every rank receives first
    dist.send(tensor, dst=(rank + 1) % n, group=group)
    return out
''',
    "stop": '''
def should_stop(flag, group=None):
    stop = torch.tensor([float(flag)])
    if flag:  # only the ranks that want to stop reach the collective
        dist.all_reduce(stop, op=dist.ReduceOp.MAX, group=group)
    return bool(stop.item())
''',
}


def _grade_15(folder: str, planted: str | None = None, timeout: float = 20.0):
    import pathlib

    import nbformat

    from dpcourse.grading.checks import get_spec
    from dpcourse.grading.runner import run_check
    from dpcourse.grading.submission import extract

    nb = nbformat.read(pathlib.Path(__file__).resolve().parent.parent / folder /
                       "15_debugging.ipynb", as_version=4)
    sources = [(f"<cell {i}>", c.source) for i, c in enumerate(nb.cells) if c.cell_type == "code"]
    if planted:
        sources.append(("<planted>", _PLANTED[planted]))
    cells, _ = extract(sources)
    spec = get_spec("debugging")
    return run_check(spec, cells, spec.roles, timeout=timeout)


def test_exercise_15_solution_passes_every_criterion():
    result = _grade_15("solutions")
    assert result.failed() == [], {c.name: c.detail for c in result.criteria if not c.passed}


@pytest.mark.parametrize("planted, failed, hint", [
    ("causes", {"causes_named"}, "the causes are"),
    ("histogram", {"histogram_sums"}, "num_classes"),
    ("exchange", {"no_deadlock"}, "nobody had sent yet"),
    ("stop", {"no_deadlock"}, "whatever its own flag says"),
])
def test_exercise_15_mistakes_fail_with_the_hint_of_their_cause(planted, failed, hint):
    result = _grade_15("solutions", planted, timeout=8)
    report = {c.name: (c.detail, c.hint) for c in result.criteria if not c.passed}
    first = next(c for c in result.criteria if not c.passed and c.name in failed)
    assert hint in first.hint, report
    if planted == "causes":  # the fixes still earn their points
        assert set(result.failed()) == failed, report
        assert "A" in first.detail and "F" in first.detail and "B" not in first.detail


def test_unchanged_exercise_15_scores_zero():
    result = _grade_15("exercises")
    assert result.points == 0 and "NotImplementedError" in \
        result.criterion("histogram_sums").detail


# ------------------------------------------------------------------ NCCL, on 2 GPUs

@pytest.mark.gpu(2)
def test_nccl_debugging_tools_say_what_lesson_15_reads_from_its_recording(tmp_path):
    """Lesson 15, section 7: on 2 GPUs over NCCL (the recorder's own scenarios, asked of torch):
    the watchdog logs a skipped all-reduce's timeout with its sequence number; under
    TORCH_NCCL_BLOCKING_WAIT=1 the waiting rank's call raises DistBackendError; DETAIL names
    collectives in different orders; an all-reduce of 4 elements against 5 returns on the rank
    with 4 while the other times out; each rank's flight record ends at its last collective and
    fr_trace names the missing rank."""
    import json

    from dpcourse.bench import record_debugging

    assert record_debugging.main(["--out", str(tmp_path)]) == 0
    (path,) = tmp_path.glob("lesson15-2x-*.json")
    runs = json.loads(path.read_text())["scenarios"]

    def out(name, rank, stream):
        return "\n".join(runs[name]["ranks"][rank][stream])

    assert "Watchdog caught collective operation timeout: WorkNCCL(SeqNum=2, OpType=ALLREDUCE" \
        in out("skipped_collective", 0, "stderr")
    assert "raised DistBackendError" in out("blocking_wait", 0, "stdout")
    assert "Detected mismatch between collectives" in out("order_detail", 0, "stdout")
    assert "finished" in out("shape_plain", 0, "stdout")
    assert "NumelIn=5" in out("shape_plain", 1, "stderr")
    fr = runs["flight_recorder"]["flight_recorder"]
    assert {r: max(e["collective_seq_id"] for e in es) for r, es in fr["entries"].items()} == \
        {"0": 2, "1": 1}
    assert "missing ranks: {1}" in "\n".join(fr["fr_trace"]["output"])
