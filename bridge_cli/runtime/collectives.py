"""Collectives and rank checks over megatron-core's process groups, on either device (NCCL or gloo)."""

from __future__ import annotations

import math
from typing import Optional, Union

import torch
import torch.distributed as dist


def is_last_rank() -> bool:
    return dist.get_rank() == dist.get_world_size() - 1


def weights_match_across_dp_replicas(model: list, device: torch.device) -> bool:
    """True when every data-parallel replica holds bitwise the same weights (SHA-256 per parameter).

    megatron-core's check_param_hashes_across_dp_replicas allocates on CUDA; this one runs on
    the run's device, so the CPU path can check too.
    """
    import hashlib

    from megatron.core import parallel_state

    digests = [torch.frombuffer(bytearray(hashlib.sha256(p.detach().float().cpu().numpy().tobytes()).digest()),
                                dtype=torch.uint8)
               for chunk in model for p in chunk.parameters()]
    local = torch.stack(digests).to(device)
    group = parallel_state.get_data_parallel_group()
    gathered = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
    dist.all_gather(gathered, local, group=group)
    return all(torch.equal(local, other) for other in gathered)


def reduce_max_stat_across_model_parallel_group(stat: Optional[float], mp_group) -> Optional[float]:
    """The largest ``stat`` over ``mp_group``; ranks without the stat (None) pass; None if all do."""
    value = torch.tensor([-math.inf if stat is None else float(stat)], dtype=torch.float32,
                         device=_group_device(mp_group))
    dist.all_reduce(value, op=dist.ReduceOp.MAX, group=mp_group)
    result = value.item()
    return None if result == -math.inf else result


def logical_and_across_model_parallel_group(input: bool, mp_group) -> bool:  # noqa: A002  (the reference's name)
    """True only when ``input`` is true on every rank of ``mp_group``."""
    value = torch.tensor([int(bool(input))], dtype=torch.int32, device=_group_device(mp_group))
    dist.all_reduce(value, op=dist.ReduceOp.MIN, group=mp_group)
    return bool(value.item())


def reduce_max_memory_across_pp_group(memory_report: dict[str, Union[int, float]], pp_group) -> dict[str, Union[int, float]]:
    """Each memory metric's maximum over the pipeline stages, in one all-reduce.

    The first stage usually peaks highest (it holds the most in-flight activations) but only the
    last rank writes metrics, so without this the logged peak under-reports. Integer counters
    (``alloc_retries``) stay integers. No-op without a process group, with one stage, or for an
    empty report.
    """
    if not memory_report or not dist.is_initialized() or dist.get_world_size(pp_group) == 1:
        return memory_report
    keys = sorted(memory_report)
    values = torch.tensor([float(memory_report[k]) for k in keys], dtype=torch.float64,
                          device=_group_device(pp_group))
    dist.all_reduce(values, op=dist.ReduceOp.MAX, group=pp_group)
    return {k: int(v) if isinstance(memory_report[k], int) else v for k, v in zip(keys, values.tolist())}


def on_any_rank(flag: bool) -> bool:
    """True on every rank when ``flag`` is true on one, so that all ranks take the same branch."""
    value = torch.tensor([float(flag)], device=_group_device(None))
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return bool(value.item())


def _group_device(group) -> torch.device:
    """Where a collective on ``group`` must put its tensor: CUDA for NCCL, the host for gloo."""
    backend = dist.get_backend(group)
    return torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
