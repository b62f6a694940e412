"""Record what NCCL's debugging settings print when a 2-GPU job goes wrong, for lesson 15.

A CPU machine can show gloo's side of every failure; what NCCL itself prints
(``NCCL_DEBUG=INFO``, the watchdog's timeout, ``TORCH_NCCL_BLOCKING_WAIT``, the
flight recorder's dump and ``fr_trace``'s reading of it) needs GPUs. Run on a
machine with 2 or more GPUs::

    python -m dpcourse.bench.record_debugging --out docs/results

It plants each failure in two fresh rank processes (``cuda:0``, ``cuda:1``) with
a process-group timeout of a few seconds, all scenarios at once, and writes
``lesson15-2x-<gpu>.json``: per scenario the debug variables set, each rank's
exit status and its output, trimmed, with host names, addresses, process ids,
times and paths removed. It finishes in about a minute.
"""

from __future__ import annotations

import datetime
import json
import os
import pickle
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time

TIMEOUT_S = 5  # the process group's timeout in every scenario
WORLD_SIZE = 2
# name -> (failure planted, debug variables set); "{dump}" is the scenario's dump folder.
SCENARIOS = {
    "nccl_debug_info": ("none", {"NCCL_DEBUG": "INFO"}),
    "skipped_collective": ("skip", {}),
    "async_error_handling": ("skip", {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
                                      "TORCH_NCCL_DUMP_ON_TIMEOUT": "0"}),
    "blocking_wait": ("skip", {"TORCH_NCCL_BLOCKING_WAIT": "1"}),
    "flight_recorder": ("skip", {"TORCH_NCCL_TRACE_BUFFER_SIZE": "2000",
                                 "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
                                 "TORCH_FR_DUMP_TEMP_FILE": "{dump}/nccl_trace_rank_",
                                 "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": "{dump}/nccl_trace_rank_"}),
    "order_plain": ("order", {}),
    "order_detail": ("order", {"TORCH_DISTRIBUTED_DEBUG": "DETAIL"}),
    "shape_plain": ("shape", {}),
    "shape_detail": ("shape", {"TORCH_DISTRIBUTED_DEBUG": "DETAIL"}),
}
FAULTS = {
    "none": "both ranks all-reduce twice",
    "skip": "rank 1 skips the second all-reduce (it sleeps instead)",
    "order": "rank 0 all-reduces then broadcasts, rank 1 broadcasts then all-reduces",
    "shape": "rank 0 all-reduces 4 elements, rank 1 all-reduces 5",
}


def rank_main(rank: int, port: int, fault: str) -> None:
    """Run one rank of a scenario: one good all-reduce, then the planted failure."""
    import torch
    import torch.distributed as dist

    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=WORLD_SIZE, device_id=torch.device("cuda", rank),
                            timeout=datetime.timedelta(seconds=TIMEOUT_S))
    t = torch.ones(4, device="cuda")
    dist.all_reduce(t)
    torch.cuda.synchronize()
    print(f"rank {rank}: step 1 all-reduce done, sum {t[0].item():g}", flush=True)
    if fault == "skip" and rank == 1:
        print("rank 1: skips step 2's all-reduce", flush=True)
        time.sleep(TIMEOUT_S + 15)  # stands for work that never reaches the collective
        os._exit(0)
    try:
        works = []
        if fault == "order":
            ops = [dist.all_reduce, dist.broadcast] if rank == 0 else [dist.broadcast, dist.all_reduce]
            works = [op(t, 0, async_op=True) if op is dist.broadcast else op(t, async_op=True)
                     for op in ops]
        else:
            if fault == "shape":
                t = torch.ones(4 + rank, device="cuda")
            works = [dist.all_reduce(t, async_op=True)]
        for work in works:
            if os.environ.get("TORCH_NCCL_BLOCKING_WAIT") == "1":
                work.wait()  # blocking wait: the timeout is raised here, in Python
            else:
                _poll(work)
        print(f"rank {rank}: step 2 returned, tensor {t.tolist()}", flush=True)
    except Exception as exc:  # what the learner's script would see; recorded, then exit
        print(f"rank {rank}: step 2 raised {type(exc).__name__}: {exc}", flush=True)
        os._exit(1)
    dist.destroy_process_group()
    print(f"rank {rank}: finished", flush=True)


def _poll(work, limit_s: float = TIMEOUT_S + 20) -> None:
    """Wait for ``work`` while sleeping in Python, so that torch's watchdog threads can run."""
    import torch

    t0 = time.monotonic()
    while not work.is_completed():
        if time.monotonic() - t0 > limit_s:
            print(f"step 2 still not completed after {limit_s:g} s", flush=True)
            os._exit(3)
        time.sleep(0.05)
    work.wait()  # raises if the work failed
    torch.cuda.synchronize()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# The folder that holds the dpcourse package: the ranks run this module with ``-m``.
_PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_HOST = re.escape(socket.gethostname())
_SCRUB = [
    (re.compile(r"^\S+:\d+:\d+ (\[\d+\])", re.M), r"\1"),  # NCCL's host:pid:tid prefix
    (re.compile(r"\[([EWI])\d{4} [\d:.]+ "), r"[\1 "),  # glog's date and time
    (re.compile(r"\b\d{1,3}(\.\d{1,3}){3}(:\d+)?\b"), "<addr>"),
    (re.compile(r"(?<![\w/.:~-])/(?:[^\s/:'\"]+/)+"), ""),  # directories of a path: keep its name
    (re.compile(r"(?i)\b(pid|tid|process)\b(\s*[=:]?\s*)\d+"), r"\1\2<n>"),
]


