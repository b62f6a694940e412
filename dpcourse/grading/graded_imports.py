"""What graded code's imports resolve to: torch as usual, except the grader's ``torch.distributed``.

A graded rank loads the learner's cells with :func:`make_builtins`'s table, so
``import torch.distributed as dist`` (and ``torch.distributed`` reached through
``import torch``) gives the :class:`~dpcourse.grading.shim.DistModule` of the
exercise. Objects sent by value instead of as source are pointed at it by
:func:`rebind`.
"""

from __future__ import annotations

import builtins
import types

import torch

from dpcourse.grading.shim import DistModule


class TorchView(types.ModuleType):
    """``torch`` as graded code sees it: torch itself, except ``torch.distributed``."""

    def __init__(self, dist_module: DistModule):
        super().__init__("torch", torch.__doc__)
        self.__dict__["distributed"] = dist_module

    def __getattr__(self, name):
        return getattr(torch, name)


def make_builtins(dist_module: DistModule) -> dict:
    """Return builtins whose ``__import__`` gives graded code the grader's ``torch.distributed``."""
    real_import = builtins.__import__
    view = TorchView(dist_module)

    def graded_import(name, globals=None, locals=None, fromlist=(), level=0):
        if level == 0 and name == "torch":
            return view
        if level == 0 and name == "torch.distributed":
            return dist_module if fromlist else view
        if level == 0 and name.startswith("torch.distributed."):
            raise ImportError(f"{name} is not available to graded code: use torch.distributed's "
                              "public functions (import torch.distributed as dist).")
        return real_import(name, globals, locals, fromlist, level)

    table = dict(vars(builtins))
    table["__import__"] = graded_import
    return table


def rebind(objs: dict, dist_module: DistModule, builtins_table: dict) -> dict:
    """Point unpickled learner objects at the grader's ``torch.distributed``, then return them.

    For objects sent by value (cloudpickle) rather than as source: every function
    reachable from ``objs`` gets ``dist_module`` in place of torch's module and
    ``builtins_table`` as its builtins, so imports inside it resolve the same way.
    """
    import torch.distributed as real_dist

    view, seen, todo = TorchView(dist_module), set(), list(objs.values())
    while todo:
        item = todo.pop()
        if id(item) in seen or item is None:
            continue
        seen.add(id(item))
        if isinstance(item, type):
            todo += list(vars(item).values()) + [b for b in item.__bases__
                                                 if b.__module__ == item.__module__]
        elif isinstance(item, (staticmethod, classmethod)):
            todo.append(item.__func__)
        elif isinstance(item, property):
            todo += [item.fget, item.fset]
        elif isinstance(item, types.FunctionType):
            g = item.__globals__
            g["__builtins__"] = builtins_table
            for key, value in list(g.items()):
                if value is real_dist:
                    g[key] = dist_module
                elif value is torch:
                    g[key] = view
                elif isinstance(value, (types.FunctionType, type)) and \
                        getattr(value, "__module__", None) == item.__module__:
                    todo.append(value)
            todo += [c.cell_contents for c in item.__closure__ or ()
                     if _filled(c) and isinstance(c.cell_contents, (types.FunctionType, type))]
    return objs


def _filled(cell) -> bool:
    try:
        cell.cell_contents
    except ValueError:
        return False
    return True
