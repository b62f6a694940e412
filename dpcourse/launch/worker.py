"""Entry point of one rank started by :func:`dpcourse.run` (``python -m dpcourse.launch.worker``).

The worker is a fresh interpreter (never a fork), so CUDA state of the parent
cannot leak in and a function defined in a notebook cell arrives by value
(cloudpickle) instead of by a ``__main__`` reference the child could not import.

Protocol with the launching process (see :mod:`dpcourse.launch.procs`):

* ``WORKDIR/payload.pkl`` holds the call and the launch settings
  (:class:`dpcourse.launch.workdir.LaunchSpec`);
* the rank creates ``WORKDIR/rank{r}.joined`` once it is in the process group
  (the launcher's timeout counts from when every rank has joined);
* the rank writes ``WORKDIR/rank{r}.result`` (atomically) when ``fn`` returned
  or raised, then *waits*: a rank that finished early keeps its process group
  alive, so a peer still inside a collective keeps waiting (a hang the launcher
  can name) instead of failing with an echo such as "connection closed by peer";
* the launcher writes ``exit`` on stdin once every rank has a result; the rank
  then destroys its process group and leaves with ``os._exit``
  (:func:`dpcourse.launch.teardown.destroy_and_exit`);
* EOF on stdin means the launcher died: the rank exits at once (and the launch's
  guard, :mod:`dpcourse.launch.guard`, ends what the rank started);
* the rank reads that pipe through a private descriptor and its own stdin is
  /dev/null, so processes it forks (DataLoader workers) start cleanly;
* on SIGUSR1 the rank writes every thread's Python stack to ``WORKDIR/rank{r}.stack``.

Only the standard library is imported at module level: torch is the one heavy
import a rank needs, and it is loaded when the process group is created.
"""

from __future__ import annotations

import faulthandler
import os
import signal
import sys
import threading
import time
import traceback

from dpcourse.launch.teardown import destroy_and_exit

EXIT_PARENT_DIED = 3


def _watch_parent(parent_pid: int) -> threading.Event:
    """Exit when the launcher goes away; return the event set when it says ``exit``.

    The launcher holds the write end of our stdin: EOF means it died (kernel
    restart, ``kill -9``), and a rank must never outlive it as an orphan. On
    Linux the kernel also sends SIGKILL when the parent dies, which works even
    while this interpreter is stuck in C code holding the GIL.
    """
    if sys.platform.startswith("linux"):
        try:
            import ctypes

            ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        except Exception:  # noqa: BLE001, S110 - the stdin watch below still works
            pass
    if os.getppid() != parent_pid:  # died before the line above took effect
        os._exit(EXIT_PARENT_DIED)
    # Read the launcher's pipe through a private descriptor, never through sys.stdin:
    # a thread blocked in sys.stdin.buffer holds that object's lock, and a process the
    # learner forks (a DataLoader worker) inherits the lock held by a thread it does
    # not have, then deadlocks when multiprocessing closes sys.stdin in the child.
    # The rank's own stdin becomes /dev/null, as for any background process.
    pipe = os.dup(0)  # not inherited across exec (PEP 446)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    release = threading.Event()

    def watch() -> None:
        pending = b""
        try:
            while True:
                chunk = os.read(pipe, 4096)
                if not chunk:
                    break
                pending += chunk
                if b"exit\n" in pending:
                    release.set()
        except Exception:  # noqa: BLE001, S110 - a failed read means the parent is gone
            pass
        os._exit(EXIT_PARENT_DIED)

    threading.Thread(target=watch, name="dpcourse-parent-watch", daemon=True).start()
    return release


def _private_temp_dir(workdir: str, rank: int) -> None:
    """Make multiprocessing keep its files (``pymp-*`` sockets) in the launch's work directory.

    DataLoader workers pass tensors through a socket in multiprocessing's temporary
    directory, removed only when a process exits normally; a rank stopped by the
    launcher (a failure, a timeout, Ctrl-C) and its workers are killed, so that
    directory would stay in /tmp. Inside the work directory it goes with it. Processes
    forked from the rank inherit the setting (``Process._config`` is copied at fork).
    """
    import multiprocessing.process

    path = os.path.join(workdir, f"mp{rank}")
    os.makedirs(path, exist_ok=True)
    multiprocessing.process.current_process()._config["tempdir"] = path


