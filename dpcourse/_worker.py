"""Entry point of one rank started by :func:`dpcourse.run` (``python -m dpcourse._worker``).

The worker is a fresh interpreter (never a fork), so CUDA state of the parent
cannot leak in and a function defined in a notebook cell arrives by value
(cloudpickle) instead of by a ``__main__`` reference the child could not import.
"""

from __future__ import annotations

import faulthandler
import os
import signal
import sys
import threading
import time
import traceback


def _exit_when_parent_dies() -> None:
    """Exit as soon as the launching process goes away.

    The parent holds the write end of our stdin; EOF means it died (kernel
    restart, kill -9), and a rank must never outlive it as an orphan.
    """

    def watch() -> None:
        try:
            while sys.stdin.buffer.read(1):
                pass
        except Exception:
            pass
        os._exit(3)

    threading.Thread(target=watch, name="dpcourse-parent-watch", daemon=True).start()


def _write(path: str, payload: dict) -> None:
    import cloudpickle

    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(cloudpickle.dumps(payload))
    os.replace(tmp, path)  # the parent only ever sees a complete file


def _to_cpu(obj):
    """Move tensors in a (nested) result to the CPU so the parent never touches CUDA."""
    import torch

    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu()
    if isinstance(obj, (list, tuple)) and type(obj) in (list, tuple):
        return type(obj)(_to_cpu(x) for x in obj)
    if isinstance(obj, dict) and type(obj) is dict:
        return {k: _to_cpu(v) for k, v in obj.items()}
    return obj


def _init_process_group(spec: dict, rank: int):
    import datetime

    import torch
    import torch.distributed as dist

    world_size = spec["world_size"]
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_WORLD_SIZE=str(world_size),
                      MASTER_ADDR=spec["host"], MASTER_PORT=str(spec["port"]))
    kwargs = {}
    if spec["backend"] == "nccl":
        torch.cuda.set_device(rank)
        kwargs["device_id"] = torch.device("cuda", rank)
    else:
        # Ranks share the CPU cores: without this each one starts a thread per core.
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    store = dist.TCPStore(spec["host"], spec["port"], world_size=None, is_master=False,
                          timeout=datetime.timedelta(seconds=spec["timeout"]))
    store = dist.PrefixStore(spec["prefix"], store)
    dist.init_process_group(spec["backend"], store=store, rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=spec["timeout"]), **kwargs)


def main(workdir: str, rank: int) -> None:
    _exit_when_parent_dies()
    # On SIGUSR1 (sent by the parent at a timeout) print every thread's stack,
    # so the learner sees which collective each rank was stuck in.
    faulthandler.register(signal.SIGUSR1, file=sys.stderr, all_threads=True)
    result_path = os.path.join(workdir, f"rank{rank}.result")
    try:
        import pickle

        with open(os.path.join(workdir, "payload.pkl"), "rb") as f:
            spec = pickle.load(f)
        sys.path[:] = spec["sys_path"]
        fn, args, kwargs = pickle.loads(spec["call"])
        _init_process_group(spec, rank)
        value = _to_cpu(fn(*args, **kwargs))
        try:
            _write(result_path, {"ok": True, "value": value})
        except Exception as exc:  # the value itself could not be pickled
            raise TypeError(
                f"the function returned a {type(value).__name__} that cannot be sent back to the "
                f"launching process ({exc}). Return tensors, numbers, strings, lists or dicts."
            ) from exc
    except BaseException as exc:  # noqa: BLE001 - every failure must reach the parent
        _write(result_path, {"ok": False, "time": time.time(), "type": type(exc).__name__,
                             "message": str(exc), "traceback": traceback.format_exc()})
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)
    # A controlled exit: tear the process group down while the interpreter is
    # intact, then skip finalization, where gloo threads still holding tensors
    # can abort the process ("terminate called without an active exception").
    try:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
