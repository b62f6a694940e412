"""Errors a learner sees when a multi-process run goes wrong.

Each one says which rank(s) were involved and what to do next, because the
default failure modes of multi-process code (a frozen cell, a wall of gloo
logs) teach nothing.
"""

from __future__ import annotations

import re
import signal

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


# One frame of a faulthandler dump: '  File "/path/x.py", line 12 in fn'.
_FRAME = re.compile(r'^\s*File "(?P<file>[^"]+)", line (?P<line>\d+) in (?P<func>\S+)')
_LAUNCHER_FILES = ("dpcourse/_worker.py", "<frozen runpy>", "runpy.py", "<frozen importlib")
_MAX_FRAMES = 20


def _current_thread(dump: str) -> list[str]:
    """The lines of the dump's current thread (the rank's main thread)."""
    lines, current = [], False
    for line in dump.replace("\\", "/").splitlines():
        if line.startswith(("Current thread", "Thread ", "Stack (most recent")):
            current = line.startswith(("Current thread", "Stack (most recent"))
        elif current:
            lines.append(line)
    return lines


def main_thread_frames(dump: str) -> list[tuple[str, int, str]]:
    """Parse the main thread of a faulthandler dump: ``(file, line, function)``, innermost first.

    Args:
        dump: text written by ``faulthandler.dump_traceback(all_threads=True)``.

    Returns:
        The frames of the thread that was current (the rank's main thread), without
        the launcher's own frames and Python's import machinery.
    """
    frames = []
    for line in _current_thread(dump):
        m = _FRAME.match(line)
        if m and not any(f in m["file"] for f in _LAUNCHER_FILES):
            frames.append((m["file"], int(m["line"]), m["func"]))
    return frames


def describe_wait(dump: str) -> str:
    """Say in one line where a rank was: inside a torch.distributed call, or in Python code.

    Args:
        dump: the rank's faulthandler dump.

    Returns:
        e.g. ``"in torch.distributed all_reduce, called from train.py:12 in step"``.
    """
    if any(line.endswith(" in _find_and_load") for line in _current_thread(dump)):
        return "still starting up (importing Python modules; a busy machine makes this slow)"
    frames = main_thread_frames(dump)
    if not frames:
        return "still starting up"
    dist_calls = [f for f in frames if "torch/distributed/" in f[0] and f[2] != "wrapper"]
    user = next((f for f in frames if "/torch/" not in f[0] and "dpcourse/comm/trace" not in f[0]),
                None)
    where = f", called from {user[0].rsplit('/', 1)[-1]}:{user[1]} in {user[2]}" if user else ""
    if "torch/distributed/" in frames[0][0] and dist_calls:
        # The outermost torch.distributed frame is the API the user called.
        api = dist_calls[-1][2]
        return f"in torch.distributed {api} (a collective or point-to-point call){where}"
    file, line, func = frames[0]
    return (f"running Python code at {file.rsplit('/', 1)[-1]}:{line} in {func} (not inside a "
            "torch.distributed call: a loop that does not end, a sleep, or waiting on something "
            f"else){where if user and user != frames[0] else ''}")


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
                stack = "\n".join(f'  File "{f}", line {n} in {fn}'
                                   for f, n, fn in frames[:_MAX_FRAMES])
                if len(frames) > _MAX_FRAMES:
                    stack += f"\n  ... {len(frames) - _MAX_FRAMES} outer frames not shown"
                lines.append(f"--- where rank {rank} was waiting (most recent call first) ---\n"
                             f"{stack}")
        super().__init__("\n".join(lines))


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
            try:
                name = signal.Signals(-returncode).name
            except ValueError:
                name = f"signal {-returncode}"
            how = f"was killed by {name} ({-returncode})"
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
