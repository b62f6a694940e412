"""Planted notebooks for ``dpcourse grade``: hangs, crashes and attempts to forge a score.

Each function returns the code cells of one notebook. The test builds the
notebooks in a temp folder, so nothing here runs on import.
"""

SOLUTION_09 = '''
def ring_bytes_per_rank(nbytes, world_size):
    return 2 * (world_size - 1) / world_size * nbytes


def ring_all_reduce_time(nbytes, world_size, alpha, beta):
    return 2 * (world_size - 1) * alpha + ring_bytes_per_rank(nbytes, world_size) * beta


def halving_doubling_time(nbytes, world_size, alpha, beta):
    p = 1 << (world_size.bit_length() - 1)
    time = 2 * (p.bit_length() - 1) * alpha + 2 * (p - 1) / p * nbytes * beta
    return time + (2 * (alpha + nbytes * beta) if world_size > p else 0.0)
'''

MARK = '''
import os
os.environ["GRADER_TEST_MARKER"] = {marker!r}  # inherited by everything this kernel starts
'''


def sleeps(marker):
    """Sleeps past the limit before defining anything: scores zero."""
    return [MARK.format(marker=marker), "import time\ntime.sleep(300)", SOLUTION_09]


def busy_loop(marker):
    """Defines the exercise, then spins: keeps the honest points of the cells before."""
    return [MARK.format(marker=marker), SOLUTION_09, "while True:\n    pass"]


def kills_its_kernel(marker):
    """SIGKILLs its own kernel (as the OOM killer would) before defining anything."""
    return [MARK.format(marker=marker),
            "import os, signal\nos.kill(os.getpid(), signal.SIGKILL)", SOLUTION_09]


def launches_ranks_and_hangs(marker):
    """Starts ranks, a child in its own session and an orphaned grandchild, then hangs."""
    return [MARK.format(marker=marker), '''
import subprocess, sys
subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True)
subprocess.Popen([sys.executable, "-c",
                  "import os, subprocess, sys; subprocess.Popen([sys.executable, '-c', "
                  "'import os, time; os.setsid(); time.sleep(600)']); os._exit(0)"])
''', '''
import time
import dpcourse

def wait_forever():
    time.sleep(600)

dpcourse.run(wait_forever, world_size=2, timeout=600)
''', SOLUTION_09]


FIND_GRADER = '''
import json, os, subprocess, sys
import psutil

grader = next(p for p in psutil.Process().parents() if "grade" in p.cmdline())
args = grader.cmdline()
json_path = args[args.index("--json") + 1]
folder = args[args.index("grade") + 1]
'''

KERNEL_FORGERIES = '''
# 1. every environment variable and file the grader might read
for key, value in list(os.environ.items()):
    if "GRADE" in key.upper() and os.path.isabs(value):
        with open(value, "a") as f:
            f.write(json.dumps({"check": "ring_all_reduce", "points": 1000, "max_points": 10}))
os.environ["DPCOURSE_GRADE_FILE"] = os.path.join(os.getcwd(), "grades.jsonl")
with open(os.environ["DPCOURSE_GRADE_FILE"], "w") as f:
    f.write(json.dumps({"check": "ring_all_reduce", "points": 1000, "max_points": 10}) + "\\n")

# 2. patch the grader as this kernel sees it
import dpcourse.grading.report as report
import dpcourse.grading.runner as runner
report.CheckResult.points = property(lambda self: 1000.0)
report.CheckResult.score = property(lambda self: 1.0)
runner.run_check = lambda *args, **kwargs: None

def check(*args, **kwargs):
    return "10/10"

# 3. a detached process that rewrites the results after the grader exits
subprocess.Popen([sys.executable, "-c",
                  f"import time; time.sleep(6); open({json_path!r}, 'w').write('forged')"],
                 start_new_session=True)

# 4. delete the notebook graded after this one
for name in os.listdir(folder):
    if name.startswith("09_"):
        os.remove(os.path.join(folder, name))
'''

