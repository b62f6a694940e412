"""The ring simulation behind the stepper, and both widgets driven from Python."""

import numpy as np
import pytest
import torch
import torch.distributed as dist

import dpcourse
from dpcourse.comm import CommTrace, ring_all_reduce, shard_range
from dpcourse.widgets import CostModelSimulator, RingStepper, messages_of, simulate_ring


@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 5, 8])
@pytest.mark.parametrize("numel", [0, 1, 3, 8, 13])
def test_simulation_ends_with_the_sum_everywhere(world_size, numel):
    rng = np.random.default_rng(world_size * 100 + numel)
    inputs = [rng.integers(-50, 50, size=numel) for _ in range(world_size)]
    frames = simulate_ring(inputs)
    assert len(frames) == 2 * (world_size - 1) + 1
    total = np.sum(inputs, axis=0) if numel else np.zeros(0)
    for r in range(world_size):
        np.testing.assert_array_equal(frames[-1].data[r], total)
        assert all(frames[-1].is_reduced(r, c) for c in range(world_size))
    # After the reduce-scatter, rank r holds the full sum of chunk r (and only that one).
    mid = frames[world_size - 1]
    for r in range(world_size):
        s, e = shard_range(numel, world_size, r)
        np.testing.assert_array_equal(mid.data[r][s:e], total[s:e])
        assert [mid.is_reduced(r, c) for c in range(world_size)] == [c == r for c in range(world_size)]
    # The ring's bandwidth claim: each rank sends 2 (N-1)/N of the tensor (exactly, when N divides it).
    if numel % world_size == 0:
        sent = sum(b for _, b in messages_of(frames, 0)["send"])
        assert sent == 2 * (world_size - 1) * numel // world_size * inputs[0].itemsize


def test_simulation_rejects_ragged_inputs():
    with pytest.raises(ValueError, match="same number of elements"):
        simulate_ring([[1, 2], [1]])


def traced_ring_on_subgroups(numels):
    """Run the real ring on groups of 2, 3 and 4 ranks; return each rank's messages and results."""
    rank = dist.get_rank()
    groups = {n: dist.new_group(ranks=list(range(n))) for n in (2, 3)}
    groups[4] = None
    out = {}
    for n, group in groups.items():
        if rank >= n:
            continue
        for numel in numels:
            g = torch.Generator().manual_seed(1000 * n + numel)
            inputs = [torch.randint(-50, 50, (numel,), generator=g).double() for _ in range(n)]
            t = inputs[rank].clone()
            with CommTrace() as trace:
                ring_all_reduce(t, group=group)
            out[(n, numel)] = {
                "send": [(e.peer, e.nbytes) for e in trace.of("isend") + trace.of("send")],
                "recv": [(e.peer, e.nbytes) for e in trace.of("irecv") + trace.of("recv")],
                "result": t,
            }
    return out


def test_simulation_schedule_matches_the_real_ring():
    numels = [1, 5, 12]
    results = dpcourse.run(traced_ring_on_subgroups, numels, world_size=4, backend="gloo", timeout=90)
    for n in (2, 3, 4):
        for numel in numels:
            g = torch.Generator().manual_seed(1000 * n + numel)
            inputs = [torch.randint(-50, 50, (numel,), generator=g).double() for _ in range(n)]
            frames = simulate_ring([x.numpy() for x in inputs])
            for r in range(n):
                real = results[r][(n, numel)]
                expected = messages_of(frames, r)
                assert real["send"] == expected["send"], (n, numel, r)
                assert real["recv"] == expected["recv"], (n, numel, r)
                np.testing.assert_array_equal(real["result"].numpy(), frames[-1].data[r])


def test_stepper_responds_to_slider_buttons_and_world_size():
    s = RingStepper(world_size=3)
    first = s.table.value
    assert "data-phase='start'" in first and first.count("rank 2</th>") == 1
    s.next_button.click()
    assert s.step.value == 1 and "data-phase='reduce_scatter'" in s.table.value
    assert s.table.value != first
    s.step.value = s.step.max
    last = s.table.value
    assert "data-phase='all_gather'" in last and last.count("Σ all") == 9
    s.next_button.click()  # already at the end: stays
    assert s.step.value == s.step.max
    s.world_size.value = 5
    assert s.step.max == 8 and s.step.value == 4 and s.table.value.count("rank 4</th>") == 1
    s.prev_button.click()
    assert s.step.value == 3
    with pytest.raises(ValueError, match="between 2 and 8"):
        RingStepper(world_size=9)


def test_simulator_outputs_follow_the_controls():
    sim = CostModelSimulator()
    p0, html0, png0 = sim.prediction, sim.summary.value, sim.plot.value
    assert sim.params.value == 7e9 and sim.bandwidth_gbs.value == 50
    assert png0[:4] == b"\x89PNG"
    # The seed's example: 7B bf16 on 8 ranks at 50 GB/s moves 24.5 GB per rank per step.
    assert "24.50 GB" in html0 and "memory" in html0

    sim.bandwidth_gbs.value = 500.0  # 10x faster link: less exposed communication
    # Only the bandwidth term shrinks: 0.49 s -> 0.049 s; the per-bucket latency stays.
    assert sim.prediction.comm_s == pytest.approx(p0.comm_s - 0.49 + 0.049)
    assert sim.prediction.efficiency > p0.efficiency
    assert sim.summary.value != html0 and sim.plot.value != png0

    before = sim.prediction.step_s
    sim.overlap.value = False
    assert sim.prediction.step_s > before and not sim.prediction.overlap

    sim.params.value = 125e6  # a small model fits and is cheap to all-reduce
    assert sim.verdict.memory["total"] < 80e9
    sim.compute_ms.value = 1000.0
    assert sim.verdict.enough and "enough" in sim.summary.value

    n_buckets = sim.prediction.n_buckets
    sim.bucket_cap_mb.value = 1.0
    assert sim.prediction.n_buckets > n_buckets


def test_simulator_starts_from_a_fitted_model():
    from dpcourse.costmodel import AlphaBeta

    fitted = AlphaBeta(alpha=123e-6, beta=1 / 1.37e9, latency="call")
    sim = CostModelSimulator(model=fitted, params=125e6, compute_ms=30)
    assert sim.bandwidth_gbs.value == 1.37 and sim.alpha_us.value == 123
    m = sim.current_model()
    assert m.latency == "call" and m.alpha == pytest.approx(123e-6) and m.beta == pytest.approx(fitted.beta)
    with pytest.raises(ValueError, match="finite bandwidth"):
        CostModelSimulator(model=AlphaBeta(1e-5, 0.0))
