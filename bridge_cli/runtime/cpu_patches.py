"""The one place that redirects megatron-core's hard-coded CUDA calls on a machine without CUDA.

megatron-core assumes a GPU in a handful of spots that sit on the CPU training path. Each is
replaced here, process-wide, by :func:`apply_cpu_patches`, which does nothing when CUDA is
available and nothing the second time it runs. Symbol by symbol:

``torch.cuda.current_device``
    Used as the ``device=`` of tensors megatron-core allocates itself: DDP grad buffers
    (``distributed.param_and_grad_buffer``), rotary embeddings, tensor-parallel linear weights,
    pipeline p2p receive buffers. A CPU-only torch raises; redirected to ``cpu``.
``torch.cuda.synchronize``
    Called by DDP, pipeline p2p and dist-checkpointing to order work against the GPU stream.
    On the CPU every op is already synchronous; redirected to a no-op.
``megatron.core.pipeline_parallel.schedules.torch``
    Every schedule allocates its token counter with ``torch.zeros(..., device="cuda")`` and
    ``forward_step`` wraps the forward in ``torch.autocast("cuda")`` when autocast is on. The
    module's ``torch`` name is replaced by a view of ``torch`` whose ``zeros`` and ``autocast``
    map ``cuda`` to ``cpu``; all other names resolve to the real ``torch``.
``megatron.core.optimizer.FP32Optimizer`` and ``megatron.core.optimizer.ChainedOptimizer``
    ``get_megatron_optimizer`` wraps its torch optimizer in these; they keep the loss scale
    on ``cuda`` and compute grad norms, clipping and zero counts with ``cuda`` tensors. The
    names are rebound to the subclasses in :mod:`bridge_cli.runtime.cpu_optimizer`, which
    override only those parts, so ``get_megatron_optimizer`` keeps building param groups,
    process groups and checkpoint state exactly as on the GPU.
"""

from __future__ import annotations

import types

import torch

_applied = False


def apply_cpu_patches() -> None:
    """Redirect megatron-core's CUDA-only calls to the CPU; no-op with CUDA or when done."""
    global _applied
    if _applied or torch.cuda.is_available():
        return
    from megatron.core import optimizer as mcore_optimizer
    from megatron.core.pipeline_parallel import schedules

    from bridge_cli.runtime.cpu_optimizer import CPUChainedOptimizer, CPUFP32Optimizer

    torch.cuda.current_device = _current_device
    torch.cuda.synchronize = _synchronize
    schedules.torch = _TorchOnCPU(schedules.torch)
    mcore_optimizer.FP32Optimizer = CPUFP32Optimizer
    mcore_optimizer.ChainedOptimizer = CPUChainedOptimizer
    _applied = True


def _current_device() -> torch.device:
    return torch.device("cpu")


def _synchronize(device=None) -> None:
    return None


def _host(device):
    """``device`` with any CUDA device replaced by the CPU."""
    if device is not None and torch.device(device).type == "cuda":
        return torch.device("cpu")
    return device


class _TorchOnCPU(types.ModuleType):
    """``torch`` as ``schedules`` sees it: CUDA allocations and autocast land on the CPU."""

    def __init__(self, real: types.ModuleType):
        super().__init__(real.__name__, real.__doc__)
        self._real = real

    def __getattr__(self, name: str):
        return getattr(self._real, name)

    def zeros(self, *size, device=None, **kwargs):
        return self._real.zeros(*size, device=_host(device), **kwargs)

    def autocast(self, device_type: str, *args, **kwargs):
        return self._real.autocast("cpu" if device_type == "cuda" else device_type, *args, **kwargs)
