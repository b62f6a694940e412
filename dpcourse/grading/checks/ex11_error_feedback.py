"""Exercise 11: a bf16 compression communication hook with error feedback.

The learner writes ``error_feedback_hook(state, bucket)`` with torch's hook
signature. It compresses each bucket as torch's ``bf16_compress_hook`` does (cast
to bfloat16, divide by the world size in bfloat16, all-reduce), but first adds
the residual left by the previous step, and keeps what this step's compression
lost as the new residual in ``state[bucket.index()]`` (float32).

The rank plays a reducer: one flat buffer per bucket (odd sizes, one of a single
element), refilled with this rank's gradient every step as a reducer refills its
bucket storage, every hook launched before any result is waited for, and the
future's value copied back with our wrappers' own code
(:func:`dpcourse.ddp.comm_hooks.finish_comm_hook`, as torch's reducer does). It
watches what the hook hands to ``all_reduce`` and returns, per step and bucket,
the result, the residual and the tensors sent. The grader then checks, with
references it computes itself:

* the first step equals torch's ``bf16_compress_hook``
  (:func:`dpcourse.grading.oracles.compress_hook`, held against torch DDP in the tests);
* what was sent is the compression of gradient + previous residual, and the
  residual is exactly what that compression lost (transmitted + new residual ==
  gradient + old residual, to float32 rounding);
* the sum of the averaged gradients over all steps stays closer to the
  uncompressed sum than torch's hook without feedback does on the same data.
"""

from __future__ import annotations

import torch

from dpcourse.grading.checks.base import Exercise, Record, begin, events_of
from dpcourse.grading.criteria import Criterion, mismatch, no_deadlock, no_delegation
from dpcourse.grading.shim import COLLECTIVES

SIZES = (13, 1, 200)   # elements per bucket: odd, and one bucket of a single element
STEPS = 12
DTYPE = torch.bfloat16
TRACKING = 0.5        # the feedback run's drift must stay under this share of torch's hook's