def _write(path: str, payload: dict) -> None:
    import cloudpickle

    data = cloudpickle.dumps(payload)  # fails before anything is written
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(data)
    os.replace(tmp, path)  # the launcher only ever sees a complete file


def _to_cpu(obj):
    """Move tensors in a (nested) result to the CPU so the parent never touches CUDA."""
    torch = sys.modules.get("torch")
    if torch is None:
        return obj
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu()
    if type(obj) in (list, tuple):
        return type(obj)(_to_cpu(x) for x in obj)
    if type(obj) is dict:
        return {k: _to_cpu(v) for k, v in obj.items()}
    return obj


def _init_process_group(spec, rank: int) -> None:
    import datetime

    import torch
    import torch.distributed as dist

    world_size = spec.world_size
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_WORLD_SIZE=str(world_size),
                      MASTER_ADDR=spec.host, MASTER_PORT=str(spec.port))
    kwargs = {}
    if spec.backend == "nccl":
        torch.cuda.set_device(rank)
        kwargs["device_id"] = torch.device("cuda", rank)
    else:
        # Ranks share the CPU cores: without this each one starts a thread per core.
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    store = dist.TCPStore(spec.host, spec.port, world_size=None, is_master=False,
                          timeout=datetime.timedelta(seconds=spec.pg_timeout))
    store = dist.PrefixStore(spec.prefix, store)
    dist.init_process_group(spec.backend, store=store, rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=spec.pg_timeout), **kwargs)


def _failure(exc: BaseException, phase: str) -> dict:
    tb = exc.__traceback__
    if phase == "run" and tb is not None and tb.tb_next is not None:
        tb = tb.tb_next  # start at the learner's function, not at the line calling it
    text = "".join(traceback.format_exception(type(exc), exc, tb))
    return {"ok": False, "time": time.time(), "phase": phase, "type": type(exc).__name__,
            "message": str(exc), "traceback": text}


def _call(workdir: str, rank: int, result_path: str) -> bool:
    """Load the call, join the group, run ``fn`` and write the result; True if it returned."""
    import pickle

    phase = "load"
    try:
        with open(os.path.join(workdir, "payload.pkl"), "rb") as f:
            spec = pickle.load(f)  # a dpcourse.launch.workdir.LaunchSpec
        sys.path[:] = spec.sys_path
        fn, args, kwargs = pickle.loads(spec.call)
        phase = "init"
        _init_process_group(spec, rank)
        open(os.path.join(workdir, f"rank{rank}.joined"), "w").close()
        phase = "run"
        value = _to_cpu(fn(*args, **kwargs))
        phase = "result"
        try:
            _write(result_path, {"ok": True, "value": value})
        except Exception as exc:  # the value itself could not be pickled
            raise TypeError(
                f"the function returned a {type(value).__name__} that cannot be sent back to the "
                f"launching process ({type(exc).__name__}: {exc}). Return tensors, numbers, "
                "strings, lists or dicts of them."
            ) from exc
        return True
    except BaseException as exc:  # noqa: BLE001 - every failure must reach the parent
        _write(result_path, _failure(exc, phase))
        return False


def main(workdir: str, rank: int, parent_pid: int) -> None:
    release = _watch_parent(parent_pid)
    _private_temp_dir(workdir, rank)
    # On SIGUSR1 (sent by the launcher at a timeout) write every thread's stack,
    # so the learner sees which collective each rank was stuck in. faulthandler
    # writes from C, so it works while the main thread is blocked in gloo/NCCL;
    # the file stays open for the life of the process.
    stack_file = open(os.path.join(workdir, f"rank{rank}.stack"), "w")  # noqa: SIM115
    faulthandler.register(signal.SIGUSR1, file=stack_file, all_threads=True)
    # A crash in C code (a segfault in a collective, say) prints the Python stack of
    # every thread on the rank's stderr before the process dies.
    faulthandler.enable(all_threads=True)
    returned = _call(workdir, rank, os.path.join(workdir, f"rank{rank}.result"))
    sys.stdout.flush()
    sys.stderr.flush()
    if not returned:
        # Stay alive (process group intact) until the launcher stops every rank:
        # exiting now would make the peers fail with "connection closed" echoes.
        release.wait()
        os._exit(1)
    release.wait()
    # Every rank is done: a controlled exit (see dpcourse.launch.teardown).
    destroy_and_exit(0)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))
