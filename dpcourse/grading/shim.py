"""The ``torch.distributed`` a graded rank sees: only what the exercise allows, carried by the grader.

In a graded rank, ``torch.distributed`` (imported either way) is a :class:`DistModule`
(:func:`make_builtins`; objects sent by value are pointed at it by :func:`rebind`), and
torch's own process group is never initialised: every message and collective goes
through a socket to the grader, which delivers it, reduces it and counts its bytes. So
in the ring exercise there is no collective to call under any name, torch DDP cannot
communicate at all, and a rank's bytes are counted outside the rank.
"""

from __future__ import annotations

import builtins
import contextlib
import types

import torch

from dpcourse.grading.wire import Link, Work

P2P = ("send", "recv", "isend", "irecv", "P2POp", "batch_isend_irecv")
COLLECTIVES = ("all_reduce", "broadcast", "barrier")
SHARDED = ("all_gather_into_tensor", "reduce_scatter_tensor")  # FSDP's and ZeRO's halves
SHARDED_WHY = ("Sharding (ZeRO, FSDP) needs only all_gather_into_tensor and reduce_scatter_tensor "
               "(all_reduce, broadcast and barrier also exist here).")


class ReduceOp:
    """The reduction names ``all_reduce`` accepts (as in ``torch.distributed.ReduceOp``)."""

    SUM, PRODUCT, MIN, MAX = "sum", "product", "min", "max"
    AVG = "avg"  # gloo has no AVG either: refused with a message


class P2POp:
    """A point-to-point operation for :func:`batch_isend_irecv` (as ``dist.P2POp``)."""

    def __init__(self, op, tensor, peer=None, group=None, tag=0, group_peer=None):
        self.op, self.tensor, self.peer, self.group, self.tag = op, tensor, peer, group, tag
        if peer is None and group_peer is not None:
            self.peer = group_peer


def _check_tensor(tensor, fn: str):
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{fn} expects a torch.Tensor, got {type(tensor).__name__}")


def _check_memory(tensor, fn: str, role: str) -> None:
    """Refuse a tensor whose storage was freed: touching it would crash the rank."""
    if tensor.numel() == 0:
        return
    last = tensor.storage_offset() + sum((n - 1) * s for n, s in zip(tensor.shape, tensor.stride()))
    if tensor.untyped_storage().nbytes() < (last + 1) * tensor.element_size():
        raise RuntimeError(
            f"{fn}: the {role} tensor has no memory (its storage was freed, e.g. with "
            "untyped_storage().resize_(0)): give it its memory back before a collective reads "
            "or writes it, and free it only after the collective has finished (after wait()).")


def _describe(t: torch.Tensor) -> str:
    return (f"{t.numel()} {str(t.dtype).replace('torch.', '')} elements "
            f"({t.numel() * t.element_size()} bytes)")


