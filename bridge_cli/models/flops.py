"""Model FLOPs of a sequence: the matrix multiplies the GPU runs, counting only the parameters a token activates.

The model is a list of matmuls in forward order, in multiply-adds per token: each layer's QKV projection (with
grouped-query attention, or multi-latent attention's low-rank projections), causal attention's QK^T and AV (half
the score matrix, no weights), the output projection and the MLP (an MoE layer's top-k routed experts of
``moe_ffn_hidden_size`` plus its shared experts; ``moe_layer_freq`` says which layers), then the output layer; each
multi-token-prediction layer (``mtp_num_layers``) adds its projection of the two joined hidden states (2h to h),
one more layer of the decoder's last kind and one more pass through the output layer. Each matmul costs, in FLOPs
per multiply-add, what autograd runs:

- forward: 2, always;
- weight gradient (wgrad): 2 more for a weight that trains; LoRA's frozen base weights (every weight but the
  adapters, the output layer included) get none;
- input gradient (dgrad): 2 more where the matmul's input needs a gradient: everywhere when the embedding
  trains, under LoRA only past the first adapter in forward order (the embedding's output needs no gradient, so
  the first adapted layer's base matmul and everything before it run forward alone). Attention's two products
  have no weights: where their input needs a gradient their backward is twice their forward (4);
- a LoRA adapter (``dim`` x in, then out x ``dim``, on each targeted layer, on every expert a token visits): 2 + 2
  (wgrad) for each of its two matmuls, 2 for B's dgrad, and 2 for A's where the layer's input needs a gradient.

So a full training pass is 6 per multiply-add everywhere (megatron-core's formula), a LoRA pass 4 per frozen
weight past the first adapter, and a forward pass (a DPO reference's, a distillation teacher's) 2. Not counted:
the embedding lookup, norms, activations, softmax and cross entropy, the router's small GEMM (as in Megatron-LM),
and activation recomputation (model FLOPs, not hardware FLOPs).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class Matmul:
    """One matrix multiply of the model in multiply-adds per token; ``name``: megatron-core's module name."""

    name: str
    macs: float
    fan_in: int = 0
    """Input width, the shape of a LoRA adapter on it (with ``fan_out``)."""
    fan_out: int = 0
    visits: int = 1
    """How many of its copies a token passes through (an MoE layer's routed experts: top-k)."""
    weighted: bool = True
    """False for attention's QK^T and AV, which multiply activations."""


Block = tuple[tuple[Matmul, ...], ...]
"""Chains of matmuls that read the same input and whose outputs are added (an MoE layer's routed and shared
experts); most blocks are one chain."""


def num_floating_point_operations(model_cfg, batch_size: int) -> float:
    """FLOPs of one forward+backward over ``batch_size`` sequences with every weight training (pretraining, full
    fine-tuning): 6 per multiply-add, megatron-core's causal formula."""
    return training_flops(model_cfg) * batch_size


def training_flops(model_cfg, lora=None) -> float:
    """FLOPs of one sequence's forward and backward; ``lora``: the run's LoRAConfig (``peft``), under which only
    the adapters train."""
    return _flops(model_cfg, lora, backward=True)


def forward_flops(model_cfg) -> float:
    """FLOPs of one sequence's forward pass without gradients (and without adapters): 2 per multiply-add."""
    return _flops(model_cfg, None, backward=False)


