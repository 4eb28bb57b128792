"""DeepSeek-V3's layout (``DeepseekV3ForCausalLM``: DeepSeek-V3, Kimi K2, Moonlight): multi-latent attention on
megatron-core's ``MLASelfAttention`` (:mod:`bridge_cli.models.mla` on the torch spec), dense MLPs in the first
``first_k_dense_replace`` layers and mixture-of-experts layers after them. No torch import.

The attention's tensors map one to one, in the same layouts: ``q_proj`` (``q_lora_rank`` null) or
``q_a_proj``/``q_b_proj`` are ``linear_q_proj`` or ``linear_q_down_proj``/``linear_q_up_proj``;
``kv_a_proj_with_mqa`` (latent, then the shared RoPE key) is ``linear_kv_down_proj``; ``kv_b_proj`` (per head:
no-RoPE key, then value) is ``linear_kv_up_proj``; the latent norms ``q_a_layernorm``/``kv_a_layernorm`` are
``q_layernorm``/``kv_layernorm``. transformers' interleaved RoPE (``rope_interleave``) is megatron-core's MLA RoPE,
which takes the even then the odd channels. YaRN's ``mscale``/``mscale_all_dim`` give both the cos/sin scale and
the softmax scale correction (``mscale_all_dim``'s squared), as in transformers.

The MoE layers, their router and the Hub's multi-token-prediction layers are :mod:`deepseek_moe`'s.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping, Optional

from bridge_cli.convert import hf_config, yarn
from bridge_cli.convert.families.deepseek_moe import ROUTING_KEYS, DeepSeekMoE, sigmoid_router_fixed
from bridge_cli.convert.families.llama_like import INERT_KEYS, LLAMA_STYLE
from bridge_cli.convert.families.moe import MOE_INERT_KEYS
from bridge_cli.convert.hf_config import unsupported
from bridge_cli.convert.hf_weights import Architecture, Pair

MLA_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
            "max_position_embeddings", "hidden_act", "rms_norm_eps", "tie_word_embeddings", "rope_parameters",
            "attention_dropout", "initializer_range", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim",
            "qk_rope_head_dim", "v_head_dim", "first_k_dense_replace")
"""The config.json keys of the attention and the dense layers that the family reads into the model's fields."""
DENSE_FIXED = {**LLAMA_STYLE, "add_qkv_bias": False, "multi_latent_attention": True, "qk_layernorm": True}
"""The fixed fields of the attention and the dense layers."""


