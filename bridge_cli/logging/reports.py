"""The reference's metric reports: memory, throughput, runtime estimate, norms.

Each returns a dict of TensorBoard-style names to numbers; the caller writes them.
"""

from __future__ import annotations

import math
import time
from typing import Optional

import torch
import torch.distributed as dist

MEMORY_KEYS = {
    "allocated_bytes.all.current": "current_allocated_mem",
    "active_bytes.all.current": "current_active_mem",
    "inactive_split_bytes.all.current": "current_inactive_mem",
    "reserved_bytes.all.current": "current_reserved_mem",
    "allocated_bytes.all.peak": "peak_allocated_mem",
    "active_bytes.all.peak": "peak_active_mem",
    "inactive_split_bytes.all.peak": "peak_inactive_mem",
    "reserved_bytes.all.peak": "peak_reserved_mem",
    "num_alloc_retries": "alloc_retries",
}


def report_memory(memory_keys: Optional[dict[str, str]] = None) -> dict:
    """CUDA memory statistics in GiB (``memory/<name>``); empty without CUDA."""
    if not torch.cuda.is_available():
        return {}
    stats = torch.cuda.memory_stats()
    report = {}
    for key, name in (memory_keys or MEMORY_KEYS).items():
        value = stats.get(key, 0)
        report[f"memory/{name}"] = value if name == "alloc_retries" else value / 2**30
    return report


def report_throughput(iteration: int, global_batch_size: int, seq_length: int, history_wct: list[float],
                      window_size: int, world_size: int) -> dict:
    """Rolling batches/samples/tokens per second over the last ``window_size`` iterations."""
    if len(history_wct) < window_size + 1 or window_size < 1:
        return {}
    elapsed = history_wct[-1] - history_wct[-window_size - 1]
    batches = window_size / elapsed
    out = {"throughput/batches_per_sec": batches, "throughput/samples_per_sec": batches * global_batch_size,
           "throughput/tokens_per_sec": batches * global_batch_size * seq_length}
    out.update({k.replace("throughput/", "throughput/device/"): v / world_size for k, v in list(out.items())})
    return out


def report_runtime(step: int, consumed_samples: int, start_time: float, seq_length: int, train_iters: int,
                   start_step: int = 0, time_unit: str = "hours") -> dict:
    """Time so far, an estimate of the time remaining, and the consumed batches/samples/tokens."""
    divisor = {"seconds": 1, "minutes": 60, "hours": 3600, "days": 86400}[time_unit]
    elapsed = time.time() - start_time
    done = max(step - start_step, 1)
    return {"time/remaining_estimate": elapsed / done * (train_iters - step) / divisor,
            "time/total": elapsed / divisor, "time/batches": step, "time/samples": consumed_samples,
            "time/tokens": consumed_samples * seq_length}


def report_l2_norm_grad(model: list) -> dict:
    """Gradient L2 norms after the data-parallel reduction: ``l2_norm/grad/global`` over the whole
    model-parallel group (tensor-parallel duplicates counted once) and ``l2_norm/grad/<param>``
    for this rank's parameters (its tensor-parallel shard). A collective over the model-parallel group.

    Needs complete gradients on every rank, i.e. not the distributed optimizer's sharded buffers
    with data parallelism (ConfigContainer.validate refuses that combination).
    """
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate

    norms = {}
    squares = torch.zeros(1, dtype=torch.float64)
    for chunk in model:
        for name, param in chunk.named_parameters():
            grad = getattr(param, "main_grad", None)
            grad = grad if grad is not None else param.grad
            if grad is None:
                continue
            square = grad.detach().double().pow(2).sum().cpu()
            norms[f"l2_norm/grad/{_unwrapped_name(name)}"] = float(square.sqrt())
            if param_is_not_tensor_parallel_duplicate(param) and not _counted_on_another_stage(param):
                squares += square
    squares = squares.to(next(model[0].parameters()).device)
    dist.all_reduce(squares, group=parallel_state.get_model_parallel_group())
    norms["l2_norm/grad/global"] = float(squares.sqrt().item())
    return norms


def _unwrapped_name(name: str) -> str:
    """The parameter's name in the GPTModel, without the DDP / Float16Module ``module.`` prefixes."""
    while name.startswith("module."):
        name = name[len("module."):]
    return name


def _counted_on_another_stage(param) -> bool:
    """Embedding weights tied across pipeline stages are counted on the first stage only."""
    from megatron.core import parallel_state

    return getattr(param, "shared", False) and not parallel_state.is_pipeline_first_stage()


def calc_params_l2_norm(model: list) -> float:
    """L2 norm of all parameters across the model-parallel group, counting replicated ones once."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate

    squares = torch.zeros(1, dtype=torch.float64)
    for chunk in model:
        for param in chunk.parameters():
            if param_is_not_tensor_parallel_duplicate(param) and not _counted_on_another_stage(param):
                squares += param.detach().double().pow(2).sum().cpu()
    device = next(model[0].parameters()).device
    squares = squares.to(device)
    dist.all_reduce(squares, group=parallel_state.get_model_parallel_group())
    return float(squares.sqrt().item())


def is_cross_entropy(name: str) -> bool:
    """Whether a reported loss is a cross entropy over tokens, whose exp is a perplexity: the language model's and
    each multi-token-prediction depth's, not DPO's loss, rewards or accuracy."""
    return name == "lm loss" or (name.startswith("mtp_") and name.endswith(" loss"))


def perplexity(loss: float) -> float:
    """exp(loss), capped at exp(20) so a diverged loss prints a number."""
    return math.exp(min(loss, 20.0))
