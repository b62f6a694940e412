"""Which parameter's gradient each all-reduce of a rank was for, by identity (exercise 07).

A count of elements cannot tell ``param.grad`` from a summed copy of it, nor one reduction of
every gradient from two of half of them: both checks of exercise 07 (``no_sync`` and
``token_weighted``) count per parameter by the memory the all-reduced tensor is.
"""

from __future__ import annotations

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
