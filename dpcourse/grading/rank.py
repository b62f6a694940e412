"""A graded rank, started by :class:`~dpcourse.grading.world.World` with one end of a socket
pair: load the learner's definitions, then run the rounds the grader sends.

In it, ``torch.distributed`` (imported either way) is the grader's
:class:`~dpcourse.grading.shim.DistModule`; the grader's answers and judging code cannot be
imported, no expected value is ever received, and only the learner's outputs are sent back.
"""

from __future__ import annotations

import base64
import builtins
import contextlib
import faulthandler
import importlib.abc
import os
import signal
import socket
import sys
import traceback
import types

import torch

from dpcourse.grading import wire
from dpcourse.grading.shim import DistModule

# Besides these, every check's ``*_verdicts`` module (see ``Exercise.verdicts``).
BLOCKED = ("dpcourse.grading.oracles", "dpcourse.grading.runner", "dpcourse.grading.world",
           "dpcourse.grading.relay", "dpcourse.grading.autograde", "dpcourse.grading.gradebook",
           "dpcourse.grading.executor")


class _Blocker(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name in BLOCKED or name.startswith("dpcourse.grading.") and name.endswith("_verdicts"):
            raise ImportError(f"{name} is the grader's own code and is not available to graded "
                              "code.")
        return None


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
    """Point objects sent by value (cloudpickle) at the grader's ``torch.distributed``; return them.

    Every function reachable from ``objs`` gets ``dist_module`` in place of torch's module
    and ``builtins_table`` as its builtins, so imports inside it resolve the same way.
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
            for cell in item.__closure__ or ():
                with contextlib.suppress(ValueError):  # an empty cell has no contents
                    if isinstance(cell.cell_contents, (types.FunctionType, type)):
                        todo.append(cell.cell_contents)
    return objs


def _learner_traceback(exc: BaseException) -> str:
    """The traceback limited to the learner's frames (cells) and the call that raised."""
    frames = traceback.extract_tb(exc.__traceback__)
    mine = [f for f in frames if f.filename.startswith("<")]
    keep = mine[-4:] or frames[-2:]
    lines = [f'  {f.filename}, line {f.lineno}, in {f.name}\n    {f.line or ""}'.rstrip()
             for f in keep]
    return "\n".join(lines)


def _load_learner(setup: dict, dist: DistModule) -> dict:
    from dpcourse.grading.submission import load

    table = make_builtins(dist)
    if setup.get("pickled"):  # the learner's own check() on objects without source
        import cloudpickle

        return rebind(cloudpickle.loads(base64.b64decode(setup["pickled"])), dist, table)
    return load(setup["cells"], setup["names"], table)


def main(fd: int) -> None:
    sys.meta_path.insert(0, _Blocker())
    faulthandler.register(signal.SIGUSR1, all_threads=False)
    sock = socket.socket(fileno=fd)
    from dpcourse.grading.checks import get_spec  # with the blocker in place

    header, _ = wire.recv_blocking(sock)
    spec = get_spec(header["check"])
    link = wire.Link(sock)
    dist = DistModule(link, spec.dist_api, spec.dist_why)

    def fail(exc: BaseException, during: str) -> None:
        name = type(exc).__name__
        link.send({"t": "error", "exc_type": name, "text": f"{during}: {name}: {exc}",
                   "traceback": _learner_traceback(exc)})

    try:
        learner = _load_learner(header, dist)
        link.send({"t": "ready"})
    except BaseException as exc:  # noqa: BLE001 - the learner's top-level code
        fail(exc, "loading your definitions")
        learner = None
    while True:
        try:
            header, tensors = wire.recv_blocking(sock)
        except (EOFError, OSError):
            break
        if header.get("t") != "round" or learner is None:
            break
        link.rank, link.world_size = int(header["rank"]), int(header["world_size"])
        inputs = wire.unpack(header["inputs"], tensors)
        try:
            outputs = spec.rank_run(link, learner, inputs)
        except BaseException as exc:  # noqa: BLE001 - learner code: report it to the grader
            fail(exc, "your code raised")
            continue
        obj, out_tensors = wire.pack(outputs)
        link.send({"t": "result", "outputs": obj}, out_tensors)
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main(int(sys.argv[1]))
