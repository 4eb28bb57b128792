"""Mixture-of-experts settings megatron-core accepts when it builds its config but fails on later.

megatron-core's ``TransformerConfig.__post_init__`` checks some MoE combinations (those become a
ConfigError in :func:`bridge_cli.config.mcore_schema.build`); the ones below it only finds when
the model is built, or at the first forward, or when the process groups are made. :func:`check_moe`
raises them as ConfigErrors at validation, so ``--dry-run`` catches them.
"""

from __future__ import annotations

import importlib.util
from typing import Optional

from bridge_cli.config.errors import ConfigError

LOAD_BALANCING_TYPES = ("aux_loss", "seq_aux_loss", "global_aux_loss", "sinkhorn", "none")
"""What megatron-core's TopKRouter implements for model.moe_router_load_balancing_type."""


def check_moe(m, world_size: int) -> None:
    """Raise ConfigError for an MoE setting of model config ``m`` that a run of ``world_size``
    processes cannot build or train; no-op for dense models."""
    _check_exchange_chunks(m)
    if not m.num_moe_experts:
        return
    _check_router(m)
    _check_layer_pattern(m)
    _check_kernels(m)
    _check_parallel_layout(m, world_size)
    _check_compile(m)


def _check_router(m) -> None:
    if not 1 <= m.moe_router_topk <= m.num_moe_experts:
        raise ConfigError("model.moe_router_topk", f"{m.moe_router_topk} must be between 1 and "
                          f"model.num_moe_experts ({m.num_moe_experts}).", "Lower model.moe_router_topk.")
    types_ = m.moe_router_load_balancing_type
    for kind in types_ if isinstance(types_, list) else [types_]:
        if kind not in LOAD_BALANCING_TYPES:
            raise ConfigError("model.moe_router_load_balancing_type", f"{kind!r} is not a load-balancing type.",
                              f"Choose from {', '.join(LOAD_BALANCING_TYPES)} (or a list of them).")
    if isinstance(m.moe_aux_loss_coeff, list) and not isinstance(types_, list):
        raise ConfigError("model.moe_aux_loss_coeff", "is a list, but model.moe_router_load_balancing_type is one type.",
                          "Give one coefficient per load-balancing type, or a single number.")
    if types_ == "sinkhorn" and m.moe_router_topk != 1:
        raise ConfigError("model.moe_router_load_balancing_type", "sinkhorn routes each token to one expert, and "
                          f"model.moe_router_topk={m.moe_router_topk}.", "Set model.moe_router_topk=1.")


def _check_layer_pattern(m) -> None:
    freq = m.moe_layer_freq
    if isinstance(freq, list):
        if len(freq) != m.num_layers or any(v not in (0, 1) for v in freq):
            raise ConfigError("model.moe_layer_freq", f"{freq} must hold one 0 (dense) or 1 (MoE) per layer "
                              f"(model.num_layers={m.num_layers}).", "e.g. [0,1,1,1] makes the first layer dense.")
    elif freq < 1:
        raise ConfigError("model.moe_layer_freq", f"{freq} must be >= 1 (every k-th layer is MoE).")


def _check_kernels(m) -> None:
    if m.moe_token_dispatcher_type == "flex" and not (_importable("deep_ep") or _importable("hybrid_ep")):
        raise ConfigError("model.moe_token_dispatcher_type", "flex needs DeepEP or HybridEP, neither imports here.",
                          "Use alltoall or allgather.")
    if m.moe_grouped_gemm and m.add_bias_linear and not _uses_transformer_engine(m):
        raise ConfigError("model.moe_grouped_gemm", "runs bias-free experts without Transformer Engine, and "
                          "model.add_bias_linear=true.", "Set model.add_bias_linear=false or model.moe_grouped_gemm=false.")
    if m.moe_pad_expert_input_to_capacity and m.moe_token_dispatcher_type != "alltoall":
        raise ConfigError("model.moe_pad_expert_input_to_capacity", "is implemented by the alltoall token dispatcher "
                          f"only, and model.moe_token_dispatcher_type={m.moe_token_dispatcher_type}.",
                          "Set model.moe_token_dispatcher_type=alltoall.")


