"""Loss reduction across micro-batches and ranks, the numbers the log line reports, model-parallel
reductions of logged stats, and forward-step state injection (Megatron-Bridge's train_utils).

The value-head and MoE-router hooks live in :mod:`bridge_cli.models.model_hooks` and are
importable from here under the reference's names.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Optional, Union

import torch
import torch.distributed as dist

from bridge_cli.models.model_hooks import (  # re-exported: the reference's import path
    LinearForLastLayer,
    ModelHook,
    ModelList,
    create_value_head_hook,
    freeze_moe_router,
    make_value_model,
)

__all__ = [
    "LinearForLastLayer", "ModelHook", "ModelList", "create_value_head_hook", "freeze_moe_router",
    "grad_norm_is_finite", "is_last_rank", "logical_and_across_model_parallel_group", "make_value_model",
    "maybe_inject_state", "needs_global_state_injection", "num_floating_point_operations", "perplexity",
    "prepare_forward_step_func", "reduce_loss_dict", "reduce_max_memory_across_pp_group",
    "reduce_max_stat_across_model_parallel_group", "weights_match_across_dp_replicas",
]


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

    Counts the QKV/output projections with grouped-query attention (or multi-latent attention's
    low-rank projections), the MLP (x1.5 for gated units such as SwiGLU), causal self-attention
    (half the score matrix), and the output layer. An MoE layer counts only what a token
    activates: top-k routed experts of ``moe_ffn_hidden_size`` plus the shared experts;
    ``moe_layer_freq`` says which layers are MoE. The router's small GEMM is not counted, as in
    Megatron-LM.
    """
    m = model_cfg
    s, h, layers = m.seq_length, m.hidden_size, m.num_layers
    gated = 1.5 if m.gated_linear_unit else 1.0
    dense_mlp = 2 * h * (m.ffn_hidden_size or 4 * h) * gated
    moe_layers = _moe_layer_count(m)
    mlp = (layers - moe_layers) * dense_mlp + moe_layers * _moe_mlp_per_token(m, gated)
    projections, attention = _attention_per_token(m)
    per_token = 6 * (layers * (projections + attention * s) + mlp + h * m.padded_vocab_size)
    return float(per_token * s * batch_size)


def _moe_layer_count(m) -> int:
    if not m.num_moe_experts:
        return 0
    freq = m.moe_layer_freq
    return sum(freq) if isinstance(freq, list) else sum(1 for i in range(m.num_layers) if i % freq == 0)


def _moe_mlp_per_token(m, gated: float) -> float:
    """Multiply-adds of one token through an MoE layer's activated experts."""
    routed = (m.moe_ffn_hidden_size or m.ffn_hidden_size) * m.moe_router_topk
    shared = m.moe_shared_expert_intermediate_size or 0
    return 2 * m.hidden_size * (routed + shared) * gated


def _attention_per_token(m) -> tuple[float, float]:
    """(projection multiply-adds per token, causal score + value multiply-adds per token per sequence position)."""
    h, heads = m.hidden_size, m.num_attention_heads
    if getattr(m, "multi_latent_attention", False):
        qk = m.qk_head_dim + m.qk_pos_emb_head_dim
        q = h * heads * qk if m.q_lora_rank is None else m.q_lora_rank * (h + heads * qk + 1)
        kv = m.kv_lora_rank * (h + heads * (m.qk_head_dim + m.v_head_dim) + 1) + h * m.qk_pos_emb_head_dim
        return q + kv + heads * m.v_head_dim * h, heads * (qk + m.v_head_dim) / 2
    kv_channels = m.kv_channels or h // heads
    query = kv_channels * heads
    groups = m.num_query_groups or heads
    # causal: QK^T and AV over half of the s x s scores, x2 for the two products
    return h * (query + 2 * kv_channels * groups) + query * h, query


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


def _group_device(group) -> torch.device:
    """Where a collective on ``group`` must put its tensor: CUDA for NCCL, the host for gloo."""
    backend = dist.get_backend(group)
    return torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")


class _MoeMetricFanoutWriter:
    """A SummaryWriter-shaped ``add_scalar`` that also forwards to MLflow and Comet.

    megatron-core's MoE/MTP metric helpers (``track_moe_metrics``) write through a TensorBoard
    writer only; wrapping it lets the same values reach MLflow and Comet.
    """

    def __init__(self, tb_writer: Optional[Any], comet_logger: Optional[Any], mlflow_logger: Optional[Any]):
        self.tb_writer = tb_writer
        self.comet_logger = comet_logger
        self.mlflow_logger = mlflow_logger

    @staticmethod
    def _sanitize(value: Any) -> Any:
        """0-d tensors become Python numbers: MLflow and Comet reject tensors."""
        return value.item() if isinstance(value, torch.Tensor) and value.dim() == 0 else value

    def add_scalar(self, name: str, value: Any, iteration: int) -> None:
        if self.tb_writer is not None:
            self.tb_writer.add_scalar(name, value, iteration)
        value = self._sanitize(value)
        if self.mlflow_logger is not None:
            self.mlflow_logger.log_metric(name, value, step=iteration)
        if self.comet_logger is not None:
            self.comet_logger.log_metric(name, value, step=iteration)


def _build_moe_metric_writer(tb_writer: Optional[Any], comet_logger: Optional[Any], mlflow_logger: Optional[Any]):
    """The TensorBoard writer itself when neither MLflow nor Comet is on, else a fan-out adapter."""
    if comet_logger is None and mlflow_logger is None:
        return tb_writer
    return _MoeMetricFanoutWriter(tb_writer, comet_logger, mlflow_logger)


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
