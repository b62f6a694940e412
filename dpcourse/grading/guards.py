"""Make sure a check measures the learner's code, not the thing being taught.

While a check runs the learner's code, the dpcourse reference of the exercise
(e.g. ``dpcourse.comm.ring_all_reduce``) is replaced by a stand-in that raises
:class:`DelegationError`, and so is ``torch.nn.parallel.DistributedDataParallel``.
The learner's code is unpickled *after* the stand-ins are in place, so even a
reference captured at import time (``from dpcourse.comm import ring_all_reduce``
in a notebook cell) resolves to the stand-in. :func:`static_references` also
looks for such references before anything runs.
"""

from __future__ import annotations

import builtins
import contextlib
import importlib
import inspect
import sys
import types

TORCH_DDP = "torch.nn.parallel.DistributedDataParallel"


class DelegationError(RuntimeError):
    """Learner code called what the exercise asks it to implement."""


def resolve(path: str):
    """Return the object at dotted ``path`` (``"pkg.module.attr"``), or None if it does not exist.

    Args:
        path: e.g. ``"dpcourse.comm.ring.ring_all_reduce"``.
    """
    module, _, attr = path.rpartition(".")
    try:
        return getattr(importlib.import_module(module), attr, None)
    except ImportError:
        return None


def _message(path: str) -> str:
    return (f"{path} was called while your code was being checked. This exercise asks you to "
            f"build it yourself, so the reference is switched off during the check: write the "
            f"logic with torch.distributed's building blocks instead.")


def _stand_in(path: str, original):
    def refuse(*args, **kwargs):
        raise DelegationError(_message(path))

    if isinstance(original, type):
        # A class, so that `class Mine(Reference)` still unpickles; using it raises.
        return type(original.__name__, (), {"__init__": refuse, "__module__": original.__module__,
                                             "__doc__": "switched off during a check"})
    refuse.__name__ = getattr(original, "__name__", "refuse")
    return refuse


class Guard:
    """The switched-off state inside :func:`forbid`; the check's own reference run may lift it."""

    def __init__(self):
        self.saved: list[tuple[object, str, object]] = []
        self.ddp_original = None
        self.ddp_refuse = None

    @contextlib.contextmanager
    def reference_allowed(self):
        """Let the check itself construct torch DDP (its reference run) inside this block."""
        if self.ddp_original is None:
            yield
            return
        from torch.nn.parallel import DistributedDataParallel as DDP

        DDP.__init__ = self.ddp_original
        try:
            yield
        finally:
            DDP.__init__ = self.ddp_refuse


def _refuse_ddp(self, *args, **kwargs):
    raise DelegationError(
        f"{TORCH_DDP} was constructed while your code was being checked. The check compares "
        "your implementation with torch DDP, so wrapping it cannot pass: average the gradients "
        "yourself.")


@contextlib.contextmanager
def forbid(paths: tuple[str, ...], forbid_torch_ddp: bool = True):
    """Switch off the objects at ``paths`` (and torch DDP) everywhere in ``dpcourse``, then restore.

    Args:
        paths: dotted paths of the reference objects to switch off.
        forbid_torch_ddp: also make ``DistributedDataParallel(...)`` raise.

    Yields:
        A :class:`Guard` (use ``guard.reference_allowed()`` for the check's own torch DDP run).
    """
    guard = Guard()
    try:
        for path in paths:
            original = resolve(path)
            if original is None:
                continue
            stand_in = _stand_in(path, original)
            for name, module in list(sys.modules.items()):
                if module is None or not (name == "dpcourse" or name.startswith("dpcourse.")):
                    continue
                if name.startswith("dpcourse.grading"):
                    continue
                for attr, value in list(vars(module).items()):
                    if value is original:
                        guard.saved.append((module, attr, value))
                        setattr(module, attr, stand_in)
        if forbid_torch_ddp:
            from torch.nn.parallel import DistributedDataParallel as DDP

            guard.ddp_original, guard.ddp_refuse = DDP.__init__, _refuse_ddp
            guard.saved.append((DDP, "__init__", DDP.__init__))
            DDP.__init__ = _refuse_ddp
        yield guard
    finally:
        for owner, attr, value in reversed(guard.saved):
            setattr(owner, attr, value)


def _code_names(code: types.CodeType) -> set[str]:
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _code_names(const)
    return names


def static_references(obj, paths: tuple[str, ...], forbid_torch_ddp: bool = True) -> list[str]:
    """Return the forbidden objects that ``obj``'s code refers to by name.

    Follows functions and classes defined in the same module as ``obj`` (a
    notebook's ``__main__``), through their globals and closures.

    Args:
        obj: the learner's function or class (or a dict/list of them).
        paths: dotted paths of forbidden objects.
        forbid_torch_ddp: also report references to torch DDP.

    Returns:
        Sorted descriptions such as ``"ring_all_reduce -> dpcourse.comm.ring.ring_all_reduce"``.
    """
    forbidden = {id(o): p for p in paths if (o := resolve(p)) is not None}
    if forbid_torch_ddp and (ddp := resolve(TORCH_DDP)) is not None:
        forbidden[id(ddp)] = TORCH_DDP
    roots = list(obj.values()) if isinstance(obj, dict) else list(obj) \
        if isinstance(obj, (list, tuple)) else [obj]
    home = {getattr(r, "__module__", None) for r in roots}
    found, seen, todo = set(), set(), list(roots)
    while todo:
        item = todo.pop()
        if id(item) in seen:
            continue
        seen.add(id(item))
        if isinstance(item, type):
            for base in item.__bases__:
                if id(base) in forbidden:
                    found.add(f"{item.__name__} subclasses {forbidden[id(base)]}")
            todo.extend(v for v in vars(item).values()
                        if inspect.isfunction(v) or isinstance(v, (staticmethod, classmethod)))
            continue
        if isinstance(item, (staticmethod, classmethod)):
            todo.append(item.__func__)
            continue
        if not inspect.isfunction(item):
            continue
        names = _code_names(item.__code__)
        if forbid_torch_ddp and "DistributedDataParallel" in names:
            found.add(f"{item.__name__} uses DistributedDataParallel")
        scope = dict(vars(builtins))
        scope.update(item.__globals__)
        values = [scope[n] for n in names if n in scope]
        values += [c.cell_contents for c in (item.__closure__ or ())
                   if _cell_has_value(c)]
        for value in values:
            if id(value) in forbidden:
                found.add(f"{item.__name__} refers to {forbidden[id(value)]}")
            elif getattr(value, "__module__", None) in home and (
                    inspect.isfunction(value) or isinstance(value, type)):
                todo.append(value)
    return sorted(found)


def _cell_has_value(cell) -> bool:
    try:
        cell.cell_contents
    except ValueError:
        return False
    return True
