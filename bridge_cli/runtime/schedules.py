"""The forward/backward schedule: megatron-core's own on both devices.

megatron-core picks no-pipelining, 1F1B or interleaved 1F1B from the parallel state. Their only
CUDA-bound lines (a token counter allocated on ``cuda``, ``torch.autocast("cuda")``, and the
p2p buffers on ``torch.cuda.current_device()``) are redirected by
:mod:`bridge_cli.runtime.cpu_patches`, so the CPU runs the very same schedule functions:
same signature, same list of per-micro-batch loss-function outputs, same handling of
``forward_only``, ``collect_non_loss_data``, ``(loss, num_tokens, dict)`` losses and the
``no_sync_func`` / ``finalize_model_grads_func`` / ``grad_scale_func`` hooks.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    from bridge_cli.runtime.distributed import Runtime


def get_forward_backward_func(runtime: Runtime) -> Callable:
    """megatron-core's schedule for the current pipeline layout, runnable on ``runtime``."""
    from megatron.core.pipeline_parallel import get_forward_backward_func as mcore_schedule

    if not runtime.is_cuda:
        from bridge_cli.runtime.cpu_patches import apply_cpu_patches

        apply_cpu_patches()
    return mcore_schedule()
