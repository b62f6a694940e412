"""What lessons 12-16 and the docs beside them say about torch and gloo, asked of torch.

Each test asks torch itself (its autograd, its collectives on 2 CPU ranks over gloo, its
flight recorder, ``torchrun``), never dpcourse's re-implementations; dpcourse only starts
the ranks. Each docstring states the fact and names the text that relies on it.
"""

from __future__ import annotations

import os
import pickle
import socket
import subprocess
import sys
import textwrap
import time

import torch
import torch.distributed as dist

import dpcourse


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# --------------------------------------------------------------------------- lesson 15


def _flight_record_of_five_all_reduces():
    """Five all-reduces on the default group; the collectives the flight recorder still holds."""
    for _ in range(5):
        dist.all_reduce(torch.ones(3))
    trace = pickle.loads(torch._C._distributed_c10d._dump_fr_trace())
    return [(e["collective_seq_id"], e["profiling_name"]) for e in trace["entries"]]


def test_flight_recorder_is_a_ring_buffer_of_the_last_buffer_size_collectives():
    """Lesson 15, section 7: the flight recorder is a ring buffer: with TORCH_FR_BUFFER_SIZE=2,
    after five gloo all-reduces each rank's record holds only the last two (numbers 4 and 5);
    the older entries were overwritten."""
    saved = os.environ.get("TORCH_FR_BUFFER_SIZE")
    os.environ["TORCH_FR_BUFFER_SIZE"] = "2"   # the ranks start with this environment
    try:
        records = dpcourse.run(_flight_record_of_five_all_reduces, world_size=2, backend="gloo",
                               device="cpu", timeout=120)
    finally:
        if saved is None:
            os.environ.pop("TORCH_FR_BUFFER_SIZE")
        else:
            os.environ["TORCH_FR_BUFFER_SIZE"] = saved
    for record in records:
        assert record == [(4, "gloo:all_reduce"), (5, "gloo:all_reduce")], records


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
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--max-restarts", "1",
                           "--nproc-per-node", "2", "--master-addr", "127.0.0.1", "--master-port",
                           str(_free_port()), str(script), str(seen)], capture_output=True,
                          text=True, timeout=240, env=dict(os.environ, OMP_NUM_THREADS="1"))
    elapsed = time.monotonic() - start
    assert proc.returncode != 0, proc.stderr[-3000:]
    assert sorted(os.listdir(seen)) == ["rank 0 attempt 0", "rank 0 attempt 1",
                                        "rank 1 attempt 0", "rank 1 attempt 1"]
    assert elapsed < 110, elapsed   # rank 0 was stopped, not waited for (2 x 120 s otherwise)


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
