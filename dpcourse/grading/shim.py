"""The ``torch.distributed`` a graded rank sees: what the exercise allows, carried by the grader.

In a graded rank, ``torch.distributed`` (imported either way, see :mod:`dpcourse.grading.rank`)
is a :class:`DistModule`, and torch's own process group is never initialised: every message
and collective goes through a socket to the grader, which delivers it, reduces it and counts
its bytes. So in the ring exercise there is no collective to call under any name, torch DDP
cannot communicate at all, and a rank's bytes are counted outside the rank.
"""

from __future__ import annotations

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
        self.op, self.tensor, self.group, self.tag = op, tensor, group, tag
        self.peer = peer if peer is not None else group_peer


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


def _tensor_size(t: torch.Tensor) -> str:
    return (f"{t.numel()} {str(t.dtype).replace('torch.', '')} elements "
            f"({t.numel() * t.element_size()} bytes)")


def _check_sharded(fn: str, whole, part, world_size: int, whole_role: str, part_role: str):
    """Refuse a ``whole`` that is not ``world_size`` parts of ``part``'s size and dtype."""
    if whole.numel() != world_size * part.numel() or whole.dtype != part.dtype:
        raise ValueError(
            f"{fn}: the {whole_role} must hold world_size ({world_size}) x the {part_role}, in "
            f"the {part_role}'s dtype: got an {whole_role} of {_tensor_size(whole)} for an "
            f"{part_role} of {_tensor_size(part)}.")


def _reduce_name(op) -> str:
    return op if isinstance(op, str) else str(getattr(op, "name", op)).lower()


class DistModule(types.ModuleType):
    """A stand-in for ``torch.distributed`` over ``link`` exposing only the names in ``allowed``
    (besides queries); ``why``: what to say when code asks for another name."""

    def __init__(self, link: Link, allowed: tuple[str, ...], why: str):
        super().__init__("torch.distributed", "The grader's torch.distributed for this exercise.")
        self._link, self._allowed, self._why = link, set(allowed), why
        self.ReduceOp, self.P2POp, self.Work = ReduceOp, P2POp, Work
        self.group = self.GroupMember = types.SimpleNamespace(WORLD=None)

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
                    f"rank {rank} received {_tensor_size(got)} from rank {src} into a buffer of "
                    f"{_tensor_size(tensor)}: a receive buffer must have the dtype and the number "
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
        self.irecv(tensor, src, group, tag, group_src).wait()
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
        name = _reduce_name(op)
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
        _check_sharded("all_gather_into_tensor", output_tensor, input_tensor,
                       self._link.world_size, "output", "input")
        _check_memory(output_tensor, "all_gather_into_tensor", "output")
        return self._collective("all_gather_into_tensor", input_tensor, async_op,
                                output=output_tensor)

    def reduce_scatter_tensor(self, output, input, op=ReduceOp.SUM, group=None,
                              async_op=False):
        _check_tensor(output, "reduce_scatter_tensor")
        _check_tensor(input, "reduce_scatter_tensor")
        name = _reduce_name(op)
        if name != "sum":
            raise ValueError(f"reduce_scatter_tensor: reduction {op!r} is not supported here; "
                             "use SUM (and divide by the world size yourself)")
        _check_sharded("reduce_scatter_tensor", input, output, self._link.world_size, "input",
                       "output")
        _check_memory(output, "reduce_scatter_tensor", "output")
        return self._collective("reduce_scatter_tensor", input, async_op, output=output,
                                reduce=name)
