"""Check for exercise 12: the learner's one-shot and two-shot Triton kernels on NVLink.

The learner's kernels (``@kernel`` from :mod:`dpcourse.comm.kernels.exercise`)
travel to the ranks as source, are compiled there, and are launched by the
package's host code on every GPU of the machine: world size 2, and 4 where
present. Each must leave what ``dist.all_reduce`` leaves for many lengths
(including non-multiples of the block and of the grid), in float32 and
bfloat16, give every rank the same bits, and stay right over 1,000 calls
back to back with inputs that change every call: a missing release/acquire or
a buffer reused too early shows up there. A kernel that never returns (a
block waiting for a flag no peer raises) is stopped and reported. Without at
least 2 CUDA GPUs the check is skipped with a message saying so, and ``dpcourse
grade`` marks the exercise "not graded on this machine" instead of running it.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from dpcourse.grading.criteria import Criterion as GradingCriterion
from dpcourse.grading.inprocess import CheckSpec


class Criterion(NamedTuple):
    """One thing the check verifies: a short name, what must hold, and the likely mistake."""

    name: str
    description: str
    hint: str

FULL_LENGTHS = (4096, 8192, 65536)  # whole tiles (4096 float32 or 8192 bfloat16 elements)
AWKWARD_LENGTHS = (1, 3, 17, 1000, 4095, 4097, 8191, 8193, 300_001,
                   128 * 4096 * 2 + 3, 3 * 128 * 8192 + 7)  # the last two: blocks loop
DTYPES = (torch.float32, torch.bfloat16)
TOL = {torch.float32: 1e-5, torch.bfloat16: 6e-2}

CRITERIA = (
    Criterion("matches_all_reduce", "sums like dist.all_reduce (float32 and bfloat16, lengths "
              "that fill whole blocks)",
              "Load BLOCK elements per step with a mask (offs < numel), add every rank's copy "
              "in fp32, store the sum back into x in x's dtype."),
    Criterion("awkward_lengths", "also for lengths that are not multiples of the block or of "
              "the grid (1, 3, 17, 4097, ...)",
              "Loop over tiles with a grid stride: start at pid * BLOCK, step by "
              "num_programs * BLOCK, and mask every load and store."),
    Criterion("ranks_agree", "every rank ends with the same bits",
              "Add the ranks' copies in the same order on every rank (0, 1, ..., N-1)."),
    Criterion("back_to_back", "stays right over 1,000 calls in a row with changing inputs",
              "A wrong sum only now and then is a race: stage your data, then call "
              "block_barrier before loading a peer's buffer; in two-shot, call it again after "
              "pushing the sums and before copying them out."),
    Criterion("kernels_return", "every kernel returns (no block waits forever for a flag)",
              "Every block must call block_barrier the same number of times on every rank, "
              "with its own program id; never return early from a block."),
)


def _inputs(case: int, rank: int, n: int, dtype, kind: str) -> torch.Tensor:
    g = torch.Generator().manual_seed(100_003 * case + rank)
    if kind == "int":  # small integers: every order of addition is exact
        return torch.randint(-8, 9, (n,), generator=g).to(dtype)
    return torch.randn(n, generator=g).to(dtype)


def _compare(fn, n, dtype, case) -> list[str]:
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", torch.cuda.current_device())
    problems = []
    for kind in ("int", "normal"):
        x = _inputs(case, rank, n, dtype, kind).to(dev)
        ref = x.clone()
        dist.all_reduce(ref)
        got = x.clone()
        fn(got)
        every = [torch.empty_like(got) for _ in range(world)]
        dist.all_gather(every, got)
        name = f"{n} elements, {str(dtype).replace('torch.', '')}, {world} ranks"
        if not all(torch.equal(every[0], e) for e in every):
            problems.append(("ranks_agree", name))
        bad = (not torch.equal(got, ref)) if kind == "int" else not torch.allclose(
            got.float(), ref.float(), rtol=TOL[dtype], atol=TOL[dtype])
        if bad or not torch.isfinite(got.float()).all():
            err = (got.float() - ref.float()).abs().max().item()
            problems.append((None, f"{name}: max difference {err:.3g} from dist.all_reduce"))
    return problems


def _back_to_back(fn, calls: int) -> list[str]:
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", torch.cuda.current_device())
    problems = []
    for n in (4097, 300_001):
        for dtype in DTYPES:
            base = _inputs(7, rank, n, dtype, "int").to(dev)
            ref = base.clone()
            dist.all_reduce(ref)
            errors = torch.empty(calls, dtype=torch.float64, device=dev)
            x = torch.empty_like(base)
            for i in range(calls):  # no host synchronisation between calls
                torch.add(base, i % 16, out=x)
                fn(x)
                errors[i] = (x.double() - ref.double() - world * (i % 16)).abs().max()
            wrong = errors.nonzero().flatten().tolist()
            if wrong:
                problems.append(f"{n} elements, {str(dtype).replace('torch.', '')}: wrong in "
                                f"{len(wrong)} of {calls} calls (first: {wrong[:5]})")
    return problems


def rank_check(kernels: dict, calls: int) -> dict:
    """Run on every rank: ``{kind: {criterion: [problems]}}`` for the learner's kernels."""
    from dpcourse.comm.kernels import release_workspaces
    from dpcourse.comm.kernels.exercise import all_reduce_with

    out = {}
    try:
        for kind, learner in kernels.items():
            fn = all_reduce_with(learner, kind)
            found = {c.name: [] for c in CRITERIA}
            for case, n in enumerate(FULL_LENGTHS + AWKWARD_LENGTHS):
                crit = "matches_all_reduce" if n in FULL_LENGTHS else "awkward_lengths"
                for dtype in DTYPES:
                    for which, msg in _compare(fn, n, dtype, case):
                        found[which or crit].append(msg)
            found["back_to_back"] = _back_to_back(fn, calls)
            out[kind] = found
        torch.cuda.synchronize()
    finally:
        release_workspaces()
    return out


