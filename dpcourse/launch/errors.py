"""Errors a learner sees when a multi-process run goes wrong.

Each one says which rank(s) were involved and what to do next, because the
default failure modes of multi-process code (a frozen cell, a wall of gloo
logs) teach nothing.
"""

from __future__ import annotations

import signal

from dpcourse.launch.stacks import describe_wait, format_frames, main_thread_frames

_PHASE_HINT = {
    "load": "The function could not be loaded in the worker process: define it in the notebook "
            "or at module level of an importable file, and make sure what it uses can be imported.",
    "init": "The process group could not be created on this rank.",
    "result": "",
    "run": "",
}


class RankError(RuntimeError):
    """A rank raised an exception; carries the rank and its formatted traceback.

    Args:
        rank: the rank whose function raised.
        exc_type: the name of the exception type raised on that rank.
        message: ``str(exception)`` on that rank.
        remote_traceback: the traceback text as printed on that rank.
        phase: what the rank was doing: ``"load"`` (unpickling the function),
            ``"init"`` (joining the process group), ``"run"`` (calling it) or
            ``"result"`` (sending the result back).
        also: other ranks that raised too (later); their tracebacks are not shown.
    """

    def __init__(self, rank: int, exc_type: str, message: str, remote_traceback: str,
                 phase: str = "run", also: list[int] | None = None):
        self.rank = rank
        self.exc_type = exc_type
        self.message = message
        self.remote_traceback = remote_traceback
        self.phase = phase
        self.also = list(also or [])
        hint = _PHASE_HINT.get(phase, "")
        text = f"rank {rank} raised {exc_type}: {message}"
        if hint:
            text += f"\n{hint}"
        if self.also:
            others = ", ".join(map(str, self.also))
            text += f"\n(rank(s) {others} raised too; the first error is shown.)"
        if remote_traceback.strip():
            text += (f"\n\n--- traceback on rank {rank} ---\n{remote_traceback.rstrip()}\n"
                     f"--- end of traceback on rank {rank} (the other ranks were stopped) ---")
        else:
            text += "\nThe other ranks were stopped."
        super().__init__(text)


class RankTimeoutError(TimeoutError):
    """Some ranks did not finish within the timeout (a hang or a deadlock).

    Args:
        waiting: ranks that had not finished when the timeout expired.
        finished: ranks that had returned.
        timeout: the timeout in seconds.
        stacks: rank -> Python stack dump (faulthandler) taken just before the ranks were stopped.
        during: what the ranks were doing, if not running the function
            (e.g. ``"destroying the process group after returning"``).
    """

    def __init__(self, waiting: list[int], finished: list[int], timeout: float,
                 stacks: dict[int, str] | None = None, during: str | None = None):
        self.waiting = list(waiting)
        self.finished = list(finished)
        self.timeout = timeout
        self.stacks = dict(stacks or {})
        ranks = ", ".join(map(str, self.waiting))
        head = f"timed out after {timeout:g} s: rank(s) {ranks} were still waiting"
        if during:
            head += f" while {during}"
        if self.finished:
            head += f" (rank(s) {', '.join(map(str, self.finished))} had returned)"
        lines = [head + "."]
        for rank in self.waiting:
            if rank in self.stacks:
                lines.append(f"  rank {rank}: {describe_wait(self.stacks[rank])}")
        lines.append(
            "This is what a hang looks like: usually one rank skipped or reordered a collective "
            "(mismatched calls, an extra step, uneven numbers of batches) while the others waited "
            "for it. Make every rank issue the same collectives in the same order (e.g. give "
            "every rank the same number of batches). If the work is just slow, pass a larger "
            "timeout=. Every worker has been stopped.")
        for rank in self.waiting:
            frames = main_thread_frames(self.stacks.get(rank, ""))
            if frames:
                lines.append(f"--- where rank {rank} was waiting (most recent call first) ---\n"
                             f"{format_frames(frames)}")
        super().__init__("\n".join(lines))


def signal_name(signum: int) -> str:
    """``"SIGKILL"`` for 9: the signal's name, or ``"signal N"`` for one Python has no name for
    (most real-time signals)."""
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


class RankDiedError(RuntimeError):
    """A rank's process ended without reporting a result (a signal or a hard exit).

    Args:
        rank: the rank whose process ended.
        returncode: the process's exit status (negative: killed by that signal).
        stderr_tail: the last lines the rank wrote to stderr.
        returned: the rank had returned its result, and its process then failed
            while shutting down.
    """

    def __init__(self, rank: int, returncode: int, stderr_tail: str = "", returned: bool = False):
        self.rank = rank
        self.returncode = returncode
        self.returned = returned
        if returncode < 0:
            how = f"was killed by {signal_name(-returncode)} ({-returncode})"
            if -returncode == signal.SIGKILL:
                how += "; this is what an out-of-memory kill looks like (check memory per rank)"
        else:
            how = f"exited with status {returncode}"
        if returned:
            msg = (f"rank {rank} returned its result, but then its process {how} while shutting "
                   "down; a run that does not end cleanly is not trusted. The other ranks were "
                   "stopped.")
        elif returncode < 0:
            msg = f"rank {rank} {how}. The other ranks were stopped."
        else:
            msg = (f"rank {rank} {how} before returning a result (os._exit() in the function, "
                   "or a crash in C code). The other ranks were stopped.")
        if stderr_tail.strip():
            msg += f"\n--- last output of rank {rank} ---\n{stderr_tail.rstrip()}"
        super().__init__(msg)
