"""The cost model: fitting alpha and beta, the 7B arithmetic, and step-time properties."""

import math

import numpy as np
import pytest

from dpcourse import costmodel as cm


def synthetic_sweep(alpha, beta, world_sizes=(2, 4, 8), latency="ring", noise=0.0, seed=0):
    rng = np.random.default_rng(seed)
    rows = []
    for n in world_sizes:
        k = 2 * (n - 1) if latency == "ring" else 1
        for nbytes in 4 * 2 ** np.arange(4, 24, 2):
            t = k * alpha + 2 * (n - 1) / n * nbytes * beta
            rows.append({"impl": "ring", "nbytes": int(nbytes), "world_size": n,
                         "median_s": t * (1 + noise * rng.standard_normal())})
    rows.append({"impl": "other", "nbytes": 4096, "world_size": 2, "median_s": 1.0})
    return rows


@pytest.mark.parametrize("latency", ["ring", "call"])
def test_fit_recovers_known_alpha_beta(latency):
    alpha, beta = 30e-6, 1 / 2e9
    fit = cm.fit_alpha_beta(synthetic_sweep(alpha, beta, latency=latency), impl="ring", latency=latency)
    assert fit.alpha == pytest.approx(alpha, rel=1e-6)
    assert fit.beta == pytest.approx(beta, rel=1e-6)
    assert fit.bandwidth == pytest.approx(2e9, rel=1e-6)


def test_fit_with_noise_is_close_and_rows_as_objects_work():
    class Row:
        def __init__(self, d):
            self.__dict__.update(d)

    rows = [Row(r) for r in synthetic_sweep(50e-6, 1e-9, noise=0.03)]
    fit = cm.fit_alpha_beta(rows, impl="ring")
    assert fit.alpha == pytest.approx(50e-6, rel=0.1)
    assert fit.beta == pytest.approx(1e-9, rel=0.05)
    assert np.abs(cm.prediction_errors(fit, rows, impl="ring")).max() < 0.15


def test_fit_clamps_negative_alpha_to_zero():
    # Pure bandwidth data plus a slight downward bias at small sizes would give alpha < 0.
    rows = [{"impl": "x", "nbytes": n, "world_size": 2, "median_s": n * 1e-9 * (0.9 if n < 1e4 else 1)}
            for n in (1e3, 2e3, 1e6, 2e6)]
    fit = cm.fit_alpha_beta(rows, latency="call")
    assert fit.alpha == 0.0 and fit.beta > 0


def test_fit_rejects_bad_input():
    with pytest.raises(ValueError, match="no sweep rows"):
        cm.fit_alpha_beta(synthetic_sweep(1e-5, 1e-9), impl="nope")
    with pytest.raises(KeyError, match="median_s"):
        cm.fit_alpha_beta([{"impl": "x", "nbytes": 1, "world_size": 2}] * 2)
    with pytest.raises(ValueError, match="latency"):
        cm.latency_terms(4, "tree")


def test_allreduce_time_formula_and_latency_terms():
    m = cm.AlphaBeta(alpha=1e-5, beta=1e-9, latency="ring")
    assert m.allreduce_time(1e6, 4) == pytest.approx(6 * 1e-5 + 1.5e6 * 1e-9)
    assert cm.AlphaBeta(1e-5, 1e-9, "call").allreduce_time(1e6, 4) == pytest.approx(1e-5 + 1.5e-3)
    assert m.allreduce_time(1e6, 1) == 0.0  # one rank: nothing to send
    arr = m.allreduce_time(np.array([0, 1e6]), 4)
    assert arr.shape == (2,) and arr[0] == pytest.approx(6e-5)


