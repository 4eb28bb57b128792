"""Model FLOPs (megatron-core's causal formula) against values computed by hand per recipe."""

from __future__ import annotations

import pytest

from bridge_cli.config.compose import compose
from bridge_cli.training.config import ConfigContainer
from bridge_cli.training.utils.train_utils import num_floating_point_operations

# 6 x (layers x (QKV + output projection + MLP matmuls) + output layer) + 6 x layers x q x seq (causal
# attention), per token; MLP is 3 h x F matmuls with SwiGLU, 2 without; GQA shrinks K and V.
HAND_FLOPS_PER_TOKEN = {
    # 6*(32*(4096*(4096+2*1024) + 4096*4096 + 3*4096*14336) + 4096*128256) + 6*32*4096*8192
    "llama8b": 51_470_401_536,
    # 6*(16*(2048*(2048+2*512) + 2048*2048 + 3*2048*8192) + 2048*128256) + 6*16*2048*4096
    "llama1b": 8_219_787_264,
    # 6*(12*(768*(768+2*768) + 768*768 + 2*768*3072) + 768*50304) + 6*12*768*1024; vocab padded to 50304
    "gpt2_124m": 798_031_872,
}


@pytest.mark.parametrize("recipe", sorted(HAND_FLOPS_PER_TOKEN))
def test_flops_formula_matches_hand_computation(recipe):
    cfg = ConfigContainer.from_yaml_dict(compose(recipe, []))
    tokens = cfg.model.seq_length * 2
    assert num_floating_point_operations(cfg.model, batch_size=2) == HAND_FLOPS_PER_TOKEN[recipe] * tokens


def test_each_mtp_layer_adds_a_layer_its_projection_and_an_output_layer_pass():
    # llama1b per token: one more layer 6*(2048*(2048+2*512) + 2048*2048 + 3*2048*8192) + 6*2048*4096,
    # the 2h -> h projection 6*2*2048*2048, and the output layer again 6*2048*128256
    cfg = ConfigContainer.from_yaml_dict(compose("llama1b", ["model.mtp_num_layers=2"]))
    per_mtp_layer = 6 * (2048 * (2048 + 2 * 512) + 2048 * 2048 + 3 * 2048 * 8192) + 6 * 2048 * 4096 \
        + 6 * 2 * 2048 * 2048 + 6 * 2048 * 128256
    tokens = cfg.model.seq_length * 2
    expected = (HAND_FLOPS_PER_TOKEN["llama1b"] + 2 * per_mtp_layer) * tokens
    assert num_floating_point_operations(cfg.model, batch_size=2) == expected


# deepseek_v3 at a small shape whose terms differ: hidden 64, 4 heads, q latent 32, kv latent 16, qk 16 + RoPE 8,
# v 16, seq 64; a dense first layer (FFN 128), then an MoE layer (top-2 of FFN 32 and a shared expert of 32)
MLA_SHAPE = ["model.num_layers=2", "model.hidden_size=64", "model.ffn_hidden_size=128", "model.num_attention_heads=4",
             "model.num_query_groups=4", "model.q_lora_rank=32", "model.kv_lora_rank=16", "model.qk_head_dim=16",
             "model.qk_pos_emb_head_dim=8", "model.v_head_dim=16", "model.vocab_size=256", "model.seq_length=64",
             "model.num_moe_experts=8", "model.moe_router_topk=2", "model.moe_ffn_hidden_size=32",
             "model.moe_shared_expert_intermediate_size=32", "model.moe_layer_freq=[0,1]", "model.mtp_num_layers=null",
             "model.tensor_model_parallel_size=1", "model.sequence_parallel=false", "model.pipeline_model_parallel_size=1",
             "model.num_layers_in_first_pipeline_stage=null", "model.num_layers_in_last_pipeline_stage=null"]


@pytest.mark.parametrize("q_lora_rank", [32, None], ids=["q-low-rank", "q-full-rank"])
def test_multi_latent_attention_flops_match_its_projection_shapes(q_lora_rank):
    """test_moe_recipes checks the formula on deepseek_v3's own shape (q low-rank); this counts a small MLA model
    term by term from its weights' shapes, with V2-Lite's full-rank query too. Multiply-adds per token:"""
    h, heads, qk, rope, v, s = 64, 4, 16, 8, 16, 64
    if q_lora_rank:  # linear_q_down_proj h x 32, q_layernorm's 32 scales, linear_q_up_proj 32 x heads (qk + rope)
        q = h * 32 + 32 + 32 * heads * (qk + rope)
    else:  # linear_q_proj h x heads (qk + rope)
        q = h * heads * (qk + rope)
    # linear_kv_down_proj h x (16 + rope): the kv latent and the shared RoPE key; kv_layernorm's 16 scales;
    # linear_kv_up_proj 16 x heads (qk + v): the no-RoPE keys and the values
    kv = h * (16 + rope) + 16 + 16 * heads * (qk + v)
    out = heads * v * h  # linear_proj
    # causal: each token meets s / 2 positions on average, QK^T over qk + rope and AV over v, per head
    attention = heads * (qk + rope) * s / 2 + heads * v * s / 2
    mlps = 3 * h * 128 + 3 * h * 32 * (2 + 1)  # SwiGLU: the dense layer, then top-2 routed + 1 shared expert
    logits = h * 256
    expected = 6 * (2 * (q + kv + out + attention) + mlps + logits)  # 2 FLOPs a multiply-add, forward + 2x backward
    cfg = ConfigContainer.from_yaml_dict(compose("deepseek_v3", [*MLA_SHAPE, f"model.q_lora_rank={q_lora_rank}"
                                                                 if q_lora_rank else "model.q_lora_rank=null"]))
    assert num_floating_point_operations(cfg.model, batch_size=1) == expected * s
