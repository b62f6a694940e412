"""Run a function on several ranks from a notebook, a script or a test.

``dpcourse.run(fn, *args)`` starts one fresh Python process per rank, joins
them into a process group and returns what each rank's ``fn`` returned. It is
built so that the usual ways multi-process code fails in Jupyter cannot reach
the learner:

* the function travels by value (cloudpickle), so a function defined in a
  notebook cell works, and workers are fresh interpreters (never forked), so
  CUDA initialised in the notebook does not matter;
* rendezvous is a TCP store owned by the launching process, listening on
  loopback only, on a port the operating system picked: nothing outside this
  machine can join, and two launches never collide;
* a rank that raises, dies or hangs stops every rank, and the error names the
  rank and shows its traceback (or, for a hang, where each rank was waiting);
* Ctrl-C / "interrupt kernel" stops every rank, and a worker exits by itself
  when the launching process dies; what the ranks started (DataLoader workers, a
  subprocess) ends with them (:mod:`dpcourse.launch.guard`).
"""

from __future__ import annotations

import math
import os
import socket
import sys

from dpcourse.launch.errors import RankDiedError, RankError, RankTimeoutError
from dpcourse.launch.procs import STARTUP_TIMEOUT, Launch
from dpcourse.launch.workdir import LaunchSpec
from dpcourse.launch.ranks import plan_ranks
from dpcourse.launch.resources import check_resources

DEFAULT_TIMEOUT = 120.0
LOOPBACK = "127.0.0.1"


def _check_timeout(timeout) -> float:
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) \
            or not 0 < timeout < math.inf:
        raise ValueError(
            f"timeout must be a positive number of seconds (finite), got {timeout!r}. It is how "
            "long run() waits before treating the ranks as hung, and a hang must end in a "
            "message: e.g. timeout=60, or timeout=24 * 3600 for a long job.")
    return float(timeout)


def _serialize_call(fn, args, kwargs) -> bytes:
    import cloudpickle

    if not callable(fn):
        raise TypeError(f"run() needs a function to call on every rank, got {type(fn).__name__}.")
    try:
        return cloudpickle.dumps((fn, args, kwargs))
    except Exception as exc:
        raise TypeError(
            f"the function {getattr(fn, '__name__', fn)!r} or its arguments cannot be sent to the "
            f"worker processes ({type(exc).__name__}: {exc}). Pass plain data (tensors, numbers, "
            "strings, lists, dicts) and create open files, locks, generators or process groups "
            "inside the function instead."
        ) from exc


def _loopback_store():
    """Start the rendezvous TCPStore listening on 127.0.0.1 only; return it.

    ``TCPStore(host, 0, is_master=True)`` listens on every interface whatever
    ``host`` says, which would let any machine on the network join (or disrupt)
    a learner's run; so we bind the socket ourselves and hand it over.
    """
    import torch.distributed as dist

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.bind((LOOPBACK, 0))
        sock.listen(128)
        port = sock.getsockname()[1]
    except BaseException:
        sock.close()
        raise
    fd = sock.detach()  # the store owns (and closes) the socket from here on
    try:
        return dist.TCPStore(LOOPBACK, port, is_master=True, wait_for_workers=False,
                             master_listen_fd=fd)
    except BaseException:
        os.close(fd)
        raise


def run(fn, *args, world_size: int | None = None, backend: str = "auto", device: str = "auto",
        timeout: float = DEFAULT_TIMEOUT, prefix_output: bool = True, **kwargs) -> list:
    """Run ``fn(*args, **kwargs)`` on every rank of a fresh process group; return per-rank results.

    Each rank is a fresh Python process. Rendezvous happens through a TCP
    store that the calling process owns and that listens on 127.0.0.1 only, on
    a free port, so other machines cannot join and concurrent launches do not
    collide; gloo traffic also stays on the loopback interface.

    Args:
        fn: the function each rank calls. It may be defined in a notebook cell; it
            runs after ``torch.distributed`` is initialised, so it can call
            ``dist.get_rank()`` and collectives directly.
        *args, **kwargs: passed to ``fn`` on every rank (sent by value).
        world_size: number of ranks. ``None``: one per GPU over nccl on a machine with 2
            or more GPUs, else 2 CPU ranks over gloo (a machine with 1 GPU included: a
            one-rank world would show no data parallelism). The rule and its reason:
            :func:`dpcourse.launch.ranks.plan_ranks`.
        backend: ``"auto"`` (nccl when every rank gets its own GPU, else CPU ranks over
            gloo that see no GPU), ``"gloo"`` or ``"nccl"``. With nccl, rank ``r`` uses
            ``cuda:r``.
        device: ``"auto"`` (default): the ranks see the GPUs this process sees.
            ``"cpu"``: every rank sees no GPU (``CUDA_VISIBLE_DEVICES`` is empty in its
            environment before torch starts, so ``torch.cuda.is_available()`` is False
            there) and runs on gloo, exactly as on a machine without GPUs; for code that
            must stay on CPU even where GPUs exist (torch parts that call CUDA whenever
            a GPU is visible). Other values raise a ValueError.
        timeout: seconds ``fn`` may run (counted once every rank has joined the
            process group) before the ranks are treated as hung (default 120).
            The process group's own timeout is set longer, so that a hang is
            reported here, with where every waiting rank was.
        prefix_output: prefix what each rank prints with ``[rank r]``.

    Returns:
        A list with one entry per rank: what ``fn`` returned there, tensors moved to CPU.

    Raises:
        RankError: a rank raised; names the rank and carries its traceback.
        RankDiedError: a rank's process ended without a result (e.g. killed by a signal),
            or exited abnormally after returning.
        RankTimeoutError: ranks still running after ``timeout`` s; names them and shows
            where each one was waiting.
        ValueError: a bad ``backend``, ``device``, ``world_size`` or ``timeout`` (nothing
            was started); the message says which values work.
        RuntimeError: the ranks would not fit in the available memory (see
            :func:`dpcourse.launch.resources.check_resources`; nothing was started).
        KeyboardInterrupt: the caller was interrupted; every rank has been stopped.
    """
    plan = plan_ranks(world_size, backend, device)
    backend, world_size = plan.backend, plan.world_size
    timeout = _check_timeout(timeout)
    call = _serialize_call(fn, args, kwargs)
    check_resources(world_size, backend)
    store = launch = failure = None
    try:
        store = _loopback_store()
        spec = LaunchSpec(call=call, world_size=world_size, backend=backend, host=LOOPBACK,
                          port=store.port, timeout=timeout,
                          hide_gpus=plan.hide_gpus,
                          # Longer than ours (startup included): a hang is caught by the
                          # launcher, which shows where every waiting rank is, not by one
                          # rank's gloo error.
                          pg_timeout=timeout + STARTUP_TIMEOUT, sys_path=list(sys.path))
        launch = Launch(spec, timeout, prefix_output)
        launch.start()
        return launch.wait()
    except (RankError, RankDiedError, RankTimeoutError) as err:
        failure = err
    finally:
        if launch is not None:
            launch.stop()
        del store  # closes the listening socket
    # Raised here, without the launcher's frames: the message carries the rank's own
    # traceback, and a notebook shows just the cell's line and this one.
    raise failure.with_traceback(None)