class ErrorFeedbackHook(Exercise):
    """``error_feedback_hook(state, bucket)``: bf16 compression with the residual fed back."""

    name, exercise, title = "error_feedback_hook", "11", "Compression hook with error feedback"
    defines = (("main", "error_feedback_hook"),)
    world_sizes = (2, 3)
    dist_api = COLLECTIVES
    dist_why = "A communication hook reduces its bucket with dist.all_reduce."
    timeout = 45.0
    criteria = (
        Criterion("first_step_is_torchs_hook", "with no residual yet, every rank's bucket after "
                  "the first step equals torch's bf16_compress_hook on the same gradients",
                  "With an empty residual the hook must do what torch's bf16 hook does: cast the "
                  "bucket to bfloat16, divide by the world size in bfloat16, all-reduce the sum "
                  "(divide before summing, so N values add up in one gradient's range), and "
                  "return it cast back to the bucket's dtype.", weight=2),
        Criterion("sends_bf16", "each bucket crosses the wire once per step, in bfloat16 "
                  "(2 bytes per element)",
                  "All-reduce the compressed tensor, not the float32 buffer, and only once per "
                  "bucket: the point of the hook is half the bytes."),
        Criterion("keeps_residual", "after every step, state[bucket.index()] holds the bucket's "
                  "residual as a float32 tensor of the bucket's size",
                  "Keep what compression lost, per bucket, in the state dict under the bucket's "
                  "index, in the gradient's dtype (float32) and as a tensor of its own: a "
                  "bfloat16 residual rounds away the small values it exists to keep, and a view "
                  "of the bucket's buffer is overwritten by the next step's gradient."),
        Criterion("compresses_corrected_gradient", "what a rank sends is the bf16 compression of "
                  "its gradient plus the previous step's residual, added once",
                  "Before compressing, add the residual from the previous step to the gradient, "
                  "exactly once per step; the first step starts from a zero residual.", weight=2),
        Criterion("residual_is_what_was_lost", "transmitted + new residual == gradient + old "
                  "residual, on every rank, to float32 rounding",
                  "The residual is everything the rank's contribution lost: (gradient + old "
                  "residual) minus what was sent, cast back to float32 and multiplied by the world "
                  "size. Take it after the division, which rounds too when the world size is not "
                  "a power of two, and compute it in float32.", weight=2),
        Criterion("returns_reduced", "the future's value is the all-reduced bf16 sum, cast back "
                  "to the bucket's dtype", "Return a future whose value is the reduced tensor "
                  "decompressed (cast to float32), nothing added to it: the residual is kept "
                  "locally, never applied to the averaged gradient."),
        Criterion("tracks_uncompressed", f"over {STEPS} steps, the sum of what each rank "
                  "transmitted (sent x world size) drifts from the sum of its gradients by under "
                  f"{TRACKING:g}x what torch's hook without feedback drifts",
                  "Error feedback makes the rounding errors cancel over steps instead of adding "
                  "up: check the criteria about the residual.", weight=2),
        no_delegation("first_step_is_torchs_hook"), no_deadlock("first_step_is_torchs_hook"),
    )
    notes = ("exact (bitwise) comparisons with torch's bf16 arithmetic; the residual identity to "
             "float32 rounding; fresh random gradients on each run",)

    def make_inputs(self, rng, world_size):
        gen = torch.Generator().manual_seed(rng.getrandbits(62))
        out = []
        for _ in range(world_size):
            # Magnitudes over three decades; steady gradients (step-to-step noise under bf16's
            # resolution), where rounding without feedback drifts the same way every step.
            scale = [10 ** (-3 * torch.rand(n, generator=gen)) for n in SIZES]
            base = [torch.randn(n, generator=gen) * s for n, s in zip(SIZES, scale)]
            grads = [[b + 1e-3 * s * torch.randn(len(b), generator=gen)
                      for b, s in zip(base, scale)] for _ in range(STEPS)]
            out.append({"grads": grads})
        return out

    @staticmethod
    def rank_run(link, learner, inputs):
        from torch import nn

        from dpcourse.ddp.comm_hooks import launch_comm_hook

        hook, state = learner["main"], {}
        buffers = [torch.zeros(n) for n in SIZES]
        params = [nn.Parameter(torch.zeros(n)) for n in SIZES]
        sent, original = [], link.send

        def watch(header, tensors=()):  # what the hook hands to all_reduce, as sent
            if header.get("t") == "coll" and header.get("op") == "all_reduce" and tensors:
                sent.append(tensors[0].detach().clone())
            return original(header, tensors)

        link.send = watch
        steps = []
        try:
            for s, grads in enumerate(inputs["grads"]):
                begin(link, f"step {s}")
                works, per_bucket = [], []
                for i, g in enumerate(grads):
                    with torch.no_grad():
                        buffers[i].copy_(g)
                    before = len(sent)
                    works.append(launch_comm_hook(hook, state, i, buffers[i], [buffers[i]],
                                                  [params[i]], i == len(grads) - 1))
                    per_bucket.append(before)
                for w in works:
                    w.wait()
                bounds = per_bucket + [len(sent)]
                res = [state.get(i) for i in range(len(grads))]
                steps.append({
                    "results": [b.detach().clone() for b in buffers],
                    "sent": [sent[bounds[i]:bounds[i + 1]] for i in range(len(grads))],
                    "residuals": [r.detach().clone() if isinstance(r, torch.Tensor) else None
                                  for r in res],
                    "residual_types": [type(r).__name__ for r in res]})
        finally:
            link.send = original
        return {"steps": steps}

    def judge(self, ws, inputs, outputs, events):
        from dpcourse.grading import oracles

        recs, label = [], f"world size {ws}"
        grads = [[[g.float() for g in step] for step in inputs[r]["grads"]] for r in range(ws)]
        steps = [outputs[r]["steps"] for r in range(ws)]
        # First step: torch's hook on the same gradients.
        for i, n in enumerate(SIZES):
            want = oracles.compress_hook([grads[r][0][i] for r in range(ws)], DTYPE)
            bad = [(r, m) for r in range(ws) if (m := mismatch(steps[r][0]["results"][i], want,
                                                               0, 0))]
            recs.append(Record("first_step_is_torchs_hook", not bad, f"rank {bad[0][0]}, bucket "
                               f"of {n}: {bad[0][1]}" if bad else "", label))
        for r in range(ws):
            for s in range(STEPS):
                recs.append(self._bytes(events[r], s, f"{label}, rank {r}, step {s}"))
        for s in range(STEPS):
            for i, n in enumerate(SIZES):
                where = f"{label}, step {s}, bucket of {n}"
                recs += self._step(ws, grads, steps, s, i, where)
        recs.append(self._tracking(ws, grads, steps, oracles, label))
        return recs

    @staticmethod
    def _bytes(events, s, where) -> Record:
        got = sorted(e["nbytes"] for e in events_of(events, f"step {s}") if e["op"] == "all_reduce")
        want = sorted(2 * n for n in SIZES)
        return Record("sends_bf16", got == want, f"all-reduced {got} bytes, expected {want} "
                      "(one bfloat16 all-reduce per bucket)", where)

    def _step(self, ws, grads, steps, s, i, where) -> list[Record]:
        n, recs = SIZES[i], []
        for r in range(ws):
            here = f"{where}, rank {r}"
            got = steps[r][s]
            res = got["residuals"][i]
            recs.append(self._residual_kept(res, got["residual_types"][i], n, here))
            old = torch.zeros(n) if s == 0 else steps[r][s - 1]["residuals"][i]
            old = torch.zeros(n) if old is None or old.numel() != n else old.float()
            mine = [t for t in got["sent"][i] if t.numel() == n]
            if len(mine) != 1:
                detail = (f"{len(got['sent'][i])} all-reduce(s) during the hook, "
                          f"{len(mine)} of the bucket's size; expected exactly one")
                recs += [Record(c, False, detail, here) for c in
                         ("compresses_corrected_gradient", "residual_is_what_was_lost")]
                continue
            sent, g = mine[0], grads[r][s][i]
            recs.append(self._compressed(sent, g, old, ws, here))
            recs.append(self._lost(sent, res, g, old, ws, here))
        sents = [[t for t in steps[r][s]["sent"][i] if t.numel() == n] for r in range(ws)]
        if s > 0 and all(len(x) == 1 and x[0].dtype == sents[0][0].dtype for x in sents):
            total = sents[0][0].clone()
            for x in sents[1:]:
                total += x[0]
            bad = [(r, m) for r in range(ws)
                   if (m := mismatch(steps[r][s]["results"][i], total.float(), 0, 0))]
            recs.append(Record("returns_reduced", not bad, f"rank {bad[0][0]}: {bad[0][1]}"
                               if bad else "", where))
        return recs

    @staticmethod
    def _residual_kept(res, kind, n, where) -> Record:
        if res is None:
            detail = (f"state[bucket.index()] holds {kind} after the step, not a tensor"
                      if kind != "NoneType" else "nothing stored in state[bucket.index()]")
        elif res.dtype != torch.float32:
            detail = f"the residual is kept in {str(res.dtype).replace('torch.', '')}, not float32"
        elif res.numel() != n:
            detail = f"the residual has {res.numel()} elements, the bucket {n}"
        else:
            detail = ""
        return Record("keeps_residual", not detail, detail, where)

    @staticmethod
    def _compressed(sent, g, old, ws, where) -> Record:
        def compress(x):
            return x.to(DTYPE).div_(ws)

        if sent.dtype != DTYPE:
            return Record("compresses_corrected_gradient", False, f"sent "
                          f"{str(sent.dtype).replace('torch.', '')}, not bfloat16", where)
        if torch.equal(sent, compress(g + old)):
            return Record("compresses_corrected_gradient", True, "", where)
        detail = mismatch(sent.float(), compress(g + old).float(), 0, 0)
        if old.any() and torch.equal(sent, compress(g)):
            detail = "what was sent is the gradient alone: the stored residual was never added"
        elif old.any() and torch.equal(sent, compress(g + 2 * old)):
            detail = "what was sent holds the previous residual twice: it was added twice"
        elif torch.equal(sent, (g + old).div(ws).to(DTYPE)):
            detail = ("divided in float32 before casting: torch's hook casts to bfloat16 first, "
                      "then divides in bfloat16")
        elif torch.equal(sent, (g + old).to(DTYPE)):
            detail = "not divided by the world size before the all-reduce"
        return Record("compresses_corrected_gradient", False, detail, where)

    @staticmethod
    def _lost(sent, res, g, old, ws, where) -> Record:
        if res is None or res.numel() != g.numel():
            return Record("residual_is_what_was_lost", False, "no residual of the bucket's size "
                          "to compare", where)
        corrected = g + old
        want = corrected - sent.float() * ws
        # float32 rounding of the two operations above, relative to the bucket's scale
        tol = 4 * torch.finfo(torch.float32).eps * float(corrected.abs().max())
        if mismatch(res.float(), want, 0, tol) == "":
            return Record("residual_is_what_was_lost", True, "", where)
        detail = mismatch(res.float(), want, 0, tol)
        if not res.any() and want.any():
            detail = "the residual is all zeros although compression lost something"
        elif mismatch(res.float(), corrected - corrected.to(DTYPE).float(), 0, tol) == "":
            detail = ("the residual was taken before the division by the world size: it misses "
                      "what the division in bfloat16 rounded away")
        elif old.any() and mismatch(res.float(), want + old, 0, tol) == "":
            detail = ("the residual counts the previous residual twice (transmitted + new "
                      "residual exceeds gradient + old residual by the old residual)")
        elif res.dtype != torch.float32 or \
                mismatch(res.float(), want.to(res.dtype).float(), 0, tol) == "":
            detail = f"the residual was rounded to {str(res.dtype).replace('torch.', '')}: {detail}"
        return Record("residual_is_what_was_lost", False, detail, where)

    @staticmethod
    def _tracking(ws, grads, steps, oracles, label) -> Record:
        """Drift of the summed contributions, and (reported only) of the applied updates.

        Feedback bounds each rank's drift by its last residual; the bf16 sum inside the
        all-reduce rounds again, unseen by any rank, so the applied update keeps that error.
        """
        drift, plain = [], []
        exact = torch.zeros(sum(SIZES), dtype=torch.float64)
        applied, applied_plain = torch.zeros_like(exact), torch.zeros_like(exact)
        for r in range(ws):
            mine, theirs = torch.zeros_like(exact), torch.zeros_like(exact)
            for s in range(STEPS):
                g = torch.cat(grads[r][s]).double()
                sent = [[t for t in x if t.numel() == n] for x, n in
                        zip(steps[r][s]["sent"], SIZES)]
                if any(len(x) != 1 for x in sent):
                    return Record("tracks_uncompressed", False, "not one all-reduce of the "
                                  "bucket's size per bucket and step", label)
                mine += torch.cat([x[0] for x in sent]).double() * ws - g
                theirs += torch.cat(grads[r][s]).to(DTYPE).div_(ws).double() * ws - g
            drift.append(mine), plain.append(theirs)
        for s in range(STEPS):
            per_rank = [torch.cat(grads[r][s]) for r in range(ws)]
            exact += sum(g.double() for g in per_rank) / ws
            applied += torch.cat(steps[0][s]["results"]).double()
            applied_plain += oracles.compress_hook(per_rank, DTYPE).double()
        ours, theirs = float(torch.cat(drift).norm()), float(torch.cat(plain).norm())
        return Record("tracks_uncompressed", ours <= TRACKING * theirs,
                      f"after {STEPS} steps, |sum of transmitted - sum of gradients| over the "
                      f"ranks: {ours:.3g} with your hook, {theirs:.3g} with torch's hook (ratio "
                      f"{ours / theirs:.2f}, must be <= {TRACKING:g}); the applied updates drift "
                      f"{float((applied - exact).norm()):.3g} vs "
                      f"{float((applied_plain - exact).norm()):.3g} (the bf16 sum rounds too)",
                      label)

    def explain(self, text):
        if "'NoneType' object" in text or "KeyError" in text:
            return ("state starts empty: on a bucket's first step there is no residual yet, "
                    "so it starts from zeros of the bucket's size.")
        if "must return a torch.futures.Future" in text:
            return ("A hook returns the future of its asynchronous all-reduce, chained with a "
                    "callback that decompresses the result, not a tensor.")
        return ""
