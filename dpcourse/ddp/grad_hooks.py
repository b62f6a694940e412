"""One wrapper per module, its hooks held weakly: wrapping a module again unhooks the older wrapper.

Each wrapper puts a *post-accumulate-grad hook* on every parameter (see
:mod:`dpcourse.ddp.overlapped`). Two wrappers around one module would average
every gradient twice, so the newest wrapper takes over. The hooks reach the
wrapper through a weak reference, so that a discarded wrapper is freed.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from types import MethodType
from typing import Any, cast

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
    take_over(wrapper.module, wrapper)
    handles = [p.register_post_accumulate_grad_hook(weak_hook(hook, i))
               for i, (_, p) in enumerate(wrapper.reducer.named_params)]
    guards.install(wrapper)
    return handles


def take_over(module: nn.Module, wrapper: Any) -> None:
    """Make ``wrapper`` the one wrapper of ``module``: remove the hooks of the one before it."""
    previous = getattr(module, "_dpcourse_wrapper", None)
    if previous is not None and previous() is not None:
        previous()._remove_hooks()
    setattr(module, "_dpcourse_wrapper", weakref.ref(wrapper))
    wrapper._replaced = False  # True once a newer wrapper takes over (see guards.check_forward)


def weak_hook(hook: Callable[[int, nn.Parameter], None], index: int
              ) -> Callable[[nn.Parameter], None]:
    """Autograd's hook for parameter ``index``: ``hook(index, param)``, its wrapper held weakly.

    Autograd calls it once per gradient, so it does as little as it can: one weak
    reference to dereference (``weakref.WeakMethod`` would build a bound method on
    every call), and ``index`` captured here rather than through a ``functools.partial``.
    """
    method = cast(MethodType, hook)  # the wrapper's bound method
    function, wrapper_ref = method.__func__, weakref.ref(method.__self__)

    def call_if_alive(param: nn.Parameter) -> None:
        wrapper = wrapper_ref()
        if wrapper is not None:  # None: the wrapper was garbage-collected; its hook does nothing
            function(wrapper, index, param)
    return call_if_alive
