"""How a rank's process ends once its work is done: :func:`destroy_and_exit`.

A process that used a gloo process group can abort in interpreter finalization:
"terminate called without an active exception", exit status -6 (seen with torch
2.13 on CPU, in torchrun workers that ran DDP: one after its work succeeded, one
after a collective raised because its peer had died). C++ prints
that message when ``std::terminate`` is called with no exception in flight, as
when a ``std::thread`` object is destroyed while its thread still runs: here,
most likely a thread of the backend still alive when finalization tore the
objects down, after ``destroy_process_group()`` had returned. So a rank tears
its group down while the interpreter is intact, flushes what it printed, and
leaves with ``os._exit``, which skips finalization.

Only the standard library is imported at module level: the rank's entry point
(:mod:`dpcourse.launch.worker`) imports this before torch.
"""

from __future__ import annotations

import os
import sys
import traceback
from typing import NoReturn


def destroy_and_exit(code: int = 0) -> NoReturn:
    """Destroy the default process group if there is one, flush, and end the process.

    Args:
        code: the exit status. A ``destroy_process_group()`` that raises prints its
            traceback and makes the status 1.
    """
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - reported through the exit status
        traceback.print_exc()
        code = 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
