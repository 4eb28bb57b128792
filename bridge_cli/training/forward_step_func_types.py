"""The forward-step signatures pretrain() accepts, and the adapter to megatron-core's two-argument call.

megatron-core's schedules call ``forward_step_func(data_iterator, model)``. Users may also write
``(state, data_iterator, model)``, ``(data_iterator, model, return_schedule_plan=False)`` or
``(state, data_iterator, model, return_schedule_plan=False)``, as functions or functors. The
GlobalState is injected when the first parameter is annotated ``GlobalState`` or named
``state``/``global_state``.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any, Callable, Protocol

from bridge_cli.training.state import GlobalState

STATE_NAMES = ("state", "global_state")


class ForwardStepCallable(Protocol):
    def __call__(self, *args: Any, **kwargs: Any) -> tuple[Any, Callable]: ...


def _wants_state(func: Callable) -> bool:
    call = func if inspect.isfunction(func) or inspect.ismethod(func) else getattr(func, "__call__", func)
    params = list(inspect.signature(call).parameters.values())
    if not params:
        return False
    first = params[0]
    annotation = first.annotation
    if isinstance(annotation, str):
        annotated = annotation.split(".")[-1] == "GlobalState"
    else:
        annotated = annotation is GlobalState or getattr(annotation, "__name__", None) == "GlobalState"
    return annotated or first.name in STATE_NAMES


def bind_state(forward_step_func: ForwardStepCallable, state: GlobalState) -> Callable:
    """A ``(data_iterator, model)`` callable for megatron-core, with ``state`` injected if wanted."""
    if _wants_state(forward_step_func):
        return functools.partial(forward_step_func, state)
    return forward_step_func
