"""Read the GPU measurements the lessons show beside the learner's own CPU run.

``python -m dpcourse.bench.lessons`` writes ``docs/results/lessonNN-<N>x-<gpu>.json``
on a GPU machine; a lesson loads its file with :func:`load_recording` and draws its
tables and plots from it, so no number of a GPU run is ever typed into the text.
"""

from __future__ import annotations

import json
import pathlib

RESULTS = pathlib.Path(__file__).resolve().parents[2] / "docs" / "results"


def hardware(environment: dict) -> str:
    """Describe a recording's machine in one line: GPUs, torch, CUDA and NCCL versions.

    Args:
        environment: the ``environment`` dict of a results file.

    Returns:
        e.g. ``"2 x NVIDIA H200, torch 2.11.0+cu130, CUDA 13.0, NCCL 2.28.9"``.
    """
    gpus = environment.get("gpus") or ["CPU"]
    parts = [f"{len(gpus)} x {gpus[0]}", f"torch {environment.get('torch')}"]
    parts += [f"{k.upper()} {environment[k]}" for k in ("cuda", "nccl") if environment.get(k)]
    return ", ".join(parts)


def load_recording(lesson: str, results_dir=None) -> dict:
    """Load the recorded GPU measurements of one lesson.

    Args:
        lesson: the lesson number, e.g. ``"06"``.
        results_dir: where the files are (default: the repository's ``docs/results``).

    Returns:
        The file's dict, plus ``"file"`` (its name) and ``"hardware"`` (see :func:`hardware`).
    """
    folder = pathlib.Path(results_dir) if results_dir is not None else RESULTS
    files = sorted(folder.glob(f"lesson{lesson}-*.json"))
    if not files:
        raise FileNotFoundError(
            f"no recording for lesson {lesson} in {folder}: run "
            "`python -m dpcourse.bench.lessons docs/results` on a GPU machine.")
    data = json.loads(files[0].read_text())
    data["file"] = files[0].name
    data["hardware"] = hardware(data.get("environment", {}))
    return data
