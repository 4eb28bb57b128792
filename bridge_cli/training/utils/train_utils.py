"""Megatron-Bridge's ``train_utils`` import path.

What lives elsewhere is re-exported here under the reference's names: loss reduction
(:mod:`bridge_cli.training.losses`), rank checks and model-parallel reductions
(:mod:`bridge_cli.runtime.collectives`), forward-step state injection
(:mod:`bridge_cli.training.state_injection`), perplexity (:mod:`bridge_cli.logging.reports`) and the
value-head and MoE-router hooks (:mod:`bridge_cli.models.model_hooks`), the FLOPs formula
(:mod:`bridge_cli.models.flops`).
"""

from __future__ import annotations

# re-exported: the reference's import path
from bridge_cli.logging.reports import perplexity
from bridge_cli.models.flops import num_floating_point_operations
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
