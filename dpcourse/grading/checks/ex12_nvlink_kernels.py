"""Exercise 12: the learner's one-shot kernel, and a two-shot kernel whose all-gather loads.

Lesson 12's two-shot pushes each slice's sum into every peer's buffer. The exercise's
two-shot must instead leave the sum in its owner's buffer and let every other rank
load it (the all-gather by loads, not stores): the same result, a different placement
of the sums, and its own argument for where the barriers go. After each two-shot call
the GPU ranks also return their buffer half, so the grader sees where the sums went.

The graded rank hands the kernels' source to GPU ranks it launches (over NCCL, 2
ranks, and 4 where the grader sees 4 GPUs), which build their inputs from seeds the
grader drew and return what the kernels left at positions the grader picked (whole
short tensors, a sample and both ends of long ones), after single calls and after
sampled calls of 1,000 back to back. The grader makes the same inputs and judges:
the sum (exact for small integers, to a tolerance for normal values), the same bits
on every rank, every call right, every launch finished. Without 2 CUDA GPUs in the
grader's view the check is not graded and nothing is started.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from dpcourse.comm.kernels.allreduce import ALIGN
from dpcourse.comm.sharding import chunk_size
from dpcourse.grading.checks.base import CaseVerdict, Exercise
from dpcourse.grading.criteria import Criterion, no_deadlock, no_delegation

FULL_LENGTHS = (4096, 8192, 65536)  # whole tiles (4096 float32 or 8192 bfloat16 elements)
AWKWARD_LENGTHS = (1, 3, 17, 1000, 4095, 4097, 8191, 8193, 300_001,
                   128 * 4096 * 2 + 3, 3 * 128 * 8192 + 7)  # the last two: blocks loop
DTYPES = ("float32", "bfloat16")
TOL = {"float32": 1e-5, "bfloat16": 6e-2}
KINDS = ("one_shot", "two_shot")
MIN_GPUS = 2
NEEDS = f"at least {MIN_GPUS} NVLink-connected GPUs"
SAMPLE, CALLS, SAMPLED_CALLS = 4096, 1000, 24
FULL_BELOW = 70_000  # tensors up to this length come back whole


CRITERIA = (  # of each kernel; the check names them one_shot_... and two_shot_...
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


PULLS = Criterion(
    "two_shot_pulls_the_sums", "two-shot: each slice's sum stays in its owner's buffer and the "
    "other ranks load it from there (no rank stores a sum into a peer's buffer)",
    "After adding your slice, store the sum into x and into your OWN buf at the same offsets; "
    "after the second block_barrier, load each other slice s from its owner's buffer "
    "(buf + peer_delta(buf_deltas, s)) into x. Stores into the peers' buffers are lesson 12's "
    "push version, not this one.", requires="two_shot")


def _gpu_count() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _lacking(gpus: int) -> str:
    return (f"these kernels need at least {MIN_GPUS} CUDA GPUs that can reach each other's "
            f"memory (NVLink); this machine has {gpus}")


def make_input(seed: int, rank: int, n: int, dtype: str, kind: str) -> torch.Tensor:
    """One rank's input of a case, made alike by the GPU ranks and by the grader (on CPU)."""
    g = torch.Generator().manual_seed(seed * 8 + rank)
    if kind == "int":  # small integers: every order of addition is exact
        return torch.randint(-8, 9, (n,), generator=g).to(getattr(torch, dtype))
    return torch.randn(n, generator=g).to(getattr(torch, dtype))


def _cases(inputs: dict):
    """``(criterion, n, dtype, input kind, seed)`` of every single-call case."""
    for i, n in enumerate(FULL_LENGTHS + AWKWARD_LENGTHS):
        crit = "matches_all_reduce" if n in FULL_LENGTHS else "awkward_lengths"
        for j, dtype in enumerate(DTYPES):
            for k, kind in enumerate(("int", "normal")):
                yield crit, n, dtype, kind, inputs["seed"] + 4 * i + 2 * j + k


