"""Importing a dpcourse module changes no process state: no warnings filter, no environment variable.

Each import runs in a fresh interpreter (a subprocess), after torch itself is
imported, so that only what the module does is compared.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# Each import is compared with the state just before it; the first import of a
# submodule also imports its parents, so the two named in the standards come first.
MODULES = ["dpcourse.zero.collectives", "dpcourse.comm.kernels", "dpcourse", "dpcourse.comm",
           "dpcourse.ddp", "dpcourse.zero", "dpcourse.fsdp", "dpcourse.costmodel"]

PROBE = """
import importlib, json, os, sys, warnings
import torch, torch.distributed
seen = {}
for module in sys.argv[1:]:
    filters, environ = list(warnings.filters), dict(os.environ)
    importlib.import_module(module)
    seen[module] = {
        "filters_added": [repr(f) for f in warnings.filters if f not in filters],
        "filters_same": list(warnings.filters) == filters,
        "environ_changed": sorted(k for k in set(environ) | set(os.environ)
                                  if environ.get(k) != os.environ.get(k)),
    }
print(json.dumps(seen))
"""


@pytest.fixture(scope="module")
def import_effects() -> dict:
    out = subprocess.run([sys.executable, "-c", PROBE, *MODULES], cwd=ROOT, capture_output=True,
                         text=True, timeout=300, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("module", MODULES)
def test_import_changes_no_warnings_filter_and_no_environment(import_effects, module):
    seen = import_effects[module]
    assert seen["filters_same"], f"import {module} added warnings filters {seen['filters_added']}"
    assert seen["environ_changed"] == [], f"import {module} set {seen['environ_changed']}"


SCOPED = """
import json, os, socket, warnings
import torch, torch.distributed as dist
from dpcourse.zero.collectives import all_gather, reduce_scatter
with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
before = list(warnings.filters)
with warnings.catch_warnings(record=True) as ours:
    warnings.simplefilter("always")
    out, gathered = torch.empty(3), torch.empty(3)
    reduce_scatter(out, torch.arange(3.0))
    all_gather(gathered, out)
with warnings.catch_warnings(record=True) as direct:
    warnings.simplefilter("always")
    dist.reduce_scatter_tensor(torch.empty(3), torch.arange(3.0))
    dist.all_gather_into_tensor(torch.empty(3), torch.arange(3.0))
dist.destroy_process_group()
print(json.dumps({"gathered": gathered.tolist(), "ours": [str(w.message) for w in ours],
                  "direct": [str(w.message) for w in direct],
                  "filters_restored": list(warnings.filters) == before}))
"""


def test_sharded_halves_silence_torchs_rename_warning_only_around_their_own_call():
    out = subprocess.run([sys.executable, "-c", SCOPED], cwd=ROOT, capture_output=True, text=True,
                         timeout=300, check=True)
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    assert seen["gathered"] == [0.0, 1.0, 2.0]
    assert not [m for m in seen["ours"] if "is deprecated" in m], seen["ours"]
    assert seen["filters_restored"]
    # Scoped: the same calls made directly still warn, where this torch warns at all.
    renamed = [m for m in seen["direct"] if "is deprecated" in m]
    if not renamed:
        import torch

        pytest.skip(f"torch {torch.__version__} does not warn on the old names")
    assert len(renamed) == 2, renamed
