"""Exercise 07: gradient accumulation with ``no_sync()`` and one sync per optimizer step.

The grader's own accumulation loop runs the learner's wrapper (every micro-batch
but the last inside ``no_sync()``); the learner's loop is exercise 07's second
check (``token_weighted``). Both count all-reduces per parameter, by identity: the
rank notes whose ``param.grad`` each all-reduced tensor is
(:class:`~dpcourse.grading.checks.grad_reductions.GradReductions`).
"""

from __future__ import annotations

from dpcourse.grading.checks import ddp_common as d
from dpcourse.grading.checks.base import CaseVerdict, follow_causes
from dpcourse.grading.checks.grad_reductions import GradReductions, count_detail
from dpcourse.grading.criteria import Criterion, no_deadlock, no_delegation


class NoSync(d.DDPExercise):
    """Gradient accumulation: ``no_sync()`` on the learner's wrapper, and the accumulation loop."""

    name, exercise, title = "no_sync", "07", "Gradient accumulation with no_sync"
    defines = (("main", "HookedDDP"),)
    criteria = (
        d.C_DDP, d.C_SINGLE,
        Criterion("no_collective_inside_no_sync", "no all-reduce is issued inside no_sync()",
                  "An all-reduce ran during a backward inside no_sync(): the hooks communicate "
                  "whatever context they run in, so nothing they read tells them that "
                  "synchronisation is off (or it stayed off after the context ended).",
                  weight=2, needs=(d.C_DDP.name,)),
        Criterion("syncs_once_per_step", "each parameter's gradient (param.grad itself) is "
                  "all-reduced exactly once per optimizer step (on the last micro-batch)",
                  "Gradients were all-reduced more or less often than once per step: every "
                  "backward run outside no_sync() synchronises, and the counts say how many "
                  "of yours ran outside it.", weight=2),
        no_delegation(d.C_DDP.name), no_deadlock(d.C_DDP.name),
    )
    accumulation = 4

    @staticmethod
    def rank_run(link, learner, inputs):
        models = []

        def model_fn(seed):
            models.append(d.make_model(seed))
            return models[-1]

        watch = GradReductions(link, lambda: list(models[-1].parameters()) if models else [])
        with watch:
            out = d.rank_train(link, learner, inputs, model_fn=model_fn)
        out["reduced"] = [watch.by_case.get(f"run 0: step {s}", []) for s in range(d.STEPS)]
        return out

    def judge(self, ws, inputs, outputs, events):
        recs = [r for r in d.judge_training(ws, inputs, outputs, events)
                if r.criterion not in (d.C_BROADCAST.name, d.C_AVERAGED.name)]
        names = [n for n, _ in d.make_model(0).named_parameters()]
        causes = {}
        for r in range(ws):
            for step in range(d.STEPS):
                events_ = d.step_events(events[r], 0, step)
                inside, window, windows = [], False, 0
                for e in events_:
                    if e.get("label") == "no_sync_enter":
                        window, windows = True, windows + 1
                    elif e.get("label") == "no_sync_exit":
                        window = False
                    elif e["op"] == "all_reduce" and window:
                        inside.append(e)
                detail = (f"rank {r}, step {step}: {len(inside)} all-reduce(s) inside no_sync"
                          if windows else f"rank {r}, step {step}: no_sync() was never entered")
                recs.append(CaseVerdict("no_collective_inside_no_sync", windows and not inside, detail))
                owners = outputs[r]["reduced"][step]
                bad, cause = count_detail(names, [o for o in owners if o is not None],
                                          sum(o is None for o in owners))
                rec = CaseVerdict("syncs_once_per_step", not bad, f"rank {r}, step {step}: {bad}"
                                  if bad else "")
                causes[id(rec)] = cause
                recs.append(rec)
        follow_causes(self, recs, lambda rec: _HINTS.get(causes.get(id(rec)), ""))
        return recs


_HINTS = {
    "copy": "Your all-reduces summed new tensors (a quotient such as p.grad / world_size, or a "
            "copy), not p.grad: the sum lands in the new tensor, and p.grad keeps this rank's "
            "own gradient.",
    "never": "Some gradient was not all-reduced in the step: on the last micro-batch, outside "
             "no_sync(), the hook must communicate every gradient it is called for.",
}