def gpu_rank(kernels: dict, inputs: dict) -> dict:
    """Run on every GPU rank: ``{kind: {"cases": [...], "calls": [...]}}``, values at the probes."""
    import torch.distributed as dist

    from dpcourse.comm.kernels import release_workspaces
    from dpcourse.comm.kernels.exercise import all_reduce_with, last_buffer_half

    rank = dist.get_rank()
    dev = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() \
        else torch.device("cpu")  # the tests' CPU ranks
    out = {}
    try:
        for name, learner in kernels.items():
            fn, got = all_reduce_with(learner, name), {"cases": [], "calls": [], "buffer": []}
            for _, n, dtype, kind, seed in _cases(inputs):
                x = make_input(seed, rank, n, dtype, kind).to(dev)
                fn(x)
                probe = inputs["probes"][str(n)].to(dev)
                got["cases"].append(x[probe].cpu())
                if name == "two_shot":  # where this rank's buffer holds what
                    got["buffer"].append(last_buffer_half(x)[probe].cpu())
            for n in (4097, 300_001):
                for dtype in DTYPES:
                    base = make_input(inputs["seed"] - 1, rank, n, dtype, "int").to(dev)
                    probe = inputs["probes"][str(n)].to(dev)
                    kept = torch.empty(len(inputs["sampled"]), len(probe), dtype=base.dtype,
                                       device=dev)
                    x = torch.empty_like(base)
                    slot = {i: j for j, i in enumerate(inputs["sampled"])}
                    for i, offset in enumerate(inputs["offsets"]):  # no host sync between calls
                        torch.add(base, offset, out=x)
                        fn(x)
                        if i in slot:
                            kept[slot[i]] = x[probe]
                    got["calls"].append(kept.cpu())
            out[name] = got  # each .cpu() above waited for the kernels before it
    finally:
        release_workspaces()
    return out


class NvlinkKernels(Exercise):
    """``one_shot_kernel`` and a pulling ``two_shot_kernel``, run on this machine's GPUs."""

    name, exercise, title = "nvlink_kernels", "12", "All-reduce kernels on NVLink"
    defines = (("main", "one_shot_kernel"), ("two_shot", "two_shot_kernel"))
    timeout = 600.0
    needs = NEEDS
    # What the notebook's kernels are written with (the exercise's own module).
    allowed_imports = {"dpcourse.comm.kernels.exercise": {"block_barrier", "kernel",
                                                          "peer_delta", "tl"}}
    # Lesson 12's own (pushing) two-shot sums right: two-shot's criteria count only once
    # the kernel is the one asked for, so a transcription of the lesson earns none of them.
    criteria = tuple(
        replace(c, name=f"{kind}_{c.name}", description=f"{kind.replace('_', '-')}: "
                f"{c.description}", requires=None if kind == "one_shot" else "two_shot",
                needs=() if kind == "one_shot" else (PULLS.name,))
        for kind in KINDS for c in CRITERIA) + (
        PULLS, no_delegation("one_shot_matches_all_reduce"),
        no_deadlock("one_shot_matches_all_reduce"))
    notes = ("runs on every GPU of this machine (2 ranks, and 4 where present); needs at "
             "least 2 CUDA GPUs",)

    def unavailable_here(self) -> str | None:
        gpus = _gpu_count()
        return _lacking(gpus) if gpus < MIN_GPUS else None

    def make_inputs(self, rng, world_size):
        gen = torch.Generator().manual_seed(rng.getrandbits(62))
        probes = {}
        for n in FULL_LENGTHS + AWKWARD_LENGTHS:
            if n <= FULL_BELOW:
                probes[str(n)] = torch.arange(n)
            else:
                picked = torch.randint(0, n, (SAMPLE,), generator=gen)
                probes[str(n)] = torch.cat([torch.arange(8), picked, torch.arange(n - 8, n)])
        sampled = sorted(set(torch.randperm(CALLS - 1, generator=gen)[:SAMPLED_CALLS - 1]
                             .tolist()) | {CALLS - 1})
        return [{"seed": rng.getrandbits(40) * 64 + 1, "probes": probes, "sampled": sampled,
                 "offsets": torch.randint(0, 16, (CALLS,), generator=gen).tolist(),
                 "world_sizes": [w for w in (2, 4) if w <= _gpu_count()]}]

    @staticmethod
    def rank_run(link, learner, inputs):
        import dpcourse
        from dpcourse.launch.errors import RankDiedError, RankError, RankTimeoutError

        kernels = {k: learner[r] for k, r in zip(KINDS, ("main", "two_shot")) if learner.get(r)}
        for name, k in kernels.items():
            if k.is_stub():
                raise NotImplementedError(f"{k.name} is still the exercise's stub")
        if _gpu_count() < MIN_GPUS:  # the grader saw the GPUs: now they are gone
            raise RuntimeError(_lacking(_gpu_count()))
        out = []
        for ws in inputs.pop("world_sizes"):
            try:
                out.append({"ws": ws, "ranks": dpcourse.run(gpu_rank, kernels, inputs,
                                                            world_size=ws, backend="nccl",
                                                            timeout=500.0)})
            except RankTimeoutError:
                out.append({"ws": ws, "failed": "the kernels did not finish in 500 s (a block "
                            "waiting for a flag no peer raises?)", "timeout": True})
                break
            except (RankError, RankDiedError) as err:
                lines = [ln for ln in str(err).splitlines() if ln.strip() and "---" not in ln]
                out.append({"ws": ws, "failed": lines[-1] if lines else type(err).__name__})
                break
        return out

    def judge(self, ws, inputs, outputs, events):
        (inputs,), (runs,) = inputs, outputs
        recs = []
        for run in runs:
            ws = run["ws"]
            if "failed" in run:
                recs += [CaseVerdict(f"{kind}_{c.name}", False, f"{ws} ranks: {run['failed']}")
                         for kind in KINDS for c in CRITERIA
                         if c.name == "kernels_return" or not run.get("timeout")]
                if not run.get("timeout"):
                    recs.append(CaseVerdict(PULLS.name, False, f"{ws} ranks: {run['failed']}"))
                continue
            recs += [CaseVerdict(f"{kind}_kernels_return", True) for kind in run["ranks"][0]]
            for kind in run["ranks"][0]:
                recs += _judge_kind(kind, ws, inputs, [r[kind] for r in run["ranks"]])
            if "two_shot" in run["ranks"][0]:
                recs += _judge_pulls(ws, inputs, [r["two_shot"] for r in run["ranks"]])
        return recs