class DistModule(types.ModuleType):
    """A stand-in for ``torch.distributed`` over ``link`` exposing only the names in ``allowed``
    (besides queries); ``why``: what to say when code asks for another name."""

    def __init__(self, link: Link, allowed: tuple[str, ...], why: str):
        super().__init__("torch.distributed", "The grader's torch.distributed for this exercise.")
        self._link, self._allowed, self._why = link, set(allowed), why
        self.ReduceOp, self.P2POp, self.Work = ReduceOp, P2POp, Work
        self.group = types.SimpleNamespace(WORLD=None)
        self.GroupMember = self.group

    def __getattr__(self, name):
        # Reached only for names not set on the module: say what exists instead.
        if name.startswith("__"):
            raise AttributeError(name)
        raise AttributeError(f"torch.distributed.{name} is not available to graded code in this "
                             f"exercise. {self._why}")

    def __getattribute__(self, name):
        allowed = types.ModuleType.__getattribute__(self, "_allowed")
        if name in P2P + COLLECTIVES + SHARDED and name not in allowed:
            return types.ModuleType.__getattribute__(self, "__getattr__")(name)
        return types.ModuleType.__getattribute__(self, name)

    # -- queries ------------------------------------------------------------
    def is_available(self) -> bool:
        return True

    is_initialized = is_available

    def get_rank(self, group=None) -> int:
        return self._link.rank

    def get_world_size(self, group=None) -> int:
        return self._link.world_size

    def get_backend(self, group=None) -> str:
        return "gloo"  # the ranks are CPU processes, as with gloo

    def get_global_rank(self, group, group_rank: int) -> int:
        return group_rank

    def get_group_rank(self, group, global_rank: int) -> int:
        return global_rank

    # -- point to point -----------------------------------------------------
    def _peer(self, peer, fn: str) -> int:
        if not isinstance(peer, int) or isinstance(peer, bool):
            raise TypeError(f"{fn}: the peer rank must be an int, got {peer!r}")
        if not 0 <= peer < self._link.world_size:
            raise ValueError(f"{fn}: rank {peer} does not exist (world size "
                             f"{self._link.world_size})")
        if peer == self._link.rank:
            raise ValueError(f"{fn}: rank {peer} cannot send to or receive from itself")
        return peer

    def isend(self, tensor, dst=None, group=None, tag=0, group_dst=None):
        _check_tensor(tensor, "isend")
        dst = self._peer(dst if dst is not None else group_dst, "isend")
        self._link.send({"t": "send", "dst": dst, "tag": int(tag)}, [tensor])
        return Work(self._link, None)

    def irecv(self, tensor, src=None, group=None, tag=0, group_src=None):
        _check_tensor(tensor, "irecv")
        src = self._peer(src if src is not None else group_src, "irecv")
        ident, rank = self._link.new_id(), self._link.rank

        def deliver(header, tensors):
            got = tensors[0]
            if got.dtype != tensor.dtype or got.numel() != tensor.numel():
                raise RuntimeError(
                    f"rank {rank} received {_describe(got)} from rank {src} into a buffer of "
                    f"{_describe(tensor)}: a receive buffer must have the dtype and the number "
                    "of elements of what the peer sends (e.g. torch.empty_like(the chunk)).")
            with torch.no_grad():
                tensor.view(-1).copy_(got.reshape(-1)) if tensor.is_contiguous() else \
                    tensor.copy_(got.reshape(tensor.shape))
        self._link.send({"t": "recv", "src": src, "tag": int(tag), "id": ident})
        return Work(self._link, ident, deliver, f"recv from rank {src}")

    def send(self, tensor, dst=None, group=None, tag=0, group_dst=None) -> None:
        self.isend(tensor, dst, group, tag, group_dst).wait()

    def recv(self, tensor, src=None, group=None, tag=0, group_src=None) -> int:
        if src is None and group_src is None:
            raise ValueError("recv: give src (receiving from any rank is not supported here)")
        work = self.irecv(tensor, src, group, tag, group_src)
        work.wait()
        return src if src is not None else group_src

    def batch_isend_irecv(self, p2p_op_list):
        if not isinstance(p2p_op_list, (list, tuple)) or not p2p_op_list:
            raise ValueError("batch_isend_irecv expects a non-empty list of P2POp")
        works = []
        for op in p2p_op_list:
            if not isinstance(op, P2POp):
                raise TypeError("batch_isend_irecv expects P2POp objects")
            fn = getattr(op.op, "__name__", "")
            if fn not in ("isend", "irecv"):
                raise ValueError("P2POp's op must be dist.isend or dist.irecv")
            works.append(getattr(self, fn)(op.tensor, op.peer, op.group, op.tag))
        return works

    # -- collectives (exercises that allow them) -------------------------------
    def _collective(self, op: str, tensor, async_op: bool, output=None, **extra):
        ident = self._link.new_id()
        output = tensor if output is None else output
        if tensor is not None:
            _check_memory(tensor, op, "input")
        self._link.send(dict({"t": "coll", "op": op, "id": ident, "async": bool(async_op)},
                             **extra), [tensor] if tensor is not None else [])

        def deliver(header, tensors):
            if tensors and output is not None:
                _check_memory(output, op, "output")  # it may have been freed before wait()
                with torch.no_grad():
                    output.copy_(tensors[0].reshape(output.shape))
        work = Work(self._link, ident, deliver, op, () if output is None else (output,))
        if async_op:
            return work
        work.wait()
        return None

    def all_reduce(self, tensor, op=ReduceOp.SUM, group=None, async_op=False):
        _check_tensor(tensor, "all_reduce")
        name = op if isinstance(op, str) else str(getattr(op, "name", op)).lower()
        if name not in ("sum", "product", "min", "max"):
            raise ValueError(f"all_reduce: reduction {op!r} is not supported by gloo; use SUM "
                             "and divide by the world size")
        return self._collective("all_reduce", tensor, async_op, reduce=name)

    def broadcast(self, tensor, src=0, group=None, async_op=False):
        _check_tensor(tensor, "broadcast")
        if not isinstance(src, int) or not 0 <= src < self._link.world_size:
            raise ValueError(f"broadcast: src {src!r} is not a rank")
        return self._collective("broadcast", tensor, async_op, src=src)

    def barrier(self, group=None, async_op=False, device_ids=None):
        return self._collective("barrier", None, async_op)

    def all_gather_into_tensor(self, output_tensor, input_tensor, group=None, async_op=False):
        _check_tensor(output_tensor, "all_gather_into_tensor")
        _check_tensor(input_tensor, "all_gather_into_tensor")
        n = self._link.world_size
        if output_tensor.numel() != n * input_tensor.numel() or \
                output_tensor.dtype != input_tensor.dtype:
            raise ValueError(
                f"all_gather_into_tensor: the output must hold world_size ({n}) x the input, in "
                f"the input's dtype: got an output of {_describe(output_tensor)} for an input "
                f"of {_describe(input_tensor)}.")
        _check_memory(output_tensor, "all_gather_into_tensor", "output")
        return self._collective("all_gather_into_tensor", input_tensor, async_op,
                                output=output_tensor)

    def reduce_scatter_tensor(self, output, input, op=ReduceOp.SUM, group=None,
                              async_op=False):
        _check_tensor(output, "reduce_scatter_tensor")
        _check_tensor(input, "reduce_scatter_tensor")
        name = op if isinstance(op, str) else str(getattr(op, "name", op)).lower()
        if name != "sum":
            raise ValueError(f"reduce_scatter_tensor: reduction {op!r} is not supported here; "
                             "use SUM (and divide by the world size yourself)")
        n = self._link.world_size
        if input.numel() != n * output.numel() or input.dtype != output.dtype:
            raise ValueError(
                f"reduce_scatter_tensor: the input must hold world_size ({n}) x the output, in "
                f"the output's dtype: got an input of {_describe(input)} for an output of "
                f"{_describe(output)}.")
        _check_memory(output, "reduce_scatter_tensor", "output")
        return self._collective("reduce_scatter_tensor", input, async_op, output=output,
                                reduce=name)

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
