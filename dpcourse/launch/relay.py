"""Relay what the ranks print to the caller's stdout/stderr, prefixed with the rank.

One thread per pipe drains it as soon as a rank writes, so a rank that prints a
lot never blocks on a full pipe; the lines are written out by the *calling*
thread (``show``), because Jupyter attributes output to a cell by the thread
that writes it. Lines of one stream of one rank keep their order.
"""

from __future__ import annotations

import collections
import queue
import sys
import threading


def _pump(rank: int, name: str, stream, out: queue.Queue) -> None:
    try:
        for line in iter(stream.readline, b""):
            out.put((rank, name, line.decode(errors="replace")))
    finally:
        stream.close()


class OutputRelay:
    """Collect the output of every rank and write it out on demand.

    Args:
        prefix_output: prefix each line with ``[rank r]``.
        tail: how many stderr lines per rank to keep for error messages.
    """

    def __init__(self, prefix_output: bool = True, tail: int = 40):
        self.prefix_output = prefix_output
        self.lines: queue.Queue = queue.Queue()
        self.threads: dict[int, list[threading.Thread]] = collections.defaultdict(list)
        self.tails: dict[int, collections.deque] = collections.defaultdict(
            lambda: collections.deque(maxlen=tail))

    def attach(self, rank: int, stdout, stderr) -> None:
        """Start draining a rank's stdout and stderr pipes (binary)."""
        for name, stream in (("stdout", stdout), ("stderr", stderr)):
            t = threading.Thread(target=_pump, args=(rank, name, stream, self.lines),
                                 name=f"dpcourse-relay-{rank}-{name}", daemon=True)
            t.start()
            self.threads[rank].append(t)

    def show(self) -> None:
        """Write every line received so far to ``sys.stdout`` / ``sys.stderr``."""
        chunks: dict[str, list[str]] = {"stdout": [], "stderr": []}
        while True:
            try:
                rank, name, line = self.lines.get_nowait()
            except queue.Empty:
                break
            if not line.endswith("\n"):
                line += "\n"  # a last line without newline must not glue to the next rank's
            if name == "stderr":
                self.tails[rank].append(line)
            chunks[name].append(f"[rank {rank}] {line}" if self.prefix_output else line)
        for name, parts in chunks.items():
            if parts:
                stream = sys.stdout if name == "stdout" else sys.stderr
                stream.write("".join(parts))
                stream.flush()

    def stderr_tail(self, rank: int, timeout: float = 1.0) -> str:
        """The last lines a rank that has exited wrote to stderr (e.g. an abort message).

        Waits up to ``timeout`` s for its pipes to be read to the end first.
        """
        for t in self.threads[rank]:
            t.join(timeout=timeout)
        self.show()
        return "".join(self.tails[rank])

    def close(self, timeout: float = 2.0) -> None:
        """Wait for the pumps to reach end of file (the ranks have exited)."""
        for threads in self.threads.values():
            for t in threads:
                t.join(timeout=timeout)