def check_nvlink_kernels(one_shot_kernel, two_shot_kernel=None, *, world_sizes=None,
                         calls: int = 1000, timeout: float = 600.0, quiet: bool = False) -> dict:
    """Check the learner's kernels against ``dist.all_reduce`` on this machine's GPUs.

    Args:
        one_shot_kernel: the learner's one-shot kernel (decorated with ``@kernel``).
        two_shot_kernel: the learner's two-shot kernel, if written.
        world_sizes: ranks per launch (default 2, and 4 where 4 GPUs are present).
        calls: back-to-back calls in the race test.
        timeout: seconds per launch before the ranks count as hung.
        quiet: don't print the report.

    Returns:
        ``{"skipped": bool, "message": str, "results": {kind: {criterion: passed}}}``.
    """
    import dpcourse
    from dpcourse.launch.errors import RankDiedError, RankError, RankTimeoutError

    gpus = _gpu_count()
    if gpus < MIN_GPUS:
        message = _skip_message(gpus, MIN_GPUS)
        if not quiet:
            print(message)
        return {"skipped": True, "message": message, "results": {}}
    kernels = {k: v for k, v in (("one_shot", one_shot_kernel), ("two_shot", two_shot_kernel))
               if v is not None}
    results, details = {}, []
    for kind, learner in kernels.items():
        if learner.is_stub():
            results[kind] = {c.name: False for c in CRITERIA}
            details.append(f"{kind}: not implemented yet")
    pending = {k: v for k, v in kernels.items() if k not in results}
    sizes = world_sizes or [w for w in (2, 4) if w <= gpus]
    for ws in sizes:
        if not pending:
            break
        try:
            found = dpcourse.run(rank_check, pending, calls, world_size=ws, backend="nccl",
                                 timeout=timeout)[0]
        except RankTimeoutError:
            for kind in pending:
                results[kind] = {c.name: False for c in CRITERIA}
            details.append(f"{ws} ranks: the kernels did not finish in {timeout:.0f} s "
                           f"(a block waiting for a flag no peer raises?)")
            break
        except (RankError, RankDiedError) as err:
            for kind in pending:
                results[kind] = {c.name: False for c in CRITERIA}
            lines = [ln for ln in str(err).splitlines() if ln.strip() and not ln.startswith("---")]
            details.append(f"{ws} ranks: {lines[-1] if lines else type(err).__name__}")
            break
        for kind, problems in found.items():
            prev = results.setdefault(kind, {c.name: True for c in CRITERIA})
            for name, msgs in problems.items():
                prev[name] = prev[name] and not msgs
                details += [f"{kind}, {ws} ranks, {name}: {m}" for m in msgs[:3]]
    report = {"skipped": False, "message": "; ".join(details), "results": results,
              "world_sizes": sizes}
    if not quiet:
        _show(report)
    return report


