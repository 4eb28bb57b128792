"""Process groups: torch.distributed plus megatron-core's model-parallel state.

The launcher may be torchrun (RANK/WORLD_SIZE/LOCAL_RANK), Slurm's srun (SLURM_PROCID/...), or
nothing, in which case this process is a world of one on a free localhost port. With CUDA each
process drives the GPU of its local rank over NCCL; without it the same code runs on gloo.
"""

from __future__ import annotations

import datetime
import os
import re
import socket
import subprocess
from dataclasses import dataclass

import torch
import torch.distributed as dist

from bridge_cli.runtime.errors import RuntimeUnavailable
from bridge_cli.runtime.launch_env import launcher, local_rank, rank


@dataclass(frozen=True)
class Runtime:
    """Where this process trains, and its place in the world."""

    device: torch.device
    backend: str
    rank: int
    world_size: int
    local_rank: int
    is_cuda: bool
    gloo_groups: bool = True
    """Whether megatron-core made its gloo process groups beside the main ones (``dist.use_gloo_process_groups``)."""


@dataclass(frozen=True)
class _Launch:
    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int


def init_distributed(
    backend: str,
    timeout_minutes: int,
    tensor_model_parallel_size: int,
    pipeline_model_parallel_size: int,
    context_parallel_size: int = 1,
    expert_model_parallel_size: int = 1,
    virtual_pipeline_model_parallel_size: int | None = None,
    expert_tensor_parallel_size: int | None = None,
    pipeline_model_parallel_comm_backend: str | None = None,
    gloo_groups: bool = True,
    nccl_settings_path: str | None = None,
    high_priority_stream_groups: list[str] | None = None,
) -> Runtime:
    """Join the process group and build megatron-core's parallel groups.

    ``backend`` is ``nccl``, ``gloo`` or ``auto`` (NCCL with CUDA, else gloo). Calling it again
    in the same process reuses the process group and rebuilds the parallel groups. ``gloo_groups``: megatron-core's
    gloo copies of its data-parallel groups too (``dist.use_gloo_process_groups``); ``nccl_settings_path`` and
    ``high_priority_stream_groups``: NCCL settings per group (runtime/nccl_groups.py).
    """
    from megatron.core import parallel_state

    is_cuda = torch.cuda.is_available()
    backend = _resolve_backend(backend, is_cuda)
    launch = _detect_launch()
    model_parallel = tensor_model_parallel_size * pipeline_model_parallel_size * context_parallel_size
    if launch.world_size % model_parallel:
        raise RuntimeUnavailable(
            f"{launch.world_size} processes cannot be split into tensor ({tensor_model_parallel_size})"
            f" x pipeline ({pipeline_model_parallel_size}) x context ({context_parallel_size}) parallel"
            f" groups of {model_parallel}; launch a multiple of {model_parallel} processes or lower"
            " the parallel sizes."
        )

    if is_cuda:
        torch.cuda.set_device(launch.local_rank)
        device = torch.device("cuda", launch.local_rank)
    else:
        from bridge_cli.runtime.cpu_patches import apply_cpu_patches

        apply_cpu_patches()
        device = torch.device("cpu")

    if not dist.is_initialized():
        dist.init_process_group(
            backend=backend,
            init_method=f"tcp://{launch.master_addr}:{launch.master_port}",
            rank=launch.rank,
            world_size=launch.world_size,
            timeout=datetime.timedelta(minutes=timeout_minutes),
        )
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tensor_model_parallel_size,
        pipeline_model_parallel_size=pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=virtual_pipeline_model_parallel_size,
        context_parallel_size=context_parallel_size,
        expert_model_parallel_size=expert_model_parallel_size,
        expert_tensor_parallel_size=expert_tensor_parallel_size,
        distributed_timeout_minutes=timeout_minutes,
        pipeline_model_parallel_comm_backend=pipeline_model_parallel_comm_backend,
        create_gloo_process_groups=gloo_groups,
        nccl_communicator_config_path=nccl_settings_path,
        high_priority_stream_groups=high_priority_stream_groups,
    )
    return Runtime(
        device=device,
        backend=dist.get_backend(),
        rank=launch.rank,
        world_size=launch.world_size,
        local_rank=launch.local_rank,
        is_cuda=is_cuda,
        gloo_groups=gloo_groups,
    )


def destroy_distributed() -> None:
    """Tear down megatron-core's parallel groups and the process group (safe to call twice)."""
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


def _resolve_backend(backend: str, is_cuda: bool) -> str:
    if backend == "auto":
        return "nccl" if is_cuda else "gloo"
    if backend == "nccl" and not is_cuda:
        raise RuntimeUnavailable(
            "dist.distributed_backend=nccl needs CUDA; no GPU is visible. "
            "Use dist.distributed_backend=gloo to train on the CPU."
        )
    return backend


def _detect_launch() -> _Launch:
    env = os.environ
    kind = launcher(env)
    if kind == "torchrun":
        return _Launch(
            rank=rank(env),
            world_size=int(env["WORLD_SIZE"]),
            local_rank=local_rank(env),
            master_addr=env.get("MASTER_ADDR", "127.0.0.1"),
            master_port=int(env.get("MASTER_PORT", 29500)),
        )
    if kind == "srun":
        nodelist = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST", "127.0.0.1")
        # Every task must agree on the port without talking, so derive it from the job id.
        default_port = 20000 + int(env.get("SLURM_JOB_ID", "0")) % 20000
        return _Launch(
            rank=rank(env),
            world_size=int(env["SLURM_NTASKS"]),
            local_rank=local_rank(env),
            master_addr=env.get("MASTER_ADDR") or _first_slurm_host(nodelist),
            master_port=int(env.get("MASTER_PORT", default_port)),
        )
    return _Launch(rank=0, world_size=1, local_rank=0, master_addr="127.0.0.1", master_port=_free_port())


def _first_slurm_host(nodelist: str) -> str:
    """First host of a Slurm node list such as ``gpu[003-005,9],login1``."""
    try:
        out = subprocess.run(
            ["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True, check=True
        ).stdout.split()
        if out:
            return out[0]
    except (OSError, subprocess.CalledProcessError):
        pass
    match = re.match(r"([^,\[]+)(?:\[([^\]]+)\])?", nodelist)
    prefix, ranges = match.group(1), match.group(2)
    if ranges is None:
        return prefix
    return prefix + ranges.split(",")[0].split("-")[0]


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
