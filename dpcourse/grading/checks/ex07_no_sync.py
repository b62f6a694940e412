"""Exercise 07: gradient accumulation with ``no_sync()`` and one sync per optimizer step.

The grader's own accumulation loop runs the learner's wrapper (every micro-batch
but the last inside ``no_sync()``); the learner's loop is exercise 07's second
check (``token_weighted``). Both count all-reduces per parameter, by identity: the
rank notes whose ``param.grad`` each all-reduced tensor is (:class:`GradReductions`).
"""

from __future__ import annotations

from dpcourse.grading.checks import ddp_common as d
from dpcourse.grading.checks.base import CaseVerdict, follow_causes
from dpcourse.grading.criteria import Criterion, no_deadlock, no_delegation

NOT_A_GRADIENT = "no parameter's .grad"


def grad_owner(tensor, params) -> int | None:
    """Index of the parameter whose ``.grad`` is ``tensor`` (its memory, all of it), or None."""
    if tensor is None or not tensor.numel():
        return None
    for i, p in enumerate(params):
        g = p.grad
        if g is not None and g.numel() == tensor.numel() and \
                g.storage_offset() == tensor.storage_offset() and \
                g.untyped_storage().data_ptr() == tensor.untyped_storage().data_ptr():
            return i
    return None


class GradReductions:
    """Watch every all-reduce this rank issues (the learner's and the check's alike).

    While active, each all-reduce is noted under the case the rank is in (its last
    ``begin``) as ``note(owner)``'s return value, where ``owner`` is the index in
    ``params()`` of the parameter whose gradient the tensor is, or ``None``.

    Args:
        link: the rank's link; every collective of graded code goes through ``link.send``.
        params: returns the parameters to match, as they are at the time of the call.
        note: ``note(owner)``, what to record (default: ``owner`` itself).
        case: the case the rank is in already.
    """

    def __init__(self, link, params, note=lambda owner: owner, case: str = ""):
        self.link, self.params, self.note = link, params, note
        self.case, self.by_case = case, {}
        self.own = None  # a send the link already had as its own attribute, put back on exit

    def __enter__(self):
        send, self.own = self.link.send, vars(self.link).get("send")

        def watched(header, tensors=()):
            if header.get("t") == "begin":
                self.case = str(header.get("case", ""))
            elif header.get("t") == "coll" and header.get("op") == "all_reduce":
                owner = grad_owner(tensors[0] if tensors else None, self.params())
                self.by_case.setdefault(self.case, []).append(self.note(owner))
            return send(header, tensors)
        self.link.send = watched  # the instance's own attribute, over Link.send
        return self

    def __exit__(self, *exc):
        if self.own is None:
            del self.link.send
        else:
            self.link.send = self.own


def count_detail(names, owners, others: int = 0) -> tuple[str, str]:
    """``(detail, cause)`` for one step's all-reduces of gradients; ``("", "")`` when each
    parameter's gradient was all-reduced exactly once.

    Args:
        names: the parameters' names.
        owners: the index of the parameter each gradient all-reduce was for.
        others: how many all-reduces of other tensors to mention (a copy that was summed).
    """
    counts = [sum(o == i for o in owners) for i in range(len(names))]
    if all(c == 1 for c in counts):
        return "", ""
    listed = ", ".join(f"{n} {c}" for n, c in zip(names, counts))
    detail = f"all-reduces of each parameter's .grad: {listed} (expected 1 each)"
    if others:
        detail += f"; {others} all-reduce(s) of tensors that are {NOT_A_GRADIENT}"
    cause = "copy" if others and not any(counts) else "often" if max(counts) > 1 else "never"
    return detail, cause


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
