"""A graded rank's connection to the grader, and the handles of its asynchronous operations.

Every request a rank makes (a send, a receive, a collective) is one message to
the grader over :class:`Link`; the grader's reply, matched by id, completes the
:class:`Work` that ``isend``/``irecv``/``async_op=True`` return.
"""

from __future__ import annotations

import torch

from dpcourse.grading import wire


class Link:
    """This rank's connection to the grader: sends requests, collects replies by id."""

    def __init__(self, sock):
        self.sock, self.replies, self.next_id = sock, {}, 0
        self.rank, self.world_size = 0, 1

    def send(self, header: dict, tensors=()) -> None:
        self.sock.sendall(wire.encode(header, tensors))

    def new_id(self) -> int:
        self.next_id += 1
        return self.next_id

    def wait_for(self, ident: int):
        while ident not in self.replies:
            header, tensors = wire.recv_blocking(self.sock)
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
        """Wait, then return a completed future whose value is the list of result tensors.

        As ``work.get_future()`` of torch's collectives, which communication hooks chain
        with ``.then(...)``; here the operation is finished before the future is returned.
        """
        self.wait()
        fut = torch.futures.Future()
        fut.set_result(self.tensors)
        return fut
