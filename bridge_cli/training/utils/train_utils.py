"""Loss reduction across micro-batches and ranks, and the numbers the log line reports."""

from __future__ import annotations

import math
from typing import Callable, Optional

import torch
import torch.distributed as dist


def reduce_loss_dict(losses_reduced: list[dict]) -> dict[str, torch.Tensor]:
    """One value per reported key, over every micro-batch and data-parallel rank; stays on the device.

    A ``[sum, tokens]`` pair (the token-weighted pattern) is summed and divided once, so every
    token counts the same however the batch is split; a scalar (the ``(loss, dict)`` pattern) is
    averaged over micro-batches and ranks.
    """
    from megatron.core import parallel_state

    group = parallel_state.get_data_parallel_group(with_context_parallel=True)
    reduced = {}
    for key in losses_reduced[0]:
        values = [torch.as_tensor(x[key]).detach().float().view(-1) for x in losses_reduced]
        if values[0].numel() == 2:
            total = torch.stack(values).sum(dim=0)
            dist.all_reduce(total, group=group)
            reduced[key] = total[0] / total[1].clamp(min=1)
        else:
            mean = torch.stack([v.mean() for v in values]).mean()
            dist.all_reduce(mean, group=group)
            reduced[key] = mean / dist.get_world_size(group)
    return reduced


def num_floating_point_operations(model_cfg, batch_size: int) -> float:
    """Model FLOPs of one forward+backward over ``batch_size`` sequences: megatron-core's causal formula.

    Counts the QKV/output projections with grouped-query attention, the MLP (x1.5 for gated
    units such as SwiGLU), causal self-attention (half the score matrix), and the output layer.
    """
    m = model_cfg
    s, h, layers = m.seq_length, m.hidden_size, m.num_layers
    kv_channels = m.kv_channels or h // m.num_attention_heads
    query = kv_channels * m.num_attention_heads
    groups = m.num_query_groups or m.num_attention_heads
    ffn = m.ffn_hidden_size or 4 * h
    gated = 1.5 if m.gated_linear_unit else 1.0
    per_token_layer = h * (query + 2 * kv_channels * groups) + query * h + 2 * h * ffn * gated
    attention = query * s  # causal: QK^T and AV over half of the s x s scores, x2 for the two products
    per_token = 6 * (layers * (per_token_layer + attention) + h * m.padded_vocab_size)
    return float(per_token * s * batch_size)


def perplexity(loss: float) -> float:
    return math.exp(min(loss, 20.0))


def is_last_rank() -> bool:
    return dist.get_rank() == dist.get_world_size() - 1


def grad_norm_is_finite(grad_norm: Optional[float]) -> bool:
    return grad_norm is None or math.isfinite(grad_norm)


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
