"""One wrapper per module: wrapping a module again unhooks the older wrapper.

Each wrapper puts a *post-accumulate-grad hook* on every parameter (see
:mod:`dpcourse.ddp.overlapped`). Two wrappers around one module would average
every gradient twice, so the newest wrapper takes over.
"""

from __future__ import annotations

import weakref
from typing import Any

from torch import nn


def take_over(module: nn.Module, wrapper: Any) -> None:
    """Make ``wrapper`` the one wrapper of ``module``: an older one's hooks are removed."""
    previous = getattr(module, "_dpcourse_wrapper", None)
    if previous is not None and previous() is not None:
        previous()._remove_hooks()
    setattr(module, "_dpcourse_wrapper", weakref.ref(wrapper))
