"""The processes of one launch: start the ranks, watch them, collect results, stop them.

Used by :func:`dpcourse.run`; the other half of the protocol is
:mod:`dpcourse.launch.worker` (files in a private work directory,
:mod:`dpcourse.launch.workdir`; ``exit`` on stdin; stacks on SIGUSR1).
"""

from __future__ import annotations

import os
import pickle
import shutil
import signal
import subprocess
import sys
import time

from dpcourse.launch import guard
from dpcourse.launch.env import worker_env
from dpcourse.launch.errors import RankDiedError, RankError, RankTimeoutError
from dpcourse.launch.relay import OutputRelay
from dpcourse.launch.workdir import LaunchSpec, make_workdir

# How long a rank that returned may take to destroy its process group and exit.
SHUTDOWN_GRACE = 30.0
# Starting a rank (a fresh interpreter importing torch, then joining the group)
# takes seconds, many more on a busy machine: it is not counted in `timeout`.
STARTUP_TIMEOUT = 120.0


def start_rank(argv: list[str], env: dict, cwd: str, **popen) -> subprocess.Popen:
    """Start one rank process, ``argv``, in a session of its own; return its ``Popen``.

    Own session: a terminal Ctrl-C or Jupyter's interrupt (sent to our process group)
    reaches only us, and we stop the ranks ourselves; killing the rank's process group
    (:func:`dpcourse.launch.guard.stop_groups`, :func:`dpcourse.launch.reaper.kill_tree`)
    then also takes any process the rank started.

    Args:
        argv: the command (the grader puts its sandbox in front of the rank's own).
        env, cwd: the rank's environment (:func:`dpcourse.launch.env.worker_env`) and folder.
        **popen: further ``subprocess.Popen`` arguments: the rank's stdin, stdout, stderr,
            ``pass_fds``.
    """
    return subprocess.Popen(argv, env=env, cwd=cwd, start_new_session=True, **popen)


class Guard:
    """The launching side of a guard process (:mod:`dpcourse.launch.guard`) for ``workdir``.

    Started before the ranks and outside their groups, so it outlives us: told each
    rank's pid (:meth:`watch`), it stops their groups and removes ``workdir`` should we be
    killed before :meth:`done`.
    """

    def __init__(self, workdir: str):
        self.proc = subprocess.Popen(
            [sys.executable, "-I", "-S", guard.__file__, workdir],
            stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, start_new_session=True)

    def _tell(self, line: str) -> None:
        try:
            self.proc.stdin.write(line.encode())
            self.proc.stdin.flush()
        except (OSError, ValueError):  # the guard is gone (or told): the caller stops the ranks
            pass

    def watch(self, pid: int) -> None:
        """Have the guard stop ``pid``'s process group should we die first."""
        self._tell(f"{pid}\n")

    def done(self) -> None:
        """We stopped the ranks ourselves: let the guard exit quietly, and collect it."""
        self._tell("done\n")
        self.proc.stdin.close()
        self.proc.wait()


