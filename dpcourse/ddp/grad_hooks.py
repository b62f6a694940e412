"""One wrapper per module, its hooks held weakly: wrapping a module again unhooks the older wrapper.

Each wrapper puts a *post-accumulate-grad hook* on every parameter (see
:mod:`dpcourse.ddp.overlapped`). Two wrappers around one module would average
every gradient twice, so the newest wrapper takes over. The hooks reach the
wrapper through a weak reference, so that a discarded wrapper is freed.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from functools import partial
from typing import Any

from torch import nn
from torch.utils.hooks import RemovableHandle

from dpcourse.ddp import guards


def hook_every_parameter(wrapper: Any, hook: Callable[[int, nn.Parameter], None]
                         ) -> list[RemovableHandle]:
    """Have autograd call ``hook(i, param)`` once it has accumulated each trainable gradient.

    ``param.register_post_accumulate_grad_hook`` on each of ``wrapper.reducer.named_params``
    (``i`` indexes them); ``wrapper`` becomes the one wrapper of ``wrapper.module``, and
    its guards are armed (:func:`dpcourse.ddp.guards.install`).

    Args:
        wrapper: the new wrapper.
        hook: the wrapper's bound method ``hook(index, param)``, held weakly.

    Returns:
        The hooks' handles.
    """
    weak_hook = take_over(wrapper.module, wrapper, hook)
    handles = [p.register_post_accumulate_grad_hook(partial(weak_hook, i))
               for i, (_, p) in enumerate(wrapper.reducer.named_params)]
    guards.install(wrapper)
    return handles


def take_over(module: nn.Module, wrapper: Any, hook: Callable[[int, nn.Parameter], None]
              ) -> Callable[[int, nn.Parameter], None]:
    """Make ``wrapper`` the one wrapper of ``module``; return ``hook`` holding ``wrapper`` weakly."""
    previous = getattr(module, "_dpcourse_wrapper", None)
    if previous is not None and previous() is not None:
        previous()._remove_hooks()
    setattr(module, "_dpcourse_wrapper", weakref.ref(wrapper))
    wrapper._replaced = False  # True once a newer wrapper takes over (see guards.check_forward)
    ref = weakref.WeakMethod(hook)  # type: ignore[arg-type]

    def weak_hook(index: int, param: nn.Parameter) -> None:
        method = ref()
        if method is not None:
            method(index, param)
    return weak_hook