def test_seven_billion_bf16_on_8_ranks_matches_hand_computation():
    # 2 * (N-1)/N * params * bytes = 2 * 7/8 * 7e9 * 2 = 24.5e9 bytes; at 50 GB/s: 0.49 s.
    t = cm.allreduce_traffic(7e9, "bf16", 8, 50e9)
    assert t["grad_bytes"] == 14e9
    assert t["bytes_per_rank"] == pytest.approx(24.5e9)
    assert t["seconds"] == pytest.approx(0.49)
    # The same number from the fitted-model API with alpha = 0.
    m = cm.AlphaBeta.from_bandwidth(50e9)
    assert m.allreduce_time(14e9, 8) == pytest.approx(0.49)
    mem = cm.memory_per_rank(7e9, "bf16", "adam")
    # bf16 weights 2 B + bf16 grads 2 B + Adam m, v in fp32 8 B + fp32 master 4 B = 16 B/param.
    assert (mem["weights"], mem["grads"], mem["optimizer"], mem["master_weights"]) == (14e9, 14e9, 56e9, 28e9)
    assert mem["total"] == 112e9
    assert cm.memory_per_rank(1e9, "fp32", "sgd")["total"] == 8e9  # no master copy in fp32


def test_bucket_sizes():
    assert cm.bucket_sizes(60 * cm.step.MiB, 25).tolist() == [25 * cm.step.MiB, 25 * cm.step.MiB, 10 * cm.step.MiB]
    assert cm.bucket_sizes([10, 20, 30, 5], 0).tolist() == [10, 20, 30, 5]
    cap = 25 / cm.step.MiB  # 25 bytes
    assert cm.bucket_sizes([10, 20, 30, 5], cap).tolist() == [30, 30, 5]
    with pytest.raises(ValueError, match="per-parameter"):
        cm.bucket_sizes(100, 0)


@pytest.mark.parametrize("compute", [0.0, 0.01, 0.2, 3.0])
@pytest.mark.parametrize("cap", [1, 25, 200])
def test_overlap_prediction_properties(compute, cap):
    m = cm.AlphaBeta(alpha=20e-6, beta=1 / 10e9)
    grad = 400e6
    serial = cm.predict_step_time(grad, compute, m, 8, cap, overlap=False)
    over = cm.predict_step_time(grad, compute, m, 8, cap, overlap=True)
    assert serial.step_s == pytest.approx(compute + serial.comm_s)
    assert over.comm_s == pytest.approx(serial.comm_s)
    # Overlap never hurts, cannot beat max(compute, comm), and the last bucket is always exposed.
    assert over.step_s <= serial.step_s + 1e-12
    assert over.step_s >= max(compute, over.comm_s) - 1e-12
    assert over.step_s >= compute + over.last_bucket_s - 1e-12
    assert 0 <= over.efficiency <= 1 and over.exposed_comm_s >= 0
    if compute > 0:
        assert over.efficiency == pytest.approx(compute / over.step_s)


def test_overlap_with_one_bucket_hides_nothing_and_free_comm_costs_nothing():
    m = cm.AlphaBeta(alpha=1e-5, beta=1e-9)
    one = cm.predict_step_time(10e6, 0.1, m, 4, bucket_cap_mb=100, overlap=True)
    assert one.n_buckets == 1
    assert one.step_s == pytest.approx(0.1 + one.comm_s)
    free = cm.predict_step_time(10e6, 0.1, cm.AlphaBeta(0.0, 0.0), 4, bucket_cap_mb=1)
    assert free.step_s == pytest.approx(0.1) and free.efficiency == pytest.approx(1.0)
    # Comm-bound: overlap approaches compute-free comm + the part before the first bucket is ready.
    slow = cm.AlphaBeta(0.0, 1e-6)
    p = cm.predict_step_time(100e6, 0.3, slow, 2, bucket_cap_mb=1)
    assert p.step_s == pytest.approx(0.1 + 0.2 * cm.step.MiB / 100e6 + p.comm_s, rel=1e-6)


def test_scaling_curve_efficiency_falls_with_world_size():
    m = cm.AlphaBeta(alpha=10e-6, beta=1 / 25e9)
    curve = cm.scaling_curve([1, 2, 4, 8, 16], 14e9, 0.2, m, overlap=False)
    assert curve[0].efficiency == 1.0
    effs = [p.efficiency for p in curve]
    assert all(a >= b for a, b in zip(effs, effs[1:]))


