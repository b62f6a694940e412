"""A graded rank (started by :class:`~dpcourse.grading.world.World` with one end of a socket
pair): load the learner's definitions, then run the rounds the grader sends.

It never initialises torch's process group, never receives an expected value, and cannot
import the grader's answers or judging code: it sends back the learner's outputs only.
"""

from __future__ import annotations

import base64
import faulthandler
import importlib.abc
import os
import signal
import socket
import sys
import traceback

# Besides these, every check's ``*_verdicts`` module (see ``Exercise.verdicts``).
BLOCKED = ("dpcourse.grading.oracles", "dpcourse.grading.runner", "dpcourse.grading.world",
           "dpcourse.grading.autograde", "dpcourse.grading.gradebook",
           "dpcourse.grading.executor", "dpcourse.grading.integrity")


class _Blocker(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name in BLOCKED or name.startswith("dpcourse.grading.") and name.endswith("_verdicts"):
            raise ImportError(f"{name} is the grader's own code and is not available to graded "
                              "code.")
        return None


def _learner_traceback(exc: BaseException) -> str:
    """The traceback limited to the learner's frames (cells) and the call that raised."""
    frames = traceback.extract_tb(exc.__traceback__)
    mine = [f for f in frames if f.filename.startswith("<")]
    keep = mine[-4:] or frames[-2:]
    lines = [f'  {f.filename}, line {f.lineno}, in {f.name}\n    {f.line or ""}'.rstrip()
             for f in keep]
    return "\n".join(lines)


def main(fd: int) -> None:
    sys.meta_path.insert(0, _Blocker())
    faulthandler.register(signal.SIGUSR1, all_threads=False)
    sock = socket.socket(fileno=fd)
    sock.settimeout(None)

    from dpcourse.grading import wire
    from dpcourse.grading.checks import get_spec
    from dpcourse.grading.shim import DistModule, make_builtins, rebind
    from dpcourse.grading.submission import load

    header, _ = wire.recv_blocking(sock)
    spec = get_spec(header["check"])
    link = wire.Link(sock)
    dist = DistModule(link, spec.dist_api, spec.dist_why)

    def fail(exc: BaseException, during: str) -> None:
        name = type(exc).__name__
        link.send({"t": "error", "exc_type": name, "text": f"{during}: {name}: {exc}",
                   "traceback": _learner_traceback(exc)})

    try:
        table = make_builtins(dist)
        if header.get("pickled"):  # the learner's own check() on objects without source
            import cloudpickle

            learner = rebind(cloudpickle.loads(base64.b64decode(header["pickled"])), dist, table)
        else:
            learner = load(header["cells"], header["names"], table)
        link.send({"t": "ready"})
    except BaseException as exc:  # noqa: BLE001 - the learner's top-level code
        fail(exc, "loading your definitions")
        learner = None
    while True:
        try:
            header, tensors = wire.recv_blocking(sock)
        except (EOFError, OSError):
            break
        if header.get("t") != "round" or learner is None:
            break
        link.rank, link.world_size = int(header["rank"]), int(header["world_size"])
        inputs = wire.unpack(header["inputs"], tensors)
        try:
            outputs = spec.rank_run(link, learner, inputs)
        except BaseException as exc:  # noqa: BLE001 - learner code: report it to the grader
            fail(exc, "your code raised")
            continue
        obj, out_tensors = wire.pack(outputs)
        link.send({"t": "result", "outputs": obj}, out_tensors)
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main(int(sys.argv[1]))