class DeepseekV3(DeepSeekMoE):
    model_type = "deepseek_v3"
    architecture = "DeepseekV3ForCausalLM"
    models = ("DeepSeek-V3, Kimi K2, Moonlight: multi-latent attention (q_lora_rank set or null, YaRN with "
              "mscale/mscale_all_dim), dense first layers, MoE layers with the sigmoid group-limited router, "
              "expert bias and shared experts; the Hub's multi-token-prediction layers as megatron-core's MTP block; "
              "its FP8 release (e4m3 weights, 128x128 block scales) dequantized")
    limits = ("refuses attention_bias, rope_interleave false, RoPE scalings other than yarn, norm_topk_prob false "
              "(megatron-core renormalises sigmoid scores), num_experts_per_tok / topk_group other than 2 with "
              "n_group above 1, multi-token-prediction layers whose embed_tokens or shared_head.head differ from the "
              "model's")
    fixed = sigmoid_router_fixed(DENSE_FIXED)
    # num_mtp_layers (config.json's num_nextn_predict_layers): mtp_num_layers where the folder holds those layers
    mapped_keys = (*MLA_KEYS, *ROUTING_KEYS, "num_mtp_layers")
    assumed = {"attention_bias": False, "rope_interleave": True}
    # pretraining_tp: transformers 5 ignores it; num_key_value_heads: MLA expands the latent into every head's key
    # and value (transformers' SDPA attention reads the head count from them)
    inert_keys = (*INERT_KEYS, "pretraining_tp", "num_key_value_heads", *MOE_INERT_KEYS)

    def shape(self, hf: Mapping[str, Any], where: Path) -> dict[str, Any]:
        get = hf_config.getter(hf, where)
        heads = get("num_attention_heads")
        layers = get("num_hidden_layers")
        q_rank = hf.get("q_lora_rank")
        return {
            "num_layers": layers,
            "hidden_size": get("hidden_size"),
            "ffn_hidden_size": get("intermediate_size"),
            "num_attention_heads": heads,
            "num_query_groups": heads,
            "kv_channels": get("v_head_dim"),
            "vocab_size": get("vocab_size"),
            "q_lora_rank": None if q_rank is None else int(q_rank),
            "kv_lora_rank": get("kv_lora_rank"),
            "qk_head_dim": get("qk_nope_head_dim"),
            "qk_pos_emb_head_dim": get("qk_rope_head_dim"),
            "v_head_dim": get("v_head_dim"),
        }

    def check(self, hf: Mapping[str, Any], where: Path) -> None:
        if hf.get("attention_bias"):
            unsupported(where, "attention_bias: megatron-core's MLA has no biases on its projections")
        if not hf.get("rope_interleave", True):
            unsupported(where, "rope_interleave false: megatron-core's MLA rotates the even and odd channels of the "
                               "RoPE part (transformers' rope_interleave true)")

    def position_fields(self, hf: Mapping[str, Any], where: Path) -> dict[str, Any]:
        """megatron-core's MLA RoPE fields (its own ``rope_type`` and YaRN fields, not ``position_embedding_type``)."""
        self.rotary_percent(hf, where)
        theta = hf_config.rope_theta(hf, where, 10_000.0)
        plain = {"rope_type": "rope", "rotary_base": theta, "rotary_percent": 1.0, "rope_scaling": False,
                 "rotary_scaling_factor": 1.0,
                 "original_max_position_embeddings": int(hf.get("max_position_embeddings") or 4096),
                 "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 0.0}
        if not yarn.is_yarn(hf):
            hf_config.rope(hf, where, "megatron-core's MLA has plain and YaRN RoPE only. ")
            return plain
        parameters = hf_config.rope_settings(hf)
        # yarn.model_fields refuses what transformers' YaRN table and megatron-core's differ in
        table = yarn.model_fields(hf, where, default_theta=10_000.0)
        if not table["yarn_correction_range_round_to_int"]:
            unsupported(where, "yarn truncate false: megatron-core's MLA rounds YaRN's band to whole dimensions")
        # transformers scales cos/sin by the mscale ratio only when both are set, else by 0.1 ln(factor) + 1, and
        # the softmax by mscale_all_dim's squared whenever it is set; megatron-core's MLA by the two fields always
        mscale_all_dim = parameters.get("mscale_all_dim") or 0.0
        if mscale_all_dim and not parameters.get("mscale"):
            unsupported(where, f"yarn mscale_all_dim {mscale_all_dim} without mscale: megatron-core's MLA scales "
                               "cos/sin by the mscale ratio")
        return {**plain, "rope_type": "yarn", "rotary_scaling_factor": table["yarn_rotary_scaling_factor"],
                "original_max_position_embeddings": table["yarn_original_max_position_embeddings"],
                "beta_fast": table["yarn_beta_fast"], "beta_slow": table["yarn_beta_slow"],
                "mscale": float(parameters["mscale"]) if mscale_all_dim else 1.0,
                "mscale_all_dim": float(mscale_all_dim)}

    # model fields -> config.json

    def differences(self, model: Mapping[str, Any]) -> list[str]:
        out = super().differences(model)
        if model.get("apply_rope_fusion"):
            out.append("model.apply_rope_fusion=True")
        return out

    def hf_config(self, model: Mapping[str, Any]) -> dict[str, Any]:
        config = {key: value for key, value in super().hf_config(model).items()
                  if key not in ("head_dim", "mlp_bias", "rope_scaling")}
        return {**config, "num_key_value_heads": model["num_attention_heads"],
                "q_lora_rank": model["q_lora_rank"], "kv_lora_rank": model["kv_lora_rank"],
                "qk_nope_head_dim": model["qk_head_dim"], "qk_rope_head_dim": model["qk_pos_emb_head_dim"],
                "v_head_dim": model["v_head_dim"], "rope_interleave": True,
                "rope_scaling": self.hf_rope_scaling(model)}

    def hf_rope_scaling(self, model: Mapping[str, Any]) -> Optional[dict[str, Any]]:
        if model.get("rope_type", "yarn") != "yarn":
            return None
        mscale_all_dim = model["mscale_all_dim"]
        return {"rope_type": "yarn", "factor": model["rotary_scaling_factor"],
                "original_max_position_embeddings": model["original_max_position_embeddings"],
                "beta_fast": model["beta_fast"], "beta_slow": model["beta_slow"],
                **({"mscale": model["mscale"], "mscale_all_dim": mscale_all_dim} if mscale_all_dim else {})}

    def hf_extras(self, model: Mapping[str, Any]) -> dict[str, Any]:
        return {"attention_bias": False, **self.layer_config(model), **self.routing_config(model)}

    # tensors

    def attention_pairs(self, arch: Architecture, m: str, p: str) -> list[Pair]:
        mla, h = arch.mla, arch.hidden_size
        n, q_head = arch.num_attention_heads, mla.qk_head_dim + mla.qk_pos_emb_head_dim
        if mla.q_lora_rank is None:
            out = [Pair(m + "linear_q_proj.weight", ((p + "q_proj.weight", (n * q_head, h)),))]
        else:
            r = mla.q_lora_rank
            out = [Pair(m + "linear_q_down_proj.weight", ((p + "q_a_proj.weight", (r, h)),)),
                   Pair(m + "q_layernorm.weight", ((p + "q_a_layernorm.weight", (r,)),)),
                   Pair(m + "linear_q_up_proj.weight", ((p + "q_b_proj.weight", (n * q_head, r)),))]
        kv = mla.kv_lora_rank
        return out + [
            Pair(m + "linear_kv_down_proj.weight", ((p + "kv_a_proj_with_mqa.weight", (kv + mla.qk_pos_emb_head_dim, h)),)),
            Pair(m + "kv_layernorm.weight", ((p + "kv_a_layernorm.weight", (kv,)),)),
            Pair(m + "linear_kv_up_proj.weight", ((p + "kv_b_proj.weight", (n * (mla.qk_head_dim + mla.v_head_dim), kv)),)),
            Pair(m + "linear_proj.weight", ((p + "o_proj.weight", (h, n * mla.v_head_dim)),))]
