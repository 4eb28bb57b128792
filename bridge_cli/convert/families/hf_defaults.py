"""What config.json means by a key it lacks: transformers' defaults per family (its config class's, transformers 5.24).

A Hugging Face folder's config.json may leave out any field its config class has a default for, and transformers
reads the folder with that default: a StarCoder2 without ``tie_word_embeddings`` is tied, a Mistral without
``sliding_window`` attends over 4,096 tokens, a GLM-4 without ``partial_rotary_factor`` rotates half of each head.
:func:`complete` fills them in before a family reads config.json. ``tests/unit/test_hf_defaults.py`` compares
these tables with transformers' classes. No torch import.
"""

from __future__ import annotations

from typing import Any, Mapping, Optional

DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": {"vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32,
        "num_attention_heads": 32, "num_key_value_heads": None, "hidden_act": "silu", "max_position_embeddings": 2048,
        "initializer_range": 0.02, "rms_norm_eps": 1e-06, "use_cache": True, "pad_token_id": None, "bos_token_id": 1,
        "eos_token_id": 2, "pretraining_tp": 1, "tie_word_embeddings": False, "rope_parameters": None,
        "attention_bias": False, "attention_dropout": 0.0, "mlp_bias": False, "head_dim": None},
    "mistral": {"vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
        "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": None, "hidden_act": "silu",
        "max_position_embeddings": 131072, "initializer_range": 0.02, "rms_norm_eps": 1e-06, "use_cache": True,
        "pad_token_id": None, "bos_token_id": 1, "eos_token_id": 2, "tie_word_embeddings": False,
        "rope_parameters": None, "sliding_window": 4096, "attention_dropout": 0.0},
    "qwen2": {"vocab_size": 151936, "hidden_size": 4096, "intermediate_size": 22016, "num_hidden_layers": 32,
        "num_attention_heads": 32, "num_key_value_heads": 32, "hidden_act": "silu", "max_position_embeddings": 32768,
        "initializer_range": 0.02, "rms_norm_eps": 1e-06, "use_cache": True, "tie_word_embeddings": False,
        "rope_parameters": None, "use_sliding_window": False, "sliding_window": 4096, "max_window_layers": 28,
        "layer_types": None, "attention_dropout": 0.0, "pad_token_id": None, "bos_token_id": None,
        "eos_token_id": None},
    "qwen3": {"vocab_size": 151936, "hidden_size": 4096, "intermediate_size": 22016, "num_hidden_layers": 32,
        "num_attention_heads": 32, "num_key_value_heads": 32, "head_dim": 128, "hidden_act": "silu",
        "max_position_embeddings": 32768, "initializer_range": 0.02, "rms_norm_eps": 1e-06, "use_cache": True,
        "tie_word_embeddings": False, "rope_parameters": None, "attention_bias": False, "use_sliding_window": False,
        "sliding_window": 4096, "max_window_layers": 28, "layer_types": None, "attention_dropout": 0.0,
        "pad_token_id": None, "bos_token_id": None, "eos_token_id": None},
    "phi3": {"vocab_size": 32064, "hidden_size": 3072, "intermediate_size": 8192, "num_hidden_layers": 32,
        "num_attention_heads": 32, "num_key_value_heads": None, "resid_pdrop": 0.0, "embd_pdrop": 0.0,
        "attention_dropout": 0.0, "hidden_act": "silu", "max_position_embeddings": 4096,
        "original_max_position_embeddings": 4096, "initializer_range": 0.02, "rms_norm_eps": 1e-05, "use_cache": True,
        "tie_word_embeddings": False, "rope_parameters": None, "bos_token_id": 1, "eos_token_id": 32000,
        "pad_token_id": 32000, "sliding_window": None},
    "mixtral": {"vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
        "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": None, "hidden_act": "silu",
        "max_position_embeddings": 131072, "initializer_range": 0.02, "rms_norm_eps": 1e-05, "use_cache": True,
        "pad_token_id": None, "bos_token_id": 1, "eos_token_id": 2, "tie_word_embeddings": False,
        "sliding_window": None, "attention_dropout": 0.0, "num_experts_per_tok": 2, "num_local_experts": 8,
        "output_router_logits": False, "router_aux_loss_coef": 0.001, "router_jitter_noise": 0.0,
        "rope_parameters": None},
    "qwen3_moe": {"vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 6144, "num_hidden_layers": 24,
        "num_attention_heads": 32, "num_key_value_heads": 4, "hidden_act": "silu", "max_position_embeddings": 32768,
        "initializer_range": 0.02, "rms_norm_eps": 1e-06, "use_cache": True, "tie_word_embeddings": False,
        "rope_parameters": None, "attention_bias": False, "use_sliding_window": False, "sliding_window": 4096,
        "attention_dropout": 0.0, "decoder_sparse_step": 1, "moe_intermediate_size": 768, "num_experts_per_tok": 8,
        "num_experts": 128, "norm_topk_prob": False, "output_router_logits": False, "router_aux_loss_coef": 0.001,
        "mlp_only_layers": None, "pad_token_id": None, "bos_token_id": None, "eos_token_id": None},
    "olmoe": {"vocab_size": 50304, "hidden_size": 2048, "intermediate_size": 2048, "num_hidden_layers": 16,
        "num_attention_heads": 16, "num_key_value_heads": None, "hidden_act": "silu", "max_position_embeddings": 4096,
        "initializer_range": 0.02, "rms_norm_eps": 1e-05, "use_cache": True, "pad_token_id": 1, "bos_token_id": None,
        "eos_token_id": 50279, "tie_word_embeddings": False, "rope_parameters": None, "attention_bias": False,
        "attention_dropout": 0.0, "clip_qkv": None, "num_experts_per_tok": 8, "num_experts": 64,
        "output_router_logits": False, "router_aux_loss_coef": 0.01, "norm_topk_prob": False},
    "gemma3_text": {"vocab_size": 262208, "hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 26,
        "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256, "hidden_activation": "gelu_pytorch_tanh",
        "max_position_embeddings": 131072, "initializer_range": 0.02, "rms_norm_eps": 1e-06, "use_cache": True,
        "pad_token_id": 0, "eos_token_id": 1, "bos_token_id": 2, "tie_word_embeddings": True, "rope_parameters": None,
        "attention_bias": False, "attention_dropout": 0.0, "query_pre_attn_scalar": 256, "sliding_window": 4096,
        "layer_types": None, "final_logit_softcapping": None, "attn_logit_softcapping": None,
        "use_bidirectional_attention": False},
    "gemma2": {"vocab_size": 256000, "hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 26,
        "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256, "hidden_activation": "gelu_pytorch_tanh",
        "max_position_embeddings": 8192, "initializer_range": 0.02, "rms_norm_eps": 1e-06, "use_cache": True,
        "pad_token_id": 0, "eos_token_id": 1, "bos_token_id": 2, "tie_word_embeddings": True, "rope_parameters": None,
        "attention_bias": False, "attention_dropout": 0.0, "query_pre_attn_scalar": 256, "sliding_window": 4096,
        "layer_types": None, "final_logit_softcapping": 30.0, "attn_logit_softcapping": 50.0,
        "use_bidirectional_attention": None},
    "gpt_oss": {"num_hidden_layers": 36, "num_local_experts": 128, "vocab_size": 201088, "hidden_size": 2880,
        "intermediate_size": 2880, "head_dim": 64, "num_attention_heads": 64, "num_key_value_heads": 8,
        "sliding_window": 128, "tie_word_embeddings": False, "hidden_act": "silu", "initializer_range": 0.02,
        "max_position_embeddings": 131072, "rms_norm_eps": 1e-05, "rope_parameters": None, "attention_dropout": 0.0,
        "num_experts_per_tok": 4, "swiglu_alpha": 1.702, "swiglu_limit": 7.0, "router_aux_loss_coef": 0.001,
        "output_router_logits": False, "use_cache": True, "layer_types": None, "pad_token_id": None,
        "bos_token_id": None, "eos_token_id": None, "attention_bias": True},
    "gemma": {"vocab_size": 256000, "hidden_size": 3072, "intermediate_size": 24576, "num_hidden_layers": 28,
        "num_attention_heads": 16, "num_key_value_heads": 16, "head_dim": 256, "hidden_act": "gelu_pytorch_tanh",
        "max_position_embeddings": 8192, "initializer_range": 0.02, "rms_norm_eps": 1e-06, "use_cache": True,
        "pad_token_id": 0, "eos_token_id": 1, "bos_token_id": 2, "tie_word_embeddings": True, "rope_parameters": None,
        "attention_bias": False, "attention_dropout": 0.0, "use_bidirectional_attention": None},
    "starcoder2": {"vocab_size": 49152, "hidden_size": 3072, "intermediate_size": 12288, "num_hidden_layers": 30,
        "num_attention_heads": 24, "num_key_value_heads": 2, "hidden_act": "gelu_pytorch_tanh",
        "max_position_embeddings": 4096, "initializer_range": 0.018042, "norm_epsilon": 1e-05, "use_cache": True,
        "bos_token_id": 50256, "eos_token_id": 50256, "pad_token_id": None, "rope_parameters": None,
        "sliding_window": None, "attention_dropout": 0.0, "residual_dropout": 0.0, "embedding_dropout": 0.0,
        "use_bias": True, "tie_word_embeddings": True},
    "olmo2": {"vocab_size": 50304, "hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32,
        "num_attention_heads": 32, "num_key_value_heads": None, "hidden_act": "silu", "max_position_embeddings": 2048,
        "initializer_range": 0.02, "use_cache": True, "pad_token_id": 1, "bos_token_id": None, "eos_token_id": 50279,
        "tie_word_embeddings": False, "rope_parameters": None, "attention_bias": False, "attention_dropout": 0.0,
        "rms_norm_eps": 1e-05},
    "qwen2_moe": {"vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 5632, "num_hidden_layers": 24,
        "num_attention_heads": 16, "num_key_value_heads": 16, "hidden_act": "silu", "max_position_embeddings": 32768,
        "initializer_range": 0.02, "rms_norm_eps": 1e-06, "use_cache": True, "tie_word_embeddings": False,
        "rope_parameters": None, "use_sliding_window": False, "sliding_window": 4096, "max_window_layers": 28,
        "attention_dropout": 0.0, "decoder_sparse_step": 1, "moe_intermediate_size": 1408,
        "shared_expert_intermediate_size": 5632, "num_experts_per_tok": 4, "num_experts": 60, "norm_topk_prob": False,
        "output_router_logits": False, "router_aux_loss_coef": 0.001, "mlp_only_layers": None, "qkv_bias": True,
        "layer_types": None, "pad_token_id": None, "bos_token_id": None, "eos_token_id": None},
    "glm4": {"vocab_size": 151552, "hidden_size": 4096, "intermediate_size": 13696, "num_hidden_layers": 40,
        "num_attention_heads": 32, "num_key_value_heads": 2, "head_dim": 128, "hidden_act": "silu",
        "attention_dropout": 0.0, "max_position_embeddings": 131072, "initializer_range": 0.02,
        "rms_norm_eps": 1.5625e-07, "use_cache": True, "tie_word_embeddings": False, "rope_parameters": None,
        "pad_token_id": 151329, "eos_token_id": None, "bos_token_id": None, "attention_bias": True},
    "stablelm": {"vocab_size": 50304, "intermediate_size": 6912, "hidden_size": 2560, "num_hidden_layers": 32,
        "num_attention_heads": 32, "num_key_value_heads": 32, "hidden_act": "silu", "max_position_embeddings": 4096,
        "initializer_range": 0.02, "layer_norm_eps": 1e-05, "use_cache": True, "tie_word_embeddings": False,
        "rope_parameters": None, "use_qkv_bias": False, "qk_layernorm": False, "use_parallel_residual": False,
        "hidden_dropout": 0.0, "attention_dropout": 0.0, "bos_token_id": 0, "eos_token_id": 0, "pad_token_id": None},
    "gpt2": {"vocab_size": 50257, "n_positions": 1024, "n_embd": 768, "n_layer": 12, "n_head": 12, "n_inner": None,
        "activation_function": "gelu_new", "resid_pdrop": 0.1, "embd_pdrop": 0.1, "attn_pdrop": 0.1,
        "layer_norm_epsilon": 1e-05, "initializer_range": 0.02, "summary_type": "cls_index", "summary_use_proj": True,
        "summary_activation": None, "summary_proj_to_labels": True, "summary_first_dropout": 0.1,
        "scale_attn_weights": True, "use_cache": True, "bos_token_id": 50256, "eos_token_id": 50256,
        "pad_token_id": None, "scale_attn_by_inverse_layer_idx": False, "reorder_and_upcast_attn": False,
        "add_cross_attention": False, "tie_word_embeddings": True},
    "seed_oss": {"vocab_size": 155136, "hidden_size": 4096, "intermediate_size": 27648, "num_hidden_layers": 64,
        "num_attention_heads": 80, "num_key_value_heads": 8, "hidden_act": "silu", "max_position_embeddings": 524288,
        "initializer_range": 0.02, "rms_norm_eps": 1e-06, "use_cache": True, "pad_token_id": 1, "bos_token_id": 0,
        "eos_token_id": 2, "pretraining_tp": 1, "tie_word_embeddings": False, "rope_parameters": None,
        "attention_bias": True, "attention_out_bias": False, "attention_dropout": 0.1, "residual_dropout": 0.1,
        "mlp_bias": False, "head_dim": 128},
    "arcee": {"vocab_size": 32000, "hidden_size": 2560, "intermediate_size": 18432, "num_hidden_layers": 32,
        "num_attention_heads": 32, "num_key_value_heads": None, "hidden_act": "relu2",
        "max_position_embeddings": 4096, "initializer_range": 0.02, "rms_norm_eps": 1e-05, "use_cache": True,
        "pad_token_id": None, "bos_token_id": 128000, "eos_token_id": 128001, "tie_word_embeddings": False,
        "rope_parameters": None, "attention_bias": False, "attention_dropout": 0.0, "mlp_bias": False,
        "head_dim": None},
    "deepseek_v3": {"vocab_size": 129280, "hidden_size": 7168, "intermediate_size": 18432,
        "moe_intermediate_size": 2048, "num_hidden_layers": 61, "num_attention_heads": 128,
        "num_key_value_heads": 128, "n_shared_experts": 1, "n_routed_experts": 256, "output_router_logits": False,
        "routed_scaling_factor": 2.5, "kv_lora_rank": 512, "q_lora_rank": 1536, "qk_rope_head_dim": 64,
        "v_head_dim": 128, "qk_nope_head_dim": 128, "n_group": 8, "topk_group": 4, "num_experts_per_tok": 8,
        "first_k_dense_replace": 3, "norm_topk_prob": True, "hidden_act": "silu", "max_position_embeddings": 4096,
        "initializer_range": 0.02, "rms_norm_eps": 1e-06, "use_cache": True, "pad_token_id": None, "bos_token_id": 0,
        "eos_token_id": 1, "pretraining_tp": 1, "tie_word_embeddings": False, "rope_parameters": None,
        "rope_interleave": True, "attention_bias": False, "attention_dropout": 0.0, "num_mtp_layers": 1},
    "deepseek_v2": {"vocab_size": 102400, "hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32,
        "num_attention_heads": 32, "num_key_value_heads": None, "hidden_act": "silu", "max_position_embeddings": 2048,
        "initializer_range": 0.02, "rms_norm_eps": 1e-06, "use_cache": True, "pad_token_id": None, "bos_token_id": 1,
        "eos_token_id": 2, "pretraining_tp": 1, "tie_word_embeddings": False, "rope_parameters": None,
        "attention_bias": False, "attention_dropout": 0.0, "mlp_bias": False, "head_dim": None,
        "first_k_dense_replace": 0, "kv_lora_rank": 512, "q_lora_rank": 1536, "n_group": None,
        "n_routed_experts": 64, "output_router_logits": False, "n_shared_experts": 2, "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64, "routed_scaling_factor": 1.0, "topk_group": None, "topk_method": "greedy",
        "norm_topk_prob": False, "v_head_dim": 128, "num_experts_per_tok": None, "moe_intermediate_size": 1407},
    "glm4_moe": {"vocab_size": 151552, "hidden_size": 4096, "intermediate_size": 10944, "num_hidden_layers": 46,
        "num_attention_heads": 96, "num_key_value_heads": 8, "hidden_act": "silu", "max_position_embeddings": 131072,
        "initializer_range": 0.02, "rms_norm_eps": 1e-05, "use_cache": True, "tie_word_embeddings": False,
        "rope_parameters": None, "attention_bias": False, "attention_dropout": 0.0, "moe_intermediate_size": 1408,
        "num_experts_per_tok": 8, "output_router_logits": False, "n_shared_experts": 1, "n_routed_experts": 128,
        "routed_scaling_factor": 1.0, "n_group": 1, "topk_group": 1, "first_k_dense_replace": 1,
        "norm_topk_prob": True, "use_qk_norm": False, "bos_token_id": None, "eos_token_id": None,
        "pad_token_id": None, "num_mtp_layers": 1},
    "dots1": {"vocab_size": 152064, "hidden_size": 4608, "intermediate_size": 10944, "moe_intermediate_size": 1408,
        "num_hidden_layers": 62, "num_attention_heads": 32, "num_key_value_heads": 32, "n_shared_experts": None,
        "n_routed_experts": None, "output_router_logits": False, "n_group": 1, "topk_group": 1,
        "num_experts_per_tok": None, "first_k_dense_replace": 0, "norm_topk_prob": False, "hidden_act": "silu",
        "max_position_embeddings": 2048, "initializer_range": 0.02, "rms_norm_eps": 1e-06, "use_cache": True,
        "tie_word_embeddings": False, "rope_parameters": None, "attention_bias": False, "attention_dropout": 0.0,
        "routed_scaling_factor": 1.0, "sliding_window": 4096, "max_window_layers": 62, "layer_types": None,
        "pad_token_id": None, "bos_token_id": None, "eos_token_id": None},
    "ernie4_5": {"vocab_size": 103424, "hidden_size": 1024, "intermediate_size": 3072, "num_hidden_layers": 18,
        "num_attention_heads": 16, "num_key_value_heads": 2, "hidden_act": "silu", "max_position_embeddings": 131072,
        "initializer_range": 0.02, "rms_norm_eps": 1e-05, "use_cache": True, "pad_token_id": 0, "bos_token_id": 1,
        "eos_token_id": 2, "tie_word_embeddings": True, "rope_parameters": None, "use_bias": False, "head_dim": 128},
}
"""model_type -> each field of its transformers config class (beyond PreTrainedConfig's) and its default."""