class Launch:
    """One launch: processes, output relay, result collection, cleanup."""

    def __init__(self, spec: LaunchSpec, timeout: float, prefix_output: bool):
        self.spec, self.timeout = spec, timeout
        self.world_size = spec.world_size
        self.workdir = make_workdir()
        self.procs: list[subprocess.Popen] = []
        self.guard: Guard | None = None
        self.results: dict[int, dict] = {}
        self.relay = OutputRelay(prefix_output)
        self.stopped = False

    def path(self, rank: int, kind: str) -> str:
        return os.path.join(self.workdir, f"rank{rank}.{kind}")

    def start(self) -> None:
        with open(os.path.join(self.workdir, "payload.pkl"), "wb") as f:
            pickle.dump(self.spec, f)
        env = worker_env(hide_gpus=self.spec.hide_gpus)
        self.guard = Guard(self.workdir)
        for rank in range(self.world_size):
            proc = start_rank(
                [sys.executable, "-m", "dpcourse.launch.worker", self.workdir, str(rank),
                 str(os.getpid())], env, os.getcwd(),
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
            self.procs.append(proc)
            self.relay.attach(rank, proc.stdout, proc.stderr)
            self.guard.watch(proc.pid)

    def _load_result(self, rank: int) -> dict | None:
        if rank not in self.results and os.path.exists(self.path(rank, "result")):
            try:
                with open(self.path(rank, "result"), "rb") as f:
                    self.results[rank] = pickle.load(f)
            except Exception as exc:  # noqa: BLE001 - e.g. a class only the worker can import
                self.results[rank] = {
                    "ok": False, "time": time.time(), "phase": "result", "type": type(exc).__name__,
                    "message": f"the result of rank {rank} cannot be loaded in the launching "
                    f"process ({exc}). Return tensors, numbers, strings, lists or dicts of them.",
                    "traceback": ""}
        return self.results.get(rank)

    def _scan(self) -> tuple[list, list]:
        """Return (errors, deaths): ranks that raised, and ranks whose process ended early."""
        errors, died = [], []
        for rank, proc in enumerate(self.procs):
            res = self._load_result(rank)
            if res is not None and not res["ok"]:
                errors.append((res["time"], rank, res))
            elif proc.poll() is not None:  # a rank only exits when told to
                died.append((rank, res is not None))
        return errors, died

    def failure(self) -> BaseException | None:
        """The error to report if some rank failed: the cause, not the echo on its peers."""
        errors, died = self._scan()
        if not errors and not died:
            return None
        if not died:
            # A rank that died makes its peers raise ("connection closed") before we
            # may see it exit: give a death a moment to show, it is the cause.
            time.sleep(0.3)
            errors, died = self._scan()
        if died:
            rank, returned = died[0]
            return RankDiedError(rank, self.procs[rank].returncode,
                                 self.relay.stderr_tail(rank), returned=returned)
        _, rank, res = min(errors, key=lambda e: e[:2])
        return RankError(rank, res["type"], res["message"], res["traceback"],
                         phase=res.get("phase", "run"),
                         also=sorted(r for _, r, _ in errors if r != rank))

    def dump_stacks(self, ranks: list[int]) -> dict[int, str]:
        """Ask ranks for their Python stacks (faulthandler on SIGUSR1) and read them."""
        for rank in ranks:
            try:
                self.procs[rank].send_signal(signal.SIGUSR1)
            except ProcessLookupError:
                pass
        stacks: dict[int, str] = {}
        end = time.monotonic() + 2.0
        while time.monotonic() < end:
            time.sleep(0.1)
            previous, stacks = stacks, {}
            for rank in ranks:
                try:
                    with open(self.path(rank, "stack")) as f:
                        stacks[rank] = f.read()
                except FileNotFoundError:  # the rank had not even started its main()
                    stacks[rank] = ""
            # faulthandler writes a dump in one go from the signal handler: once
            # every file is non-empty and unchanged for a poll, the dumps are complete.
            if stacks == previous and all(stacks.values()):
                break
        return stacks

    def release(self) -> None:
        """Tell every rank to exit (all returned) and check that each one exits cleanly."""
        for proc in self.procs:
            try:
                proc.stdin.write(b"exit\n")
                proc.stdin.flush()
            except OSError:  # it died meanwhile: its exit status is reported below
                pass
        deadline = time.monotonic() + SHUTDOWN_GRACE
        while any(p.poll() is None for p in self.procs) and time.monotonic() < deadline:
            self.relay.show()
            time.sleep(0.01)
        for rank, proc in enumerate(self.procs):
            if proc.poll() is None:
                stuck = [r for r, p in enumerate(self.procs) if p.poll() is None]
                raise RankTimeoutError(stuck, [r for r in range(self.world_size) if r not in stuck],
                                       SHUTDOWN_GRACE, self.dump_stacks(stuck),
                                       during="destroying the process group after returning")
            if proc.returncode != 0:
                raise RankDiedError(rank, proc.returncode, self.relay.stderr_tail(rank),
                                    returned=True)

    def joined(self) -> bool:
        return all(os.path.exists(self.path(r, "joined")) for r in range(self.world_size))

    def wait(self) -> list:
        start = time.monotonic()
        deadline, during = start + max(self.timeout, STARTUP_TIMEOUT), "starting up"
        while True:
            self.relay.show()
            err = self.failure()
            if err is not None:
                raise err
            if len(self.results) == self.world_size:
                break
            if during and self.joined():
                deadline, during = time.monotonic() + self.timeout, None
            if time.monotonic() > deadline:
                waiting = [r for r in range(self.world_size) if r not in self.results]
                limit = self.timeout if during is None else deadline - start
                raise RankTimeoutError(
                    waiting, sorted(self.results), limit, self.dump_stacks(waiting),
                    during=during and "starting up (importing modules, joining the process group)")
            time.sleep(0.02)
        self.release()
        return [self.results[r]["value"] for r in range(self.world_size)]

    def _stop_once(self) -> None:
        # Each rank's process group: the rank and anything it started, even if the
        # rank itself is already gone (e.g. data-loading processes).
        for proc in self.procs:
            proc.kill()  # a rank may be stuck in C code (no-op for one already collected)
        for proc in self.procs:
            proc.wait()
        guard.stop_groups([proc.pid for proc in self.procs])
        for proc in self.procs:
            if not proc.stdin.closed:
                try:
                    proc.stdin.close()
                except OSError:  # broken pipe: the rank is gone anyway
                    pass
        if self.guard is not None:
            self.guard.done()
        self.relay.close()
        self.relay.show()  # what the ranks printed before they stopped
        shutil.rmtree(self.workdir, ignore_errors=True)
        self.stopped = True

    def stop(self) -> None:
        """Kill every rank (and anything it started) and release all resources.

        Cleanup must finish even if Ctrl-C is pressed again meanwhile; the
        interrupt is re-raised once nothing is left behind.
        """
        interrupted = None
        while not self.stopped:
            try:
                self._stop_once()
            except KeyboardInterrupt as exc:
                interrupted = exc
        if interrupted is not None:
            raise interrupted
