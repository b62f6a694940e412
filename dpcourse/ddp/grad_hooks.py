"""Per-parameter gradient hooks: how a wrapper hears that a gradient has been accumulated.

Autograd calls a *post-accumulate-grad hook* once per backward, right after it
has added the parameter's gradient into ``param.grad`` (see
:mod:`dpcourse.ddp.base` for what the wrapper does with the call). One module
has at most one wrapper hooked into it: wrapping it twice would average every
gradient twice, so the newest wrapper takes over.
"""

from __future__ import annotations

import weakref
from typing import Any

from torch import nn
from torch.utils.hooks import RemovableHandle


def take_over(module: nn.Module, wrapper: Any) -> None:
    """Make ``wrapper`` the one wrapper of ``module``: an older one's hooks are removed."""
    previous = getattr(module, "_dpcourse_wrapper", None)
    if previous is not None and previous() is not None:
        previous()._remove_hooks()
    setattr(module, "_dpcourse_wrapper", weakref.ref(wrapper))


def register_grad_hooks(params: list[nn.Parameter], wrapper: Any) -> list[RemovableHandle]:
    """Call ``wrapper._on_grad_accumulated(i, params[i])`` after each gradient accumulates.

    Args:
        params: the trainable parameters; ``i`` is the position in this list.
        wrapper: the wrapper; the hooks hold it weakly, so a discarded wrapper is freed.

    Returns:
        The hooks' handles (``.remove()`` them to unhook).
    """
    me = weakref.ref(wrapper)

    def make_hook(index):
        def hook(param):
            wrapper = me()
            if wrapper is not None:
                wrapper._on_grad_accumulated(index, param)
        return hook

    return [p.register_post_accumulate_grad_hook(make_hook(i)) for i, p in enumerate(params)]
