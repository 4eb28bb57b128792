"""What needs CUDA: one table, checked once by the validation pass for the device a run will use.

``bridge config validate`` and ``--dry-run`` apply it for ``--device`` (default: this machine's),
so a CPU machine can check a GPU run's config and the other way round.
"""

from __future__ import annotations

from typing import Any, Callable

from bridge_cli.runtime.errors import RuntimeUnavailable

DEVICES = ("cpu", "cuda")

CUDA_ONLY: tuple[tuple[str, Callable[[Any], bool], str], ...] = (
    ("model.bf16=true", lambda c: c.model.bf16, "model.bf16=false"),
    ("model.fp16=true", lambda c: c.model.fp16, "model.fp16=false"),
    ("model.fp8", lambda c: c.model.fp8 is not None, "model.fp8=null"),
    # sequence parallelism keeps megatron-core's linear, whose placeholder gradients are CUDA tensors
    ("model.gradient_accumulation_fusion=true with model.sequence_parallel=true",
     lambda c: c.model.gradient_accumulation_fusion and c.model.sequence_parallel,
     "model.gradient_accumulation_fusion=false"),
    ("optimizer.use_distributed_optimizer=true", lambda c: c.optimizer.use_distributed_optimizer,
     "optimizer.use_distributed_optimizer=false"),
    ("optimizer.optimizer_cpu_offload=true", lambda c: c.optimizer.optimizer_cpu_offload,
     "optimizer.optimizer_cpu_offload=false"),
    ("optimizer.use_precision_aware_optimizer=true", lambda c: c.optimizer.use_precision_aware_optimizer,
     "optimizer.use_precision_aware_optimizer=false"),
    ("checkpoint.async_save=true", lambda c: c.checkpoint.async_save, "checkpoint.async_save=false"),
    ("logger.log_energy=true", lambda c: c.logger.log_energy, "logger.log_energy=false"),
    ("profiling.use_nsys_profiler=true", lambda c: c.profiling is not None and c.profiling.use_nsys_profiler,
     "profiling.use_nsys_profiler=false"),
    ("profiling.record_memory_history=true", lambda c: c.profiling is not None and c.profiling.record_memory_history,
     "profiling.record_memory_history=false"),
    ("dist.distributed_backend=nccl", lambda c: c.dist.distributed_backend == "nccl", "dist.distributed_backend=gloo"),
    # megatron-core builds each setting into torch's ProcessGroupNCCL.Options
    ("dist.nccl_communicator_config_path", lambda c: c.dist.nccl_communicator_config_path is not None,
     "dist.nccl_communicator_config_path=null"),
    ("dist.high_priority_stream_groups", lambda c: bool(c.dist.high_priority_stream_groups),
     "dist.high_priority_stream_groups=null"),
    ("straggler.log_straggler=true", lambda c: c.straggler is not None and c.straggler.log_straggler,
     "straggler.log_straggler=false"),
    # NVRx's detector scores GPUs by the CUDA kernels it times with CUPTI: there are none on the CPU
    ("nvrx_straggler.enabled=true", lambda c: c.nvrx_straggler is not None and c.nvrx_straggler.enabled,
     "nvrx_straggler.enabled=false"),
)
"""(setting, whether the config has it, the CPU fix): what only the GPU path honours."""

CPU_OPTIMIZERS = ("adam", "sgd")
"""megatron-core optimizers whose CPU build bridge supports (runtime/cpu_optimizer.py)."""


def needs_cuda(cfg) -> bool:
    """Whether ``cfg`` sets anything only the GPU path honours (a GPU recipe)."""
    return any(enabled(cfg) for _, enabled, _ in CUDA_ONLY)


def default_device() -> str:
    """``cuda`` where a GPU is visible, else ``cpu``."""
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def check_device(cfg, device: str) -> None:
    """Refuse, all at once, the settings ``device`` cannot run (nothing to refuse on ``cuda``)."""
    if device not in DEVICES:
        raise RuntimeUnavailable(f"--device {device}: choose one of {', '.join(DEVICES)}.")
    if device == "cuda":
        return
    found = [(setting, fix) for setting, enabled, fix in CUDA_ONLY if enabled(cfg)]
    if found:
        preset = cfg.mixed_precision not in (None, "fp32")
        fixes = ["mixed_precision=fp32" if preset and setting.startswith(("model.bf16", "model.fp16", "model.fp8")) else fix
                 for setting, fix in found]
        keys = ", ".join(setting for setting, _ in found)
        raise RuntimeUnavailable(
            f"{keys} need{'s' if len(found) == 1 else ''} CUDA and no GPU is visible. To run on the CPU, "
            f"add: {' '.join(dict.fromkeys(fixes))}. To check a GPU run's config "
            "from here, add --device cuda to --dry-run or config validate.")
    if cfg.optimizer.optimizer not in CPU_OPTIMIZERS:
        raise RuntimeUnavailable(f"optimizer.optimizer={cfg.optimizer.optimizer} is not supported on the CPU; "
                                 f"use optimizer.optimizer=adam or optimizer.optimizer=sgd.")