ALIASES: dict[str, dict[str, str]] = {
    "mixtral": {"num_experts": "num_local_experts"}, "qwen3_moe": {"num_experts": "num_local_experts"},
    "gpt_oss": {"num_experts": "num_local_experts"}, "olmoe": {"num_local_experts": "num_experts"},
    "gpt2": {"hidden_size": "n_embd", "max_position_embeddings": "n_positions", "num_attention_heads": "n_head",
             "num_hidden_layers": "n_layer"},
    "deepseek_v3": {"num_local_experts": "n_routed_experts", "num_mtp_layers": "num_nextn_predict_layers"},
    "deepseek_v2": {"num_experts": "n_routed_experts"},
    "glm4_moe": {"num_local_experts": "n_routed_experts", "num_mtp_layers": "num_nextn_predict_layers"},
    "dots1": {"num_local_experts": "n_routed_experts"},
}
"""model_type -> its config class's ``attribute_map``: a key config.json may use for another (transformers sets the
other), so a field of the class named by the first holds the default of the second."""

ROPE_DEFAULTS: dict[str, tuple[float, Optional[float], dict[str, Any]]] = {
    **{model_type: (10_000.0, None, {}) for model_type in DEFAULTS if model_type != "gpt2"},
    "mixtral": (1_000_000.0, None, {}),
    "phi3": (10_000.0, 1.0, {}),
    "glm4": (10_000.0, 0.5, {}),
    "glm4_moe": (10_000.0, 0.5, {}),
    "ernie4_5": (500_000.0, None, {}),
    "stablelm": (10_000.0, 0.25, {}),
    "gpt_oss": (150_000.0, None, {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                  "truncate": False, "original_max_position_embeddings": 4096}),
}
"""model_type -> what its config class makes of absent RoPE settings: the base (``default_theta``), the fraction of
each head rotated (None: not set) and the scaling (``rope_parameters`` when none is given)."""