RING_FORGERIES = '''
import importlib
import gc
import inspect
import torch
import torch.distributed as dist


def ring_all_reduce(tensor, group=None):
    """Tries every way around the exercise, then fakes the traffic."""
    real = importlib.import_module("torch.distributed")  # importlib skips the grader's view
    attempts = [
        lambda: dist.all_reduce.__wrapped__(tensor),
        lambda: dist._get_default_group().allreduce([tensor]).wait(),
        lambda: dist.gather(tensor, None, 0) or dist.scatter(tensor, None, 0),
        lambda: real.all_reduce(tensor),
        lambda: exec(open(importlib.import_module("dpcourse.comm.ring").__file__).read(), {}),
        lambda: importlib.reload(importlib.import_module("dpcourse.comm.ring")).ring_all_reduce(
            tensor),
        lambda: tensor.copy_(sys._getframe(1).f_locals["want"]),
        lambda: importlib.import_module("dpcourse.grading.oracles").all_reduce_sum([tensor]),
        lambda: [o for o in gc.get_objects()
                 if isinstance(o, real.ProcessGroup)][0].allreduce([tensor]).wait(),
    ]
    for attempt in attempts:
        try:
            attempt()
        except Exception:
            pass
    rank, n = dist.get_rank(), dist.get_world_size()
    dummy = torch.zeros(2 * (n - 1) * (tensor.numel() // n), dtype=tensor.dtype)
    if n > 1 and dummy.numel():
        dist.send(dummy, (rank + 1) % n)
        dist.recv(dummy, (rank - 1) % n)
'''


def kernel_forgeries():
    """04: patches, env and files, a detached rewriter, a deleted notebook, a forged ring."""
    return ["from dpcourse.grading import check", FIND_GRADER, KERNEL_FORGERIES, RING_FORGERIES,
            "check('ring_all_reduce', ring_all_reduce, world_sizes=(1,))"]


def ddp_takeovers():
    """03: recovers torch DDP's constructor through gc, and execs the reference's source."""
    return ['''
import gc
import torch
import torch.distributed as dist
from torch import nn


class NaiveDDP(nn.Module):
    def __init__(self, module):
        super().__init__()
        self.module = module
        ddp = [o for o in gc.get_objects() if getattr(o, "__name__", "") == "DistributedDataParallel"]
        init = ddp[0].__init__ if ddp else None
        if init is not None:
            self.ddp = ddp[0].__new__(ddp[0])
            init(self.ddp, module)
        else:
            source = open(__import__("dpcourse.ddp.naive").ddp.naive.__file__).read()
            scope = {}
            exec(source, scope)
            self.ddp = scope["DataParallelNaive"](module)

    def forward(self, *args, **kwargs):
        return self.ddp(*args, **kwargs)
''']


def edits_the_grader():
    """05: a correct exercise, but the notebook edits the grader's report module on disk."""
    return ['''
import dpcourse.grading.report as report
with open(report.__file__, "a") as f:
    f.write("\\nCheckResult.points = property(lambda self: 1000.0)\\n")
''', '''
def assign_buckets(params, bucket_cap_mb=25.0):
    cap, buckets, current, size = bucket_cap_mb * 2**20, [], [], 0
    for i in reversed(range(len(params))):
        current.append(i)
        size += params[i].numel() * params[i].element_size()
        if size >= cap:
            buckets.append(current)
            current, size = [], 0
    return buckets + ([current] if current else [])
''']


def honest(self_check=True):
    """09: a correct notebook, graded after the others (its own check() call is optional)."""
    if not self_check:
        return [SOLUTION_09]
    return ["from dpcourse.grading import check", SOLUTION_09,
            "check('ring_cost', ring_all_reduce_time, bytes_per_rank=ring_bytes_per_rank, "
            "halving_doubling=halving_doubling_time)"]
