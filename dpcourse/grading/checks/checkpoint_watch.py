"""Exercise 08's watch on a rank while ``save_checkpoint`` runs: its saves, and its peers.

:class:`WatchedSaves` sees every ``torch.save`` the rank makes, under whatever name the
learner's code reached it (``torch.save``, ``torch.serialization.save``, or a ``save``
imported before the watch began), and on rank 0 stops each file halfway through writing.
:class:`SaveWindow` tells rank 0 when to write on: once every other rank has returned from
``save_checkpoint`` or waits for a message only rank 0 can still send (or ``HOLD_LIMIT`` has
passed). A rank that can return before the file is complete therefore does so, on every run,
and sees half a file.
"""

from __future__ import annotations

import collections
import hashlib
import io
import json
import os
import time

import torch.serialization

HOLD_LIMIT = 20.0   # s: rank 0 writes on after this, should another rank neither return nor wait


def file_state(path: str) -> dict:
    """``{"exists", "size", "digest"}`` of the file at ``path`` now."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError:
        return {"exists": False, "size": 0, "digest": ""}
    return {"exists": True, "size": len(data), "digest": hashlib.sha256(data).hexdigest()}


class _HeldBack:
    """An opener ``torch.save`` writes through into memory; on a clean exit, the file at
    ``path`` gets the bytes from ``watch`` (half, a hold, the rest)."""

    def __init__(self, opener, buffer: io.BytesIO, path: str, watch: WatchedSaves):
        self.opener, self.buffer, self.path, self.watch = opener, buffer, path, watch

    def __enter__(self):
        return self.opener.__enter__()

    def __exit__(self, *exc):
        self.opener.__exit__(*exc)  # the archive's end record goes into the buffer here
        if exc[0] is None:  # a save that raised leaves no file, as one that never began
            self.watch.write_held(self.path, self.buffer.getvalue())


class WatchedSaves:
    """Every ``torch.save`` of this rank while active; on rank 0, files written in two halves.

    ``torch.save`` looks up, at each call, the module globals of ``torch.serialization`` that
    open what it writes: ``_open_zipfile_writer`` (the default format) and ``_open_file_like``
    with a ``"w"`` mode (the legacy format). The watch replaces those two, so a function object
    bound to ``torch.save`` before the watch began goes through it too. Code that puts them
    back only hides its saves from the watch, and a save the watch never saw fails closed
    (``rank_0_writes`` asks for rank 0's halfway write to the path it was given).

    Args:
        hold: on the rank whose files are stopped halfway, what to call once half of a file is
            on disk (it returns the ranks that had returned meanwhile); ``None`` elsewhere,
            where saves go through unchanged and are only counted.

    Attributes:
        calls: what each save wrote to (a path, or the repr of a file-like object).
        writes: ``{"file", "size", "digest", "returned_meanwhile"}`` per file written halfway.
    """

    def __init__(self, hold=None):
        self.hold, self.calls, self.writes = hold, [], []
        self.zip_writer = self.file_like = None

    def __enter__(self):
        ser = torch.serialization
        self.zip_writer, self.file_like = ser._open_zipfile_writer, ser._open_file_like
        ser._open_zipfile_writer, ser._open_file_like = self._zip_writer, self._file_like
        return self

    def __exit__(self, *exc):
        torch.serialization._open_zipfile_writer = self.zip_writer
        torch.serialization._open_file_like = self.file_like

    def _zip_writer(self, target):
        return self._open(target, self.zip_writer)

    def _file_like(self, target, mode: str):
        if "w" not in mode:  # torch.load reads through the same opener
            return self.file_like(target, mode)
        return self._open(target, lambda f: self.file_like(f, mode))

    def _open(self, target, open_writer):
        self.calls.append(os.fspath(target) if isinstance(target, (str, os.PathLike))
                          else repr(target))
        if self.hold is None or not isinstance(target, (str, os.PathLike)):
            return open_writer(target)
        buffer = io.BytesIO()
        return _HeldBack(open_writer(buffer), buffer, os.fspath(target), self)

    def write_held(self, path: str, data: bytes) -> None:
        """Write ``data`` to ``path``: half of it, then :attr:`hold`, then the rest."""
        with open(path, "wb") as file:
            file.write(data[:len(data) // 2])
            file.flush()
            returned = self.hold()
            file.write(data[len(data) // 2:])
        self.writes.append({"file": path, "size": len(data), "returned_meanwhile": returned,
                            "digest": hashlib.sha256(data).hexdigest()})


class SaveWindow:
    """What each rank does while ``save_checkpoint`` runs, seen through its link and a shared
    folder: which operations it waits for, and whether it has returned.

    Each rank publishes its state in ``folder`` (``running``, ``waiting`` on its k-th collective
    or its j-th receive from a rank, or ``returned``); rank 0 counts its own collectives and
    sends, so it can tell when another rank is waiting for a message it has not sent yet.
    """

    def __init__(self, link, folder: str):
        self.link, self.folder, self.rank = link, folder, link.rank
        self.colls, self.sent, self.recvd = 0, collections.Counter(), collections.Counter()
        self.waits: dict = {}  # request id -> what a wait for it waits on

    def _file(self, rank: int) -> str:
        return os.path.join(self.folder, f".rank{rank}.state")

    def publish(self, state: dict) -> None:
        tmp = self._file(self.rank) + ".tmp"
        with open(tmp, "w") as f:
            json.dump(state, f)
        os.replace(tmp, self._file(self.rank))  # whole or not at all, for the reader

    def state_of(self, rank: int) -> dict:
        try:
            with open(self._file(rank)) as f:
                return json.load(f)
        except (OSError, ValueError):
            return {"state": "running"}

    def __enter__(self):
        send, wait_for = self.link.send, self.link.wait_for

        def watched_send(header, tensors=()):
            kind = header.get("t")
            if kind == "coll":
                self.waits[header["id"]] = ["coll", self.colls]
                self.colls += 1
            elif kind == "send":
                self.sent[(int(header["dst"]), int(header.get("tag", 0)))] += 1
            elif kind == "recv":
                key = (int(header["src"]), int(header.get("tag", 0)))
                self.waits[header["id"]] = ["recv", key[0], key[1], self.recvd[key]]
                self.recvd[key] += 1
            return send(header, tensors)

        def watched_wait_for(ident):
            if ident in self.link.replies:
                return wait_for(ident)
            self.publish({"state": "waiting", "on": self.waits.get(ident)})
            try:
                return wait_for(ident)
            finally:
                self.publish({"state": "running"})

        self.link.send, self.link.wait_for = watched_send, watched_wait_for
        self.publish({"state": "running"})
        return self

    def __exit__(self, *exc):
        del self.link.send, self.link.wait_for

    def returned(self) -> None:
        self.publish({"state": "returned"})

    def _held_up(self, rank: int) -> bool:
        """Whether ``rank`` has returned, or waits for what this rank (0) has not sent yet."""
        state = self.state_of(rank)
        on = state.get("on")
        if state["state"] == "returned":
            return True
        if state["state"] != "waiting" or not on:
            return False
        if on[0] == "coll":  # collectives pair up by number: its k-th needs our k-th
            return on[1] >= self.colls
        return on[1] == self.rank and on[3] >= self.sent[(rank, on[2])]

    def hold(self) -> list[int]:
        """Wait (rank 0, mid-write) until every other rank is held up; return those that
        had returned."""
        others = [r for r in range(self.link.world_size) if r != self.rank]
        deadline = time.monotonic() + HOLD_LIMIT
        while not all(self._held_up(r) for r in others) and time.monotonic() < deadline:
            time.sleep(0.002)
        return [r for r in others if self.state_of(r)["state"] == "returned"]
