"""The messages between a graded rank and the grader: a JSON header plus raw tensor bytes.

Nothing is unpickled on the grader's side: what a rank sends is data, never objects or
code. A rank's every request is one message over :class:`Link`; the grader's reply,
matched by id, completes the :class:`Work` that ``isend``/``irecv``/``async_op=True`` return.
"""

from __future__ import annotations

import json
import struct

import torch

_LENGTHS = struct.Struct("!II")  # header length, payload length
MAX_HEADER = 1 << 20
MAX_PAYLOAD = 1 << 28


class ProtocolError(RuntimeError):
    """A peer sent something that is not a well-formed message."""


def pack(obj):
    """Split ``obj`` (nested dicts/lists of JSON values and tensors) into JSON and tensors."""
    tensors: list[torch.Tensor] = []

    def walk(x):
        if isinstance(x, torch.Tensor):
            tensors.append(x.detach().cpu().contiguous())
            return {"__tensor__": len(tensors) - 1}
        if isinstance(x, dict):
            return {str(k): walk(v) for k, v in x.items()}
        if isinstance(x, (list, tuple)):
            return [walk(v) for v in x]
        if x is None or isinstance(x, (bool, int, float, str)):
            return x
        return {"__repr__": type(x).__name__}
    return walk(obj), tensors


def unpack(obj, tensors):
    """Inverse of :func:`pack`: put the tensors back in place of their markers."""
    if isinstance(obj, dict):
        if set(obj) == {"__tensor__"}:
            i = obj["__tensor__"]
            if not isinstance(i, int) or not 0 <= i < len(tensors):
                raise ProtocolError("tensor index out of range")
            return tensors[i]
        return {k: unpack(v, tensors) for k, v in obj.items()}
    if isinstance(obj, list):
        return [unpack(v, tensors) for v in obj]
    return obj


def encode(header: dict, tensors=()) -> bytes:
    """Return one message: ``header`` (JSON-ready dict) and ``tensors`` (raw bytes)."""
    metas, chunks = [], []
    for t in tensors:
        t = t.detach().cpu().contiguous()
        raw = t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
        metas.append({"dtype": str(t.dtype).replace("torch.", ""), "shape": list(t.shape),
                      "nbytes": len(raw)})
        chunks.append(raw)
    head = json.dumps(dict(header, tensors=metas)).encode()
    payload = b"".join(chunks)
    return _LENGTHS.pack(len(head), len(payload)) + head + payload


def decode(head: bytes, payload: bytes) -> tuple[dict, list[torch.Tensor]]:
    try:
        header = json.loads(head)
    except ValueError as exc:
        raise ProtocolError(f"header is not JSON: {exc}") from None
    if not isinstance(header, dict):
        raise ProtocolError("header is not an object")
    tensors, offset = [], 0
    for meta in header.get("tensors") or []:
        n = int(meta["nbytes"])
        if n < 0 or offset + n > len(payload):
            raise ProtocolError("payload shorter than announced")
        dtype, shape = getattr(torch, str(meta["dtype"]), None), [int(s) for s in meta["shape"]]
        if not isinstance(dtype, torch.dtype):
            raise ProtocolError(f"unknown dtype {meta['dtype']!r}")
        if n:
            t = torch.frombuffer(bytearray(payload[offset:offset + n]), dtype=dtype).reshape(shape)
        else:
            t = torch.empty(shape, dtype=dtype)
        tensors.append(t)
        offset += n
    return header, tensors


class Reader:
    """Incremental parser for a non-blocking socket: feed bytes, take complete messages."""

    def __init__(self):
        self.buffer = bytearray()

    def feed(self, data: bytes) -> list[tuple[dict, list[torch.Tensor]]]:
        self.buffer += data
        out = []
        while len(self.buffer) >= _LENGTHS.size:
            hlen, plen = _LENGTHS.unpack_from(self.buffer)
            if hlen > MAX_HEADER or plen > MAX_PAYLOAD:
                raise ProtocolError(f"message too large ({hlen} + {plen} bytes)")
            end = _LENGTHS.size + hlen + plen
            if len(self.buffer) < end:
                break
            head = bytes(self.buffer[_LENGTHS.size:_LENGTHS.size + hlen])
            payload = bytes(self.buffer[_LENGTHS.size + hlen:end])
            del self.buffer[:end]
            out.append(decode(head, payload))
        return out


def recv_blocking(sock) -> tuple[dict, list[torch.Tensor]]:
    """Read exactly one message from a blocking socket (the rank's side)."""
    def exact(n):
        data = bytearray()
        while len(data) < n:
            chunk = sock.recv(n - len(data))
            if not chunk:
                raise EOFError("the grader closed the connection")
            data += chunk
        return bytes(data)

    hlen, plen = _LENGTHS.unpack(exact(_LENGTHS.size))
    return decode(exact(hlen), exact(plen))


class Link:
    """This rank's connection to the grader: sends requests, collects replies by id."""

    def __init__(self, sock):
        self.sock, self.replies, self.next_id = sock, {}, 0
        self.rank, self.world_size = 0, 1

    def send(self, header: dict, tensors=()) -> None:
        self.sock.sendall(encode(header, tensors))

    def new_id(self) -> int:
        self.next_id += 1
        return self.next_id

    def wait_for(self, ident: int):
        while ident not in self.replies:
            header, tensors = recv_blocking(self.sock)
            if header.get("t") != "done":
                raise RuntimeError(f"unexpected message from the grader: {header.get('t')}")
            self.replies[header["id"]] = (header, tensors)
        return self.replies.pop(ident)

    def mark(self, label: str) -> None:
        """Put a labelled point on the grader's record of this rank's messages."""
        self.send({"t": "mark", "label": label})


class Work:
    """The handle of an asynchronous operation (``work.wait()``, ``work.is_completed()``)."""

    def __init__(self, link: Link, ident: int | None, on_reply=None, what: str = "",
                 tensors: tuple = ()):
        self.link, self.ident, self.on_reply, self.what = link, ident, on_reply, what
        self.done, self.tensors = ident is None, list(tensors)

    def wait(self, timeout=None) -> bool:
        if not self.done:
            self.link.send({"t": "wait", "id": self.ident, "what": self.what})
            header, tensors = self.link.wait_for(self.ident)
            self.done = True
            if self.on_reply is not None:
                self.on_reply(header, tensors)
        return True

    def is_completed(self) -> bool:
        return self.done

    def get_future(self) -> torch.futures.Future:
        """Wait, then return a completed future of the result tensors (hooks chain ``.then``)."""
        self.wait()
        fut = torch.futures.Future()
        fut.set_result(self.tensors)
        return fut