def _check_parallel_layout(m, world_size: int) -> None:
    ep, etp = m.expert_model_parallel_size, m.expert_tensor_parallel_size or m.tensor_model_parallel_size
    if m.num_moe_experts % ep:
        raise ConfigError("model.expert_model_parallel_size", f"{ep} does not divide model.num_moe_experts "
                          f"({m.num_moe_experts}); every rank holds the same number of experts.",
                          "Pick a divisor of the expert count.")
    if etp < m.tensor_model_parallel_size and ep == 1:
        raise ConfigError("model.expert_tensor_parallel_size",
                          f"{etp} is below model.tensor_model_parallel_size ({m.tensor_model_parallel_size}) with "
                          "model.expert_model_parallel_size=1: each tensor-parallel rank then runs the experts on its "
                          "own tokens, and megatron-core sums expert gradients across those ranks only when the "
                          "experts are expert-parallel, so they would learn from part of each batch.",
                          "Set model.expert_model_parallel_size to 2 or more, or model.expert_tensor_parallel_size to "
                          "the TP size (experts with biases, add_bias_linear, need expert TP 1).")
    expert_model_parallel = etp * ep * m.pipeline_model_parallel_size
    if world_size % expert_model_parallel:
        raise ConfigError("model.expert_model_parallel_size", f"expert TP ({etp}) x EP ({ep}) x PP "
                          f"({m.pipeline_model_parallel_size}) = {expert_model_parallel} does not divide the world "
                          f"size ({world_size}).", "Change the expert parallel sizes or the number of processes.")
    if m.tensor_model_parallel_size > 1 and not m.sequence_parallel:
        raise ConfigError("model.sequence_parallel", "must be true for an MoE model with "
                          f"model.tensor_model_parallel_size={m.tensor_model_parallel_size} (megatron-core's MoE "
                          "layer refuses to train otherwise).", "Set model.sequence_parallel=true.")


def device_dispatch_blocker(m) -> Optional[str]:
    """Why the MoE layers of model config ``m`` keep megatron-core's token dispatcher instead of
    :class:`~bridge_cli.models.moe_dispatch.DeviceTokenDispatcher`, or None when they do not."""
    ep = m.expert_model_parallel_size
    reasons = [
        (_uses_transformer_engine(m), "model.spec=te (Transformer Engine's experts)"),
        (not m.moe_grouped_gemm, "model.moe_grouped_gemm=false (SequentialMLP experts)"),
        (m.moe_token_dispatcher_type not in ("alltoall", "allgather"),
         f"model.moe_token_dispatcher_type={m.moe_token_dispatcher_type}"),
        (m.moe_token_dispatcher_type == "alltoall" and ep > m.moe_router_topk,
         f"model.moe_token_dispatcher_type=alltoall with model.expert_model_parallel_size={ep} above "
         f"model.moe_router_topk={m.moe_router_topk} (there the all-to-all moves less data than a gather)"),
        (m.moe_pad_expert_input_to_capacity, "model.moe_pad_expert_input_to_capacity=true"),
        (m.moe_shared_expert_overlap, "model.moe_shared_expert_overlap=true"),
    ]
    return next((reason for applies, reason in reasons if applies), None)


def _check_compile(m) -> None:
    blocker = device_dispatch_blocker(m)
    if m.compile_layers and blocker:
        raise ConfigError("model.compile_layers", f"compiles MoE layers whose counts stay on the GPU, and here "
                          f"{blocker} sends the tokens through megatron-core's dispatcher, which waits on the GPU "
                          "and does not trace.", "Set model.compile_layers=false, or use grouped experts with "
                          "the allgather dispatcher (or alltoall with expert parallelism up to moe_router_topk), "
                          "no padding to capacity and no shared-expert overlap.")


def _check_exchange_chunks(m) -> None:
    chunks, key = m.moe_exchange_chunks, "model.moe_exchange_chunks"
    if chunks == 1:
        return
    if chunks < 1:
        raise ConfigError(key, f"{chunks} must be 1 (one exchange) or more.", "Set model.moe_exchange_chunks=1.")
    if not m.num_moe_experts:
        raise ConfigError(key, f"{chunks} chunks split the token exchange of MoE layers, and this model has none "
                          "(model.num_moe_experts is unset).", "Leave model.moe_exchange_chunks at 1.")
    blocker = device_dispatch_blocker(m)
    if blocker:
        raise ConfigError(key, f"{chunks} chunks split the token exchange of bridge's token dispatcher, and here "
                          f"{blocker} keeps megatron-core's.", "Set model.moe_exchange_chunks=1, or use grouped experts "
                          "with the allgather dispatcher (or alltoall with expert parallelism up to moe_router_topk), "
                          "no padding to capacity and no shared-expert overlap.")
    etp = m.expert_tensor_parallel_size or m.tensor_model_parallel_size
    if m.expert_model_parallel_size * etp == 1:
        raise ConfigError(key, f"{chunks} chunks split the exchange of tokens between expert-parallel ranks, and with "
                          "model.expert_model_parallel_size=1 and expert TP 1 there is none.",
                          "Leave model.moe_exchange_chunks at 1 on one expert-parallel rank.")
    local = m.seq_length // m.tensor_model_parallel_size  # a rank's positions of each sequence (sequence parallel)
    if local % chunks:
        raise ConfigError(key, f"{chunks} does not divide the {local} positions of each sequence that an MoE layer "
                          f"of a rank holds (model.seq_length={m.seq_length} / model.tensor_model_parallel_size="
                          f"{m.tensor_model_parallel_size}); chunks split them evenly.", "Pick a divisor of it.")


def _uses_transformer_engine(m) -> bool:
    from bridge_cli.models.specs import default_spec_name

    return (m.spec or default_spec_name()) == "te"


def _importable(name: str) -> bool:
    return importlib.util.find_spec(name) is not None
