"""The benchmarks return sane, complete rows and the CLI writes its results (no speed asserted)."""

from __future__ import annotations

import json
import os

import pytest
import torch.distributed as dist

import dpcourse
from dpcourse.bench import allreduce_sweep, time_interleaved
from dpcourse.bench.cli import parse_size, size_range, slow_link
from dpcourse.cli import main

IMPLS = ("library", "ring", "naive")


def sweep_worker() -> dict:
    calls = []
    # A user-supplied impl next to the named ones; it counts its own calls.
    def mine(t, group=None):
        calls.append(t.numel())
        dist.all_reduce(t, group=group)

    rows = allreduce_sweep([4096, 65536], {"mine": mine}, warmup=2, iters=3)
    mine_calls = list(calls)
    rows += allreduce_sweep([4096, 65536], IMPLS, warmup=1, iters=3)
    calls.clear()
    queued = allreduce_sweep([4096], {"mine": mine}, warmup=1, iters=2, calls_per_trial=5)
    queued_calls = list(calls)
    calls.clear()
    try:
        allreduce_sweep([4096], {"mine": mine}, calls_per_trial=0)
        bad = ""
    except ValueError as exc:
        bad = str(exc)
    order = []
    time_interleaved({"a": lambda: order.append("a"), "b": lambda: order.append("b")},
                     warmup=2, iters=3)
    return {"rows": rows, "mine_calls": mine_calls, "order": order, "queued": queued,
            "queued_calls": queued_calls, "bad_calls_per_trial": bad}


@pytest.fixture(scope="module")
def sweep():
    return dpcourse.run(sweep_worker, world_size=3, backend="gloo", timeout=120)


def test_sweep_rows_are_complete_and_consistent(sweep):
    rows = sweep[0]["rows"]
    assert all(r["rows"] == rows for r in sweep)  # every rank returns the same table
    named = [r for r in rows if r["impl"] != "mine"]
    assert sorted((r["impl"], r["nbytes"]) for r in named) == sorted(
        (i, n) for i in IMPLS for n in (4096, 65536))
    for r in rows:
        assert r["world_size"] == 3 and r["backend"] == "gloo" and r["trials"] == 3
        assert r["numel"] * 4 == r["nbytes"] and r["dtype"] == "float32"
        assert 0 < r["min_s"] <= r["p25_s"] <= r["median_s"] <= r["p75_s"] <= r["max_s"]
        assert r["algbw"] == pytest.approx(r["nbytes"] / r["median_s"])
        assert r["busbw"] == pytest.approx(r["algbw"] * 4 / 3)  # 2 (N - 1) / N with N = 3
        assert r["latency_us"] == pytest.approx(r["median_s"] * 1e6)
    for r in named:
        library = next(x for x in named if x["impl"] == "library" and x["nbytes"] == r["nbytes"])
        assert r["vs_library"] == pytest.approx(library["median_s"] / r["median_s"])


def test_calls_per_trial_times_queued_calls_and_reports_per_call(sweep):
    (row,) = sweep[0]["queued"]
    # Each warm-up and each trial makes 5 back-to-back calls; times are per call.
    assert sweep[0]["queued_calls"] == [1024] * 15
    assert row["calls_per_trial"] == 5 and row["trials"] == 2
    assert row["algbw"] == pytest.approx(row["nbytes"] / row["median_s"])
    assert all(r["calls_per_trial"] == 1 for r in sweep[0]["rows"])
    assert "at least 1" in sweep[0]["bad_calls_per_trial"]


def test_warmup_is_run_but_not_timed_and_trials_interleave(sweep):
    # 2 warm-up + 3 timed calls per size for the user-supplied impl.
    assert sweep[0]["mine_calls"] == [1024] * 5 + [16384] * 5
    # Warm-up of each first, then rounds whose starting candidate rotates.
    assert sweep[0]["order"] == ["a", "a", "b", "b", "a", "b", "b", "a", "a", "b"]


