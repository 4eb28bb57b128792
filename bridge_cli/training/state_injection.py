"""Forward-step functions that take the run's GlobalState: detect the signature once, bind the state."""

from __future__ import annotations

from typing import Callable, Optional


STATE_PARAMETER_NAMES = ("state", "global_state")


def needs_global_state_injection(forward_step_func: Callable) -> bool:
    """True when a parameter is annotated GlobalState, or the first one is named state/global_state."""
    import inspect

    call = forward_step_func if inspect.isfunction(forward_step_func) or inspect.ismethod(forward_step_func) \
        else getattr(forward_step_func, "__call__", forward_step_func)
    params = list(inspect.signature(call).parameters.values())
    for param in params:
        annotation = param.annotation
        name = annotation if isinstance(annotation, str) else getattr(annotation, "__name__", "")
        if name.strip("\"'").split(".")[-1] == "GlobalState":
            return True
    return bool(params) and params[0].name in STATE_PARAMETER_NAMES


def maybe_inject_state(forward_step_func: Callable, state, needs_injection: Optional[bool] = None) -> Callable:
    """``forward_step_func`` with ``state`` bound as its first argument when it expects it."""
    import functools

    if needs_injection is None:
        needs_injection = needs_global_state_injection(forward_step_func)
    return functools.partial(forward_step_func, state) if needs_injection else forward_step_func


def prepare_forward_step_func(forward_step_func: Callable, state) -> Callable:
    """Inspect once and inject once, at the start of train() or evaluate(); the partial sees later
    changes to ``state`` because it holds a reference, not a copy."""
    return maybe_inject_state(forward_step_func, state, needs_global_state_injection(forward_step_func))