PER_LAYER_ROPE = ("gemma3_text",)
"""Families whose RoPE settings may differ per layer kind; their family module reads them (and their defaults)."""

ORIGINAL_LENGTH_FIELD = ("phi3",)
"""Families whose config class has ``original_max_position_embeddings`` as a field, which then sets a scaled RoPE's
original length whatever the scaling says (transformers' exception for Phi-3)."""

SCALED = ("llama3", "yarn", "longrope")
"""RoPE scalings that carry the length the model was trained at."""


def complete(model_type: str, hf: Mapping[str, Any]) -> dict[str, Any]:
    """config.json ``hf`` as transformers reads it for ``model_type``: each absent field at its default, and the
    RoPE settings gathered, as transformers gathers them, in ``rope_parameters`` (``rope_scaling`` or
    ``rope_parameters``, then the top-level ``rope_theta`` and ``partial_rotary_factor``, then the defaults)."""
    aliases = ALIASES.get(model_type, {})
    out = {aliases.get(key, key): value for key, value in [*DEFAULTS.get(model_type, {}).items(), *hf.items()]}
    if model_type in PER_LAYER_ROPE or model_type not in ROPE_DEFAULTS:
        return out
    theta, partial, scaling = ROPE_DEFAULTS[model_type]
    settings = dict(hf.get("rope_scaling") or hf.get("rope_parameters") or scaling)
    settings.setdefault("rope_theta", hf.get("rope_theta", theta))
    partial = hf.get("partial_rotary_factor", partial)
    if partial is not None:
        settings.setdefault("partial_rotary_factor", partial)
    if settings.get("rope_type", settings.get("type")) in SCALED:
        if model_type in ORIGINAL_LENGTH_FIELD:
            settings["original_max_position_embeddings"] = out["original_max_position_embeddings"]
        else:
            settings.setdefault("original_max_position_embeddings", out["max_position_embeddings"])
    for key in ("rope_scaling", "rope_theta", "partial_rotary_factor"):
        out.pop(key, None)
    return {**out, "rope_parameters": settings}