def test_cli_allreduce_writes_json_and_plot(tmp_path, capsys):
    assert main(["bench", "allreduce", "--world-size", "2", "--backend", "gloo",
                 "--sizes", "4K,16K", "--iters", "2", "--warmup", "1", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "busbw GB/s" in out and "ring" in out
    files = sorted(os.listdir(tmp_path))
    assert [os.path.splitext(f)[1] for f in files] == [".json", ".png"]
    data = json.loads((tmp_path / files[0]).read_text())
    assert data["benchmark"] == "allreduce" and data["settings"]["sizes"] == [4096, 16384]
    assert {"date", "torch", "backend", "world_size", "cpu"} <= set(data["environment"])
    assert sorted((r["impl"], r["nbytes"]) for r in data["rows"]) == sorted(
        (i, n) for i in ("library", "ring") for n in (4096, 16384))


def test_cli_ddp_on_cpu_with_tiny_model(tmp_path, capsys):
    assert main(["bench", "ddp", "--world-size", "2", "--backend", "gloo", "--iters", "2",
                 "--warmup", "1", "--sweep-caps", "0,25", "--out", str(tmp_path), "--no-plot"]) == 0
    assert "vs_torch_ddp" in capsys.readouterr().out
    (name,) = os.listdir(tmp_path)
    data = json.loads((tmp_path / name).read_text())
    rows, sweep = data["rows"], data["bucket_sweep"]
    assert [r["variant"] for r in rows] == ["local", "naive", "bucketed", "overlapped", "torch_ddp"]
    assert rows[-1]["vs_torch_ddp"] == 1.0 and rows[0]["efficiency"] == 1.0
    for r in rows:
        assert r["config"] == "tiny" and r["world_size"] == 2 and r["trials"] == 2
        assert r["vs_torch_ddp"] == pytest.approx(r["median_s"] / rows[-1]["median_s"])
    assert sorted((r["bucket_cap_mb"], r["variant"]) for r in sweep) == sorted(
        (c, v) for c in (0.0, 25.0) for v in ("bucketed", "overlapped", "torch_ddp"))
    # bucket_cap_mb=0: one bucket per parameter (that gets a gradient).
    params = rows[0]["params"]
    zero = next(r for r in sweep if r["bucket_cap_mb"] == 0 and r["variant"] == "bucketed")
    assert 1 < zero["n_buckets"] < params


def test_sizes_and_slow_link_env(monkeypatch):
    assert [parse_size(s) for s in ("4096", "4K", "64KiB", "1M", "1G")] == \
        [4096, 4096, 65536, 2**20, 2**30]
    with pytest.raises(Exception, match="not a size"):
        parse_size("lots")
    assert size_range(4096, 65536) == [4096, 8192, 16384, 32768, 65536]
    monkeypatch.delenv("NCCL_P2P_DISABLE", raising=False)
    monkeypatch.setenv("NCCL_SHM_DISABLE", "0")
    with slow_link(True):
        assert os.environ["NCCL_P2P_DISABLE"] == os.environ["NCCL_SHM_DISABLE"] == "1"
    assert "NCCL_P2P_DISABLE" not in os.environ and os.environ["NCCL_SHM_DISABLE"] == "0"


@pytest.mark.gpu(2)
def test_benchmarks_on_nccl(tmp_path):
    assert main(["bench", "allreduce", "--world-size", "2", "--sizes", "4K,16M", "--iters", "3",
                 "--impls", "library,ring,naive",
                 "--out", str(tmp_path), "--no-plot"]) == 0
    assert main(["bench", "ddp", "--world-size", "2", "--config", "tiny", "--iters", "2",
                 "--sweep-caps", "0", "--out", str(tmp_path), "--no-plot"]) == 0
    rows = [r for f in sorted(os.listdir(tmp_path))
            for r in json.loads((tmp_path / f).read_text())["rows"]]
    assert {r["backend"] for r in rows} == {"nccl"}
    assert all(r["median_s"] > 0 for r in rows)