def _show(report: dict) -> None:
    from dpcourse.formatting import format_table

    rows = []
    for kind, res in report["results"].items():
        for c in CRITERIA:
            rows.append({"kernel": kind, "criterion": c.description,
                         "result": "pass" if res[c.name] else "FAIL",
                         "hint": "" if res[c.name] else c.hint})
    print(f"exercise 12 on {report['world_sizes']} ranks")
    print(format_table(rows))
    for line in report["message"].split("; ") if report["message"] else []:
        print("  " + line)


def _gpu_count() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


MIN_GPUS = 2
NEEDS = f"at least {MIN_GPUS} NVLink-connected GPUs"


def _lacking(gpus: int, minimum: int) -> str:
    return (f"these kernels need at least {minimum} CUDA GPUs that can reach each other's "
            f"memory (NVLink); this machine has {gpus}")


def _skip_message(gpus: int, minimum: int) -> str:
    return (f"skipped: {_lacking(gpus, minimum)}. Run this notebook on a GPU machine to have "
            "your kernels checked.")


class NvlinkKernels(CheckSpec):
    """``check("nvlink_kernels", one_shot_kernel, two_shot=two_shot_kernel)`` on this machine's GPUs."""

    name, exercise, title = "nvlink_kernels", "12", "All-reduce kernels on NVLink"
    in_rank = False  # check_nvlink_kernels starts the GPU ranks itself
    timeout = 600.0
    needs = NEEDS
    # What the notebook's kernels are written with (the exercise's own module).
    allowed_imports = {"dpcourse.comm.kernels.exercise": {"block_barrier", "kernel",
                                                          "peer_delta", "tl"}}
    criteria = tuple(
        GradingCriterion(f"{kind}_{c.name}", f"{kind.replace('_', '-')}: {c.description}",
                         c.hint, requires=None if kind == "one_shot" else "two_shot")
        for kind in ("one_shot", "two_shot") for c in CRITERIA)
    notes = ("runs on every GPU of this machine (2 ranks, and 4 where present); needs at "
             "least 2 CUDA GPUs",)

    def unavailable_here(self) -> str | None:
        gpus = _gpu_count()
        return _lacking(gpus, MIN_GPUS) if gpus < MIN_GPUS else None

    def run(self, rec, learner, extras, reference):
        if learner.is_stub():  # like every check: an exercise not started stops at once
            raise NotImplementedError(f"{learner.name} is still the exercise's stub")
        report = check_nvlink_kernels(learner, extras.get("two_shot"), quiet=True)
        if report["skipped"]:  # whoever started this run found the GPUs: now they are gone
            raise RuntimeError(report["message"])
        for kind, results in report["results"].items():
            for name, passed in results.items():
                detail = "; ".join(m for m in report["message"].split("; ")
                                   if m.startswith(f"{kind},") and f" {name}:" in m)
                rec.record(f"{kind}_{name}", passed,
                           detail or ("" if passed else report["message"]))