def test_data_parallel_limits_names_the_limit_hit():
    fast = cm.AlphaBeta.from_bandwidth(400e9, alpha=5e-6)
    small = cm.data_parallel_limits(125e6, 8, 80e9, fast, compute_s=0.3)
    assert small.enough and small.reasons == ()
    big = cm.data_parallel_limits(7e9, 8, 80e9, fast, compute_s=2.0)
    assert not big.enough and len(big.reasons) == 1 and big.reasons[0].startswith("memory")
    slow = cm.AlphaBeta.from_bandwidth(1e9)
    comm = cm.data_parallel_limits(1e9, 8, 80e9, slow, compute_s=0.2)
    assert [r.split(":")[0] for r in comm.reasons] == ["communication"]
    assert comm.step.comm_share > 0.3


def test_dtype_bytes():
    import torch

    assert cm.dtype_bytes("bf16") == 2 and cm.dtype_bytes(torch.float32) == 4 and cm.dtype_bytes(1) == 1
    with pytest.raises(ValueError, match="unknown dtype"):
        cm.dtype_bytes("int4")
    assert math.isinf(cm.AlphaBeta(1e-6, 0.0).bandwidth)


def test_overlap_matches_an_event_by_event_simulation():
    rng = np.random.default_rng(1)
    sizes = rng.integers(1, 5_000_000, size=40).astype(float)  # per-parameter bytes, backward order
    m = cm.AlphaBeta(alpha=1e-4, beta=1 / 1e9, latency="call")
    for cap, compute in [(0, 0.05), (2, 0.05), (8, 0.5), (1000, 0.01)]:
        p = cm.predict_step_time(sizes.tolist(), compute, m, 4, bucket_cap_mb=cap, backward_fraction=0.6)
        # Event by event: a bucket is ready when backward has produced all its bytes,
        # and waits for the link to be free.
        buckets = cm.bucket_sizes(sizes.tolist(), cap)
        produced, link_free = 0.0, 0.0
        for b in buckets:
            produced += b
            ready = 0.4 * compute + 0.6 * compute * produced / sizes.sum()
            link_free = max(ready, link_free) + m.allreduce_time(b, 4)
        assert p.step_s == pytest.approx(max(compute, link_free), rel=1e-9)
        assert p.n_buckets == len(buckets)


def test_ddp_step_sweep_reports_the_wrappers_real_buckets():
    import dpcourse
    from dpcourse.bench.steps import ddp_step_sweep

    ranks = dpcourse.run(ddp_step_sweep, (0, 1e-3), in_features=8, hidden=16, depth=3, batch_size=4,
                         warmup=1, iters=2, world_size=2, backend="gloo", timeout=90)
    rows = ranks[0]
    assert [(r["variant"], r["bucket_cap_mb"]) for r in rows] == [("local", None)] + [
        (v, c) for c in (0, 1e-3) for v in ("bucketed", "overlapped")]
    params = [8 * 16, 16, 16 * 16, 16, 16 * 1, 1]  # MLP(8, 16, 1, depth=3): weights and biases
    for r in rows:
        assert r["grad_bytes"] == 4 * sum(params) and r["median_s"] > 0 and r["world_size"] == 2
        assert sum(r["bucket_bytes"]) == (0 if r["variant"] == "local" else r["grad_bytes"])
    assert rows[1]["n_buckets"] == rows[2]["n_buckets"] == len(params)  # cap 0: one per parameter
    # A 1 KiB cap closes a bucket once it holds >= 1024 bytes, filling from the last layer.
    assert rows[3]["bucket_bytes"] == [4 * (1 + 16 + 16 + 256), 4 * (16 + 128)]
    assert [r["median_s"] for r in ranks[1]] == [r["median_s"] for r in rows]  # same on every rank
