"""``dpcourse doctor`` and ``dpcourse launch`` (torchrun): command building and real runs."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import time

import pytest
import torch

import dpcourse
from dpcourse import cli
from dpcourse.launch.torchrun import torchrun_command

pytestmark = pytest.mark.usefixtures("no_leaked_processes")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join("tests", "torchrun_allreduce.py")
TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]


@pytest.mark.parametrize("gpus, argv, expected", [
    (0, ["train.py"], ["--nproc-per-node=2", "--standalone", "train.py"]),
    (1, ["train.py"], ["--nproc-per-node=2", "--standalone", "train.py"]),  # never 1 rank
    (4, ["train.py", "--lr", "0.1"], ["--nproc-per-node=4", "--standalone", "train.py", "--lr",
                                      "0.1"]),
    (4, ["--nproc-per-node", "3", "train.py"], ["--standalone", "--nproc-per-node", "3",
                                               "train.py"]),
    (0, ["--nproc_per_node=1", "train.py"], ["--standalone", "--nproc_per_node=1", "train.py"]),
    (0, ["--standalone", "train.py"], ["--nproc-per-node=2", "--standalone", "train.py"]),
    (2, ["--nnodes=2", "--node-rank=1", "--rdzv-backend=c10d", "--rdzv-endpoint=10.0.0.1:29400",
         "train.py"],
     ["--nproc-per-node=2", "--nnodes=2", "--node-rank=1", "--rdzv-backend=c10d",
      "--rdzv-endpoint=10.0.0.1:29400", "train.py"]),
    (0, ["--master-addr", "10.0.0.1", "train.py"], ["--nproc-per-node=2", "--master-addr",
                                                    "10.0.0.1", "train.py"]),
], ids=["cpu-default", "one-gpu-default", "gpus-default", "nproc-given", "nproc-underscore", "standalone-given",
        "multi-node", "master-addr"])
def test_torchrun_command(monkeypatch, gpus, argv, expected):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: gpus > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    assert torchrun_command(argv) == TORCHRUN + expected


def test_doctor_prints_versions_default_backend_and_checks_an_all_reduce(capsys):
    assert cli.main(["doctor", "--check"]) == 0
    out = capsys.readouterr().out
    plan = dpcourse.plan_ranks()
    world_size = plan.world_size
    assert re.search(rf"^torch +{re.escape(torch.__version__)}$", out, re.MULTILINE)
    assert re.search(r"^python +\d+\.\d+\.\d+$", out, re.MULTILINE)
    assert re.search(rf"^dpcourse.run default +{re.escape(str(plan))}$", out, re.MULTILINE)
    sums = re.escape(str([world_size] * world_size))
    assert re.search(rf"^all_reduce check +ok \({sums}\)$", out, re.MULTILINE), out


def _dpcourse(*args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dpcourse.cli", *args], cwd=ROOT, text=True,
                          check=False, capture_output=True, timeout=timeout)


def test_launch_runs_a_script_on_two_processes():
    proc = _dpcourse("launch", SCRIPT)
    assert proc.returncode == 0, proc.stderr
    assert "--nproc-per-node=2 --standalone tests/torchrun_allreduce.py" in proc.stderr
    ranks = sorted(re.findall(r"rank (\d) of 2: sum 3,", proc.stdout))
    assert ranks == ["0", "1"], proc.stdout


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_nodes_over_a_loopback_rendezvous():
    """Two torchrun "nodes" on this host meet at a c10d rendezvous and run the demo."""
    endpoint = f"127.0.0.1:{_free_port()}"
    nodes = [
        subprocess.Popen(
            [sys.executable, "-m", "dpcourse.cli", "launch", "--nnodes=2", f"--node-rank={i}",
             "--rdzv-backend=c10d", f"--rdzv-endpoint={endpoint}", "--nproc-per-node=1",
             "-m", "dpcourse.demo", "--steps", "3", "--backend", "gloo"],
            cwd=ROOT, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        for i in (0, 1)
    ]
    try:
        outs = [node.communicate(timeout=240) for node in nodes]
    finally:
        for node in nodes:
            node.kill()
            node.wait()
    for node, (_, err) in zip(nodes, outs):
        assert node.returncode == 0, err
        assert "--standalone" not in err  # the rendezvous given is used as is
    # Rank 0 (on whichever node the rendezvous made it) prints the demo's table.
    out = "".join(out for out, _ in outs)
    assert "world_size=2, backend=gloo" in out, out
    rows = [line.split() for line in out.splitlines() if re.match(r"^\s+\d+\s", line)]
    assert [int(r[0]) for r in rows] == [0, 1, 2], out
    for r in rows:
        losses, diffs = [float(x) for x in r[1:5]], [float(x) for x in r[5:]]
        assert max(losses) - min(losses) < 1e-4 and len(diffs) == 3 and max(diffs) < 1e-5, out


def test_launch_reports_a_failing_script(tmp_path):
    script = tmp_path / "fail.py"
    script.write_text("import torch.distributed as dist\ndist.init_process_group('gloo')\n"
                      "raise SystemExit(f'rank {dist.get_rank()} gives up')\n")
    proc = _dpcourse("launch", "--nproc-per-node=1", str(script))
    assert proc.returncode == 1
    assert "rank 0 gives up" in proc.stderr


# -- the command line itself: version, help, paths checked before work starts ---------------

def _parsers(parser=None, name="dpcourse"):
    """Yield ``(name, parser)`` for the command and every subcommand, depth first."""
    import argparse

    parser = parser or cli.build_parser()
    yield name, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub_name, sub in action.choices.items():
                yield from _parsers(sub, f"{name} {sub_name}")


def test_version_comes_from_the_package_metadata(capsys):
    from importlib import metadata

    with pytest.raises(SystemExit) as info:
        cli.main(["--version"])
    assert info.value.code == 0
    assert capsys.readouterr().out == f"dpcourse {metadata.version('dpcourse')}\n"


def test_every_command_and_option_has_help():
    import argparse

    missing = []
    for name, parser in _parsers():
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                missing += [f"{name} {c.dest}" for c in action._choices_actions if not c.help]
            elif not action.help:
                missing.append(f"{name} {'/'.join(action.option_strings) or action.dest}")
    assert missing == []
    names = [name for name, _ in _parsers()]
    assert {"dpcourse demo", "dpcourse bench ddp", "dpcourse grade"} <= set(names)


def test_help_is_plain_text():
    for name, parser in _parsers():
        text = parser.format_help()
        assert "``" not in text and "`" not in text and ":func:" not in text, name


def test_grade_refuses_an_unwritable_output_before_grading(capsys, tmp_path):
    notebook = os.path.join(ROOT, "exercises", sorted(os.listdir(os.path.join(ROOT, "exercises")))[0])
    cases = [("--json", "no/such/dir/r.json", "does not exist"),
             ("--csv", str(tmp_path), "is a directory"),
             ("--lms-csv", str(tmp_path / "missing" / "g.csv"), "does not exist")]
    for flag, path, why in cases:
        start = time.monotonic()
        assert cli.main(["grade", notebook, flag, path]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"dpcourse: error: grade: {flag} {path}") and why in err, err
        assert time.monotonic() - start < 10  # refused at once, nothing was graded
    (tmp_path / "file").write_text("")
    assert cli.main(["grade", notebook, "--feedback", str(tmp_path / "file")]) == 2
    assert "is a file; give a directory" in capsys.readouterr().err


def test_bench_output_directory(tmp_path):
    from dpcourse.argtypes import UsageError
    from dpcourse.bench.cli import out_dir

    # From the checkout's root (how docs/results is recorded) the default is docs/results.
    assert out_dir(None, ROOT) == os.path.join(ROOT, "docs", "results")
    with pytest.raises(UsageError, match="--out: say where to write the results"):
        out_dir(None, str(tmp_path))  # anywhere else nothing is created unasked
    assert os.listdir(tmp_path) == []
    assert out_dir("results/a", str(tmp_path)) == "results/a"
    assert os.path.isdir(tmp_path / "results" / "a")
    (tmp_path / "taken").write_text("")
    with pytest.raises(UsageError, match="--out: taken is a file, not a directory"):
        out_dir("taken", str(tmp_path))
    with pytest.raises(UsageError, match="--out: cannot write into taken/x"):
        out_dir("taken/x", str(tmp_path))


@pytest.mark.parametrize("argv, message", [
    (["--out", "{file}"], "is a file, not a directory"),
    (["--world-size", "100000", "--out", "{dir}"], "100000 ranks need about"),
])
def test_bench_refuses_bad_arguments_without_a_traceback(capsys, tmp_path, argv, message):
    (tmp_path / "f.json").write_text("{}")
    argv = [a.format(file=tmp_path / "f.json", dir=tmp_path / "out") for a in argv]
    with pytest.warns(RuntimeWarning) if "100000" in argv else _nothing():
        assert cli.main(["bench", "allreduce", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("dpcourse: error: ") and message in err and "Traceback" not in err


def _nothing():
    import contextlib

    return contextlib.nullcontext()
