"""Megatron-Bridge's ``train_utils`` import path.

What lives elsewhere is re-exported here under the reference's names: loss reduction
(:mod:`bridge_cli.training.losses`), rank checks and model-parallel reductions
(:mod:`bridge_cli.runtime.collectives`), forward-step state injection
(:mod:`bridge_cli.training.state_injection`), perplexity (:mod:`bridge_cli.logging.reports`) and the
value-head and MoE-router hooks (:mod:`bridge_cli.models.model_hooks`). The FLOPs formula is here.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

# re-exported: the reference's import path
from bridge_cli.logging.reports import perplexity
from bridge_cli.models.model_hooks import (
    LinearForLastLayer,
    ModelHook,
    ModelList,
    create_value_head_hook,
    freeze_moe_router,
    make_value_model,
)
from bridge_cli.runtime.collectives import (
    is_last_rank,
    logical_and_across_model_parallel_group,
    reduce_max_memory_across_pp_group,
    reduce_max_stat_across_model_parallel_group,
    weights_match_across_dp_replicas,
)
from bridge_cli.training.losses import grad_norm_is_finite, reduce_loss_dict
from bridge_cli.training.state_injection import (
    maybe_inject_state,
    needs_global_state_injection,
    prepare_forward_step_func,
)

__all__ = [
    "LinearForLastLayer", "ModelHook", "ModelList", "create_value_head_hook", "freeze_moe_router",
    "grad_norm_is_finite", "is_last_rank", "logical_and_across_model_parallel_group", "make_value_model",
    "maybe_inject_state", "needs_global_state_injection", "num_floating_point_operations", "perplexity",
    "prepare_forward_step_func", "reduce_loss_dict", "reduce_max_memory_across_pp_group",
    "reduce_max_stat_across_model_parallel_group", "weights_match_across_dp_replicas",
]


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