def _flops(m, lora, backward: bool) -> float:
    targets = set(lora.target_modules) if lora is not None else set()
    trains = lora is None  # without LoRA every weight trains; with it, only the adapters
    needs_grad = trains and backward  # the embedding's output
    total = 0.0
    for block in model_matmuls(m):
        block_grad = needs_grad
        for chain in block:
            grad = needs_grad
            for op in chain:
                adapter = op.name in targets
                rank = lora.dim if adapter else 0
                a_in, a_out = rank * op.fan_in * op.visits, rank * op.fan_out * op.visits  # the adapter's A and B
                total += 2 * (op.macs + a_in + a_out)
                if backward:
                    if grad:  # input gradients, the adapter's A's included
                        total += (2 if op.weighted else 4) * op.macs + 2 * a_in
                    if op.weighted and trains:
                        total += 2 * op.macs
                    total += 2 * a_in + 4 * a_out  # A's weight gradient, B's weight and input gradients
                grad = grad or (op.weighted and trains) or adapter
            block_grad = block_grad or grad
        needs_grad = block_grad
    return float(total * m.seq_length)


def model_matmuls(m) -> list[Block]:
    """The model's matmuls in forward order, a block at a time."""
    h, s = m.hidden_size, m.seq_length
    gated = 2 if m.gated_linear_unit else 1
    moe = _moe_layers(m)
    attention = _attention(m, s)
    blocks: list[Block] = []
    for is_moe in moe:
        blocks += [attention, _mlp(m, is_moe, gated)]
    output = ((Matmul("output_layer", h * m.padded_vocab_size, h, m.padded_vocab_size),),)
    blocks.append(output)
    for _ in range(m.mtp_num_layers or 0):
        blocks += [((Matmul("eh_proj", 2 * h * h, 2 * h, h),),), attention, _mlp(m, moe[-1], gated), output]
    return blocks


def _linear(name: str, fan_in: int, fan_out: int, visits: int = 1) -> Matmul:
    return Matmul(name, fan_in * fan_out * visits, fan_in, fan_out, visits)


def _mlp(m, is_moe: bool, gated: int) -> Block:
    h = m.hidden_size
    if not is_moe:
        ffn = m.ffn_hidden_size or 4 * h
        return ((_linear("linear_fc1", h, gated * ffn), _linear("linear_fc2", ffn, h)),)
    ffn, topk = m.moe_ffn_hidden_size or m.ffn_hidden_size, m.moe_router_topk
    chains = [(_linear("linear_fc1", h, gated * ffn, topk), _linear("linear_fc2", ffn, h, topk))]
    shared = m.moe_shared_expert_intermediate_size
    if shared:
        chains.append((_linear("linear_fc1", h, gated * shared), _linear("linear_fc2", shared, h)))
    return tuple(chains)


def _moe_layers(m) -> list[bool]:
    """Whether each decoder layer is an MoE layer (``moe_layer_freq``: a 0/1 list, or every N-th from the first)."""
    if not m.num_moe_experts:
        return [False] * m.num_layers
    freq = m.moe_layer_freq
    return [bool(f) for f in freq] if isinstance(freq, list) else [i % freq == 0 for i in range(m.num_layers)]


def _attention(m, s: int) -> Block:
    """Projections in, causal QK^T and AV (each token meets s / 2 positions on average), linear_proj out."""
    h, heads = m.hidden_size, m.num_attention_heads
    if getattr(m, "multi_latent_attention", False):
        qk = m.qk_head_dim + m.qk_pos_emb_head_dim
        # the low-rank projections, their norms' scales counted as Megatron-LM counts them; no LoRA target
        q = h * heads * qk if m.q_lora_rank is None else m.q_lora_rank * (h + heads * qk + 1)
        kv = m.kv_lora_rank * (h + heads * (m.qk_head_dim + m.v_head_dim) + 1) + h * m.qk_pos_emb_head_dim
        return ((Matmul("mla_projections", q + kv), Matmul("attention", heads * (qk + m.v_head_dim) * s / 2,
                                                           weighted=False),
                 _linear("linear_proj", heads * m.v_head_dim, h)),)
    kv_channels = m.kv_channels or h // heads
    query = kv_channels * heads
    groups = m.num_query_groups or heads
    return ((_linear("linear_qkv", h, query + 2 * kv_channels * groups),
             Matmul("attention", query * s, weighted=False), _linear("linear_proj", query, h)),)
