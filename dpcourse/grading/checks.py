"""``check(name, obj)``: the one call a learner makes to have an exercise checked.

The registry below maps a check's name to its :class:`~dpcourse.grading.runner.CheckSpec`.
"""

from __future__ import annotations

from dpcourse.grading.report import CheckResult, append_to_grade_file, show


def _specs() -> dict:
    # Imported on demand: every rank and every check() call builds the table afresh.
    from dpcourse.grading import checks_collectives as col
    from dpcourse.grading import checks_ddp as ddp
    from dpcourse.grading import checks_pure as pure
    from dpcourse.grading import ex01_mean_gradient as ex01
    from dpcourse.grading import ex03_buffers_unused as ex03
    from dpcourse.grading import ex04_halving_doubling as ex04
    from dpcourse.grading import ex05_first_bucket as ex05
    from dpcourse.grading import ex06_arrival_order as ex06
    from dpcourse.grading import ex07_token_weighted as ex07
    from dpcourse.grading import ex08_checkpoint as ex08
    from dpcourse.grading import ex12_nvlink_kernels as ex12
    from dpcourse.grading import ex13_sharded_step as ex13

    specs = (ex01.MeanGradient, col.CollectiveSemantics, col.RingAllReduce,
             ex04.HalvingDoublingAllReduce, ddp.NaiveDDP, ex03.BuffersUnused, pure.AssignBuckets,
             ex05.FirstBucket,
             ddp.OverlappedDDP, ex06.ArrivalOrderDDP, ddp.NoSync, ex07.TokenWeighted,
             ex08.CheckpointResume, pure.RingCost, ex12.NvlinkKernels, ex13.ShardedStep)
    return {s.name: s for s in specs}


def available_checks() -> list[str]:
    """Return the names ``check()`` accepts, in lesson order."""
    return sorted(_specs(), key=lambda n: (_specs()[n].exercise, n))


def get_spec(name: str):
    """Return a fresh instance of the check called ``name``.

    Args:
        name: e.g. ``"ring_all_reduce"``.
    """
    specs = _specs()
    if name not in specs:
        raise ValueError(f"unknown check {name!r}: choose one of {', '.join(available_checks())}.")
    return specs[name]()


def check(name: str, obj, *, world_sizes=None, timeout: float | None = None,
          backend: str = "auto", quiet: bool = False, **extras) -> CheckResult:
    """Check the learner's ``obj`` against torch on several ranks; show and return the report.

    Never raises because of the learner's code: an exception, a hang, or a
    missing implementation (``NotImplementedError``) becomes failed criteria.

    Args:
        name: which exercise, e.g. ``"ring_all_reduce"`` (see :func:`available_checks`).
        obj: the learner's function or class.
        world_sizes: world sizes to launch (default: the check's own, e.g. ``(2, 3, 4)``).
        timeout: seconds per launch before the ranks count as hung (default: the check's).
        backend: ``"auto"``, ``"gloo"`` or ``"nccl"`` (as in :func:`dpcourse.run`).
        quiet: don't display the report (it is still returned and recorded).
        **extras: further learner objects a check accepts, e.g.
            ``reduce_scatter=ring_reduce_scatter`` for ``"ring_all_reduce"``.

    Returns:
        A :class:`~dpcourse.grading.report.CheckResult` (``.score``, ``.criteria``,
        ``.points``); in Jupyter it renders as a table.
    """
    from dpcourse.grading.runner import run_check

    spec = get_spec(name)
    unknown = set(extras) - {c.requires for c in spec.criteria if c.requires}
    if unknown:
        raise TypeError(f"check({name!r}) got unexpected keyword(s) {sorted(unknown)}; it accepts "
                        f"{sorted({c.requires for c in spec.criteria if c.requires}) or 'none'}.")
    result = run_check(spec, obj, extras, world_sizes=world_sizes, timeout=timeout, backend=backend)
    append_to_grade_file(result)
    if not quiet:
        show(result)
    return result
