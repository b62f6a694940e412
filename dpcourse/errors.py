"""Errors a learner sees when a multi-process run goes wrong.

Each one says which rank(s) were involved and what to do next, because the
default failure modes of multi-process code (a frozen cell, a wall of gloo
logs) teach nothing.
"""

from __future__ import annotations

import signal


class RankError(RuntimeError):
    """A rank raised an exception; carries the rank and its formatted traceback.

    Args:
        rank: the rank whose function raised.
        exc_type: the name of the exception type raised on that rank.
        message: ``str(exception)`` on that rank.
        remote_traceback: the traceback text as printed on that rank.
    """

    def __init__(self, rank: int, exc_type: str, message: str, remote_traceback: str):
        self.rank = rank
        self.exc_type = exc_type
        self.message = message
        self.remote_traceback = remote_traceback
        super().__init__(
            f"rank {rank} raised {exc_type}: {message}\n\n"
            f"--- traceback on rank {rank} ---\n{remote_traceback.rstrip()}\n"
            f"--- end of traceback on rank {rank} (the other ranks were stopped) ---"
        )


class RankTimeoutError(TimeoutError):
    """Some ranks did not finish within the timeout (a hang or a deadlock).

    Args:
        waiting: ranks that had not finished when the timeout expired.
        finished: ranks that had returned.
        timeout: the timeout in seconds.
        stacks: rank -> Python stack dump taken just before the ranks were stopped.
    """

    def __init__(self, waiting: list[int], finished: list[int], timeout: float,
                 stacks: dict[int, str] | None = None):
        self.waiting = list(waiting)
        self.finished = list(finished)
        self.timeout = timeout
        self.stacks = dict(stacks or {})
        ranks = ", ".join(map(str, self.waiting))
        lines = [
            f"timed out after {timeout:g} s: rank(s) {ranks} were still waiting"
            + (f" (rank(s) {', '.join(map(str, self.finished))} had finished)" if self.finished else "")
            + ".",
            "This is what a hang looks like: usually one rank skipped or reordered a collective "
            "(mismatched calls, an extra step, uneven numbers of batches) while the others waited "
            "for it. Every worker has been stopped.",
        ]
        for rank in self.waiting:
            stack = self.stacks.get(rank, "").strip()
            if stack:
                lines.append(f"--- where rank {rank} was waiting ---\n{stack}")
        super().__init__("\n".join(lines))


class RankDiedError(RuntimeError):
    """A rank's process ended without reporting a result (a signal or a hard exit).

    Args:
        rank: the rank whose process ended.
        returncode: the process's exit status (negative: killed by that signal).
        stderr_tail: the last lines the rank wrote to stderr.
    """

    def __init__(self, rank: int, returncode: int, stderr_tail: str = ""):
        self.rank = rank
        self.returncode = returncode
        if returncode < 0:
            try:
                name = signal.Signals(-returncode).name
            except ValueError:
                name = f"signal {-returncode}"
            how = f"was killed by {name} ({-returncode})"
            if -returncode == signal.SIGKILL:
                how += "; this is what an out-of-memory kill looks like (check memory per rank)"
        else:
            how = f"exited with status {returncode} without returning a result"
        msg = f"rank {rank} {how}. The other ranks were stopped."
        if stderr_tail.strip():
            msg += f"\n--- last output of rank {rank} ---\n{stderr_tail.rstrip()}"
        super().__init__(msg)
