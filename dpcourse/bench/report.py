"""Record what a benchmark ran on, and write its results as JSON (and a plot) for the docs."""

from __future__ import annotations

import datetime
import json
import os
import platform
import re
import subprocess

from dpcourse.bench.records import to_json


def _driver_version() -> str | None:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.SubprocessError):
        return None
    lines = out.stdout.strip().splitlines() if out.returncode == 0 else []
    return lines[0] if lines else None


def environment(backend: str, world_size: int) -> dict:
    """Describe the machine and software a benchmark runs on (call in the launching process).

    Args:
        backend: the process-group backend the ranks use.
        world_size: number of ranks.

    Returns:
        A JSON-ready dict: date (UTC), backend, world size, torch / CUDA / NCCL /
        driver versions, GPU and CPU names, and every ``NCCL_*`` variable that is set
        (slow-link mode shows there).
    """
    import torch
    import torch.distributed as dist

    from dpcourse.bench.timing import device_name

    env = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "backend": backend, "world_size": world_size,
        "torch": torch.__version__, "python": platform.python_version(),
        "platform": platform.platform(), "cpu": device_name(torch.device("cpu")),
        "cpu_count": os.cpu_count(),
        "nccl_env": {k: v for k, v in sorted(os.environ.items()) if k.startswith("NCCL_")},
    }
    if torch.cuda.is_available():
        env["cuda"] = torch.version.cuda
        env["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        env["driver"] = _driver_version()
        if dist.is_nccl_available():
            env["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
    return env


def slug(text: str, limit: int = 40) -> str:
    """Make ``text`` short and safe for a file name.

    Example: ``"NVIDIA H100 80GB HBM3"`` becomes ``"nvidia-h100-80gb-hbm3"``.
    """
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")[:limit].strip("-") or "unknown"


def write_results(out_dir: str, name: str, payload: dict, figure=None) -> list[str]:
    """Write ``payload`` to ``out_dir/name.json`` and ``figure`` to ``name.png``; return the paths.

    Args:
        out_dir: directory, created if missing.
        name: file stem.
        payload: JSON-ready dict (rows, environment, settings).
        figure: an optional matplotlib Figure.

    Returns:
        The paths written.
    """
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, name + ".json")
    with open(path, "w") as f:
        json.dump(payload, f, indent=1, default=to_json)
        f.write("\n")
    paths = [path]
    if figure is not None:
        png = os.path.join(out_dir, name + ".png")
        figure.savefig(png, dpi=120)
        paths.append(png)
    return paths