def _sum_at(seed: int, ws: int, n: int, dtype: str, kind: str, probe) -> torch.Tensor:
    return sum(make_input(seed, r, n, dtype, kind)[probe].double() for r in range(ws))


def _judge_kind(kind: str, ws: int, inputs: dict, ranks: list) -> list[CaseVerdict]:
    recs = []
    for i, (crit, n, dtype, how, seed) in enumerate(_cases(inputs)):
        case = f"{n} elements, {dtype}, {ws} ranks"
        got = [r["cases"][i] for r in ranks]
        recs.append(CaseVerdict(f"{kind}_ranks_agree", all(torch.equal(got[0], g) for g in got),
                                f"{case}: the ranks' sums differ", case))
        want = _sum_at(seed, ws, n, dtype, how, inputs["probes"][str(n)])
        diff = (got[0].double() - want).abs()
        bad = not torch.isfinite(diff).all() or (
            diff.max() > 0 if how == "int" else (diff > TOL[dtype] * (1 + want.abs())).any())
        recs.append(CaseVerdict(f"{kind}_{crit}", not bad, f"{case}: max difference "
                                f"{diff.nan_to_num(float('inf')).max().item():.3g} from the sum",
                                case))
    j = 0
    for n in (4097, 300_001):
        for dtype in DTYPES:
            want = _sum_at(inputs["seed"] - 1, ws, n, dtype, "int", inputs["probes"][str(n)])
            got = ranks[0]["calls"][j]
            j += 1
            wrong = [i for row, i in zip(got, inputs["sampled"])
                     if not torch.equal(row.double(), want + ws * inputs["offsets"][i])]
            recs.append(CaseVerdict(f"{kind}_back_to_back", not wrong, f"{n} elements, {dtype}: "
                                    f"wrong after call(s) {wrong[:5]} of {CALLS}"))
    return recs


def _judge_pulls(ws: int, inputs: dict, ranks: list) -> list[CaseVerdict]:
    """Rank r's buffer after a call: its own slice holds its sum, every other slice its input."""
    recs = []
    for i, (_, n, dtype, how, seed) in enumerate(_cases(inputs)):
        probe = inputs["probes"][str(n)]
        length = chunk_size(n, ws, align=ALIGN)  # the host's two-shot slices
        case, why = f"{n} elements, {dtype}, {ws} ranks", ""
        for r, got in enumerate(ranks):
            mine = probe // length == r
            inputs_r = make_input(seed, r, n, dtype, how)[probe]
            wrong = got["buffer"][i] != torch.where(mine, got["cases"][i], inputs_r)
            pushed, kept = (wrong & ~mine).nonzero().flatten(), (wrong & mine).nonzero().flatten()
            if len(pushed):  # a slice of another owner holds something else than our input
                j = pushed[0].item()
                pos = probe[j].item()
                why = (f"{case}: rank {r}'s buffer at element {pos} (slice {pos // length}) holds "
                       f"{got['buffer'][i][j].item():.6g}, not rank {r}'s input "
                       f"{inputs_r[j].item():.6g}: rank {pos // length} stored into it (pushed)")
                break
            if len(kept):
                pos = probe[kept[0].item()].item()
                why = (f"{case}: rank {r}'s buffer at element {pos} of its own slice does not "
                       "hold its sum, so its peers could not have loaded the sum from there")
                break
        recs.append(CaseVerdict("two_shot_pulls_the_sums", not why, why, case))
    return recs

