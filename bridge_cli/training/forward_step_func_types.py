"""The forward-step signatures pretrain() accepts.

megatron-core's schedules call ``forward_step_func(data_iterator, model)``. Users may also write
``(state, data_iterator, model)``, ``(data_iterator, model, return_schedule_plan=False)`` or
``(state, data_iterator, model, return_schedule_plan=False)``, as functions or functors; the
GlobalState is injected by ``bridge_cli.training.utils.train_utils.prepare_forward_step_func``.
"""

from __future__ import annotations

from typing import Any, Callable, Protocol


class ForwardStepCallable(Protocol):
    def __call__(self, *args: Any, **kwargs: Any) -> tuple[Any, Callable]: ...
