"""Model FLOPs per step: megatron-core's causal formula, counting only the parameters a token activates."""

from __future__ import annotations


def num_floating_point_operations(model_cfg, batch_size: int) -> float:
    """Model FLOPs of one forward+backward over ``batch_size`` sequences: megatron-core's causal formula.

    Counts the QKV/output projections with grouped-query attention (or multi-latent attention's
    low-rank projections), the MLP (x1.5 for gated units such as SwiGLU), causal self-attention
    (half the score matrix), and the output layer. An MoE layer counts only what a token
    activates: top-k routed experts of ``moe_ffn_hidden_size`` plus the shared experts;
    ``moe_layer_freq`` says which layers are MoE. The router's small GEMM is not counted, as in
    Megatron-LM. Each multi-token-prediction layer (``mtp_num_layers``) counts as one more layer of the
    decoder's last kind, plus its projection of the two joined hidden states (2h to h) and one more
    pass through the output layer.
    """
    m = model_cfg
    s, h, layers = m.seq_length, m.hidden_size, m.num_layers
    gated = 1.5 if m.gated_linear_unit else 1.0
    dense_mlp = 2 * h * (m.ffn_hidden_size or 4 * h) * gated
    moe = _moe_layers(m)
    moe_layers = sum(moe)
    mlp = (layers - moe_layers) * dense_mlp + moe_layers * _moe_mlp_per_token(m, gated)
    projections, attention = _attention_per_token(m)
    mtp = m.mtp_num_layers or 0
    if mtp:
        mlp += mtp * (_moe_mlp_per_token(m, gated) if moe[-1] else dense_mlp) + mtp * 2 * h * h
    per_token = 6 * ((layers + mtp) * (projections + attention * s) + mlp + (1 + mtp) * h * m.padded_vocab_size)
    return float(per_token * s * batch_size)


def _moe_layers(m) -> list[bool]:
    """Whether each decoder layer is an MoE layer (``moe_layer_freq``: a 0/1 list, or every N-th from the first)."""
    if not m.num_moe_experts:
        return [False] * m.num_layers
    freq = m.moe_layer_freq
    return [bool(f) for f in freq] if isinstance(freq, list) else [i % freq == 0 for i in range(m.num_layers)]


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