def scrub(text: str) -> str:
    """Remove host names, addresses, process ids, times and directories from ``text``."""
    if _HOST and _HOST not in ("localhost",):
        text = re.sub(rf"(?<![\w.]){_HOST}(?!\w)", "<host>", text)
    for pattern, repl in _SCRUB:
        text = pattern.sub(repl, text)
    return text


_NATIVE_FRAME = re.compile(r"^frame #\d+: ")  # C++ stack frames: addresses, no news


def _trim(text: str, head: int = 40, tail: int = 30) -> list[str]:
    lines = [line.rstrip()[:600] for line in scrub(text).splitlines()
             if line.strip() and not _NATIVE_FRAME.match(line)]
    if len(lines) <= head + tail:
        return lines
    return lines[:head] + [f"... {len(lines) - head - tail} lines left out ..."] + lines[-tail:]


def _status(code: int | None) -> str:
    if code is None:
        return "still running (killed by the recorder)"
    if code < 0:
        return f"killed by {signal.Signals(-code).name}"
    return f"exit status {code}"


def _flight_records(dump: str) -> dict:
    """Read each rank's flight-recorder dump and run torch's fr_trace on the folder."""
    files = sorted(f for f in os.listdir(dump) if f.startswith("nccl_trace_rank_"))
    ranks = {}
    for name in files:
        with open(os.path.join(dump, name), "rb") as f:
            data = pickle.load(f)
        ranks[name.rsplit("_", 1)[-1]] = [
            {k: e.get(k) for k in ("record_id", "collective_seq_id", "profiling_name", "state",
                                   "input_sizes", "output_sizes", "timeout_ms") if k in e}
            for e in data.get("entries", [])]
    out = {"files": [scrub(f) for f in files], "entries": ranks}
    try:
        proc = subprocess.run([sys.executable, "-m", "torch.distributed.flight_recorder.fr_trace",
                               dump, "--prefix", "nccl_trace_rank_"],
                              capture_output=True, text=True, timeout=30)
        out["fr_trace"] = {"returncode": proc.returncode,
                           "output": _trim(proc.stdout + proc.stderr, 60, 20)}
    except (OSError, subprocess.SubprocessError) as exc:
        out["fr_trace"] = {"error": f"{type(exc).__name__}: {scrub(str(exc))}"}
    return out


def _start(name: str, root: str) -> dict:
    fault, variables = SCENARIOS[name]
    dump = os.path.join(root, name)
    os.makedirs(dump)
    variables = {k: v.format(dump=dump) for k, v in variables.items()}
    env = dict(os.environ, NCCL_NVLS_ENABLE="0", PYTHONUNBUFFERED="1", **variables)
    env["PYTHONPATH"] = os.pathsep.join([_PACKAGE_ROOT, *filter(None, [env.get("PYTHONPATH")])])
    port = _free_port()
    procs = [subprocess.Popen([sys.executable, "-m", __spec__.name, "--rank", str(r),
                               "--port", str(port), "--fault", fault],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for r in range(WORLD_SIZE)]
    return dict(name=name, fault=fault, variables=variables, dump=dump, procs=procs,
                start=time.monotonic())


def _finish(run: dict, deadline: float) -> dict:
    ranks = []
    for r, proc in enumerate(run["procs"]):
        try:
            out, err = proc.communicate(timeout=max(0.1, deadline - time.monotonic()))
            code = proc.returncode
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
            code = None
        ranks.append({"rank": r, "status": _status(code), "stdout": _trim(out),
                      "stderr": _trim(err)})
    record = {"fault": FAULTS[run["fault"]], "process_group_timeout_s": TIMEOUT_S,
              "variables": {k: scrub(v) for k, v in run["variables"].items()},
              "seconds": round(time.monotonic() - run["start"], 1), "ranks": ranks}
    if os.listdir(run["dump"]):
        record["flight_recorder"] = _flight_records(run["dump"])
    return record


def gpu_environment() -> dict:
    """The GPUs and versions a recording ran on (no host, platform or CPU names)."""
    import torch

    return {"gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())],
            "torch": torch.__version__, "cuda": torch.version.cuda,
            "nccl": ".".join(map(str, torch.cuda.nccl.version())),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "world_size": WORLD_SIZE}


def main(argv=None) -> int:
    """Record every scenario at once and write ``lesson15-2x-<gpu>.json`` into ``--out``."""
    import argparse

    import torch

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.path.join("docs", "results"))
    parser.add_argument("--only", nargs="*", choices=sorted(SCENARIOS), help="record only these")
    parser.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--fault", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.rank is not None:
        rank_main(args.rank, args.port, args.fault)
        return 0
    if torch.cuda.device_count() < WORLD_SIZE:
        print(f"needs {WORLD_SIZE} GPUs, this machine has {torch.cuda.device_count()}",
              file=sys.stderr)
        return 2
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory() as root:
        runs = [_start(name, root) for name in (args.only or SCENARIOS)]
        deadline = time.monotonic() + TIMEOUT_S + 45
        scenarios = {run["name"]: _finish(run, deadline) for run in runs}
    env = gpu_environment()
    record = {"environment": env, "scenarios": scenarios,
              "seconds": round(time.monotonic() - t0, 1)}
    from dpcourse.bench.report import slug

    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, f"lesson15-{WORLD_SIZE}x-{slug(env['gpus'][0])}.json")
    with open(path, "w") as f:
        json.dump(record, f, indent=1)
    print(f"wrote {path} in {record['seconds']} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
