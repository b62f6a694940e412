"""Read the Python stack dumps of hung ranks: where each one was waiting, in one line.

A rank stuck in C code (a collective, a receive) cannot raise. On a timeout the
launcher sends it SIGUSR1 and ``faulthandler`` writes every thread's stack to a
file (see :mod:`dpcourse.launch.worker`). This module is the one parser of
those dumps: the launcher's timeout message and the grader both use it.
"""

from __future__ import annotations

import linecache
import re

# One frame of a faulthandler dump: '  File "/path/x.py", line 12 in fn'.
_FRAME = re.compile(r'^\s*File "(?P<file>[^"]+)", line (?P<line>\d+) in (?P<func>\S+)')
_LAUNCHER_FILES = ("dpcourse/launch/worker.py", "<frozen runpy>", "runpy.py", "<frozen importlib")
_MAX_FRAMES = 20
# A line that waits on a work handle of an asynchronous collective, e.g. `work.wait()`.
_WAIT_CALL = re.compile(r"\.wait\(\s*\)")
_COLLECTIVES = re.compile(r"\b(all_reduce|reduce_scatter\w*|all_gather\w*|all_to_all\w*|broadcast|"
                          r"reduce|gather|scatter|isend|irecv|barrier)\b")


def _current_thread(dump: str) -> list[str]:
    """The lines of the dump's current thread (the rank's main thread)."""
    lines, current = [], False
    for line in dump.replace("\\", "/").splitlines():
        if line.startswith(("Current thread", "Thread ", "Stack (most recent")):
            current = line.startswith(("Current thread", "Stack (most recent"))
        elif current:
            lines.append(line)
    return lines


def main_thread_frames(dump: str, skip: tuple[str, ...] = ()) -> list[tuple[str, int, str]]:
    """Parse the main thread of a faulthandler dump: ``(file, line, function)``, innermost first.

    Args:
        dump: text written by ``faulthandler.dump_traceback(all_threads=True)``.
        skip: more path fragments whose frames to leave out (e.g. a grader's own files).

    Returns:
        The frames of the thread that was current (the rank's main thread), without
        the launcher's own frames and Python's import machinery.
    """
    frames = []
    for line in _current_thread(dump):
        m = _FRAME.match(line)
        if m and not any(f in m["file"] for f in _LAUNCHER_FILES + skip):
            frames.append((m["file"], int(m["line"]), m["func"]))
    return frames


def describe_wait(dump: str) -> str:
    """Say in one line where a rank was: in a torch.distributed call, in a work handle's wait, or in Python code.

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
    code = linecache.getline(file, line).strip()
    if _WAIT_CALL.search(code):
        # Blocked in C inside Work.wait(): no torch.distributed frame is on the stack.
        named = _COLLECTIVES.search(code)
        what = f"the {named[1]}" if named else "a collective"
        caller = next((f for f in frames[1:] if "/torch/" not in f[0] and "/dpcourse/" not in f[0]),
                      None)
        called = (f", called from {caller[0].rsplit('/', 1)[-1]}:{caller[1]} in {caller[2]}"
                  if caller else "")
        return (f"waiting in `{code.split('#')[0].strip()}` at {file.rsplit('/', 1)[-1]}:{line} "
                f"in {func}, for {what} it started earlier with async_op=True, which has not "
                f"completed (another rank has not issued the matching collective){called}")
    return (f"running Python code at {file.rsplit('/', 1)[-1]}:{line} in {func} (not inside a "
            "torch.distributed call: a loop that does not end, a sleep, or waiting on something "
            f"else){where if user and user != frames[0] else ''}")


def format_frames(frames: list[tuple[str, int, str]], limit: int = _MAX_FRAMES) -> str:
    """Format parsed frames like a traceback, innermost first, at most ``limit`` of them.

    Args:
        frames: ``(file, line, function)`` as returned by :func:`main_thread_frames`.
        limit: how many frames to show; the rest are counted.

    Returns:
        One ``  File "...", line N in fn`` line per frame.
    """
    text = "\n".join(f'  File "{f}", line {n} in {fn}' for f, n, fn in frames[:limit])
    if len(frames) > limit:
        text += f"\n  ... {len(frames) - limit} outer frames not shown"
    return text
