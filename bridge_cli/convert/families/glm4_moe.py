"""``glm4_moe``: GLM-4.5 and GLM-4.6 (``Glm4MoeForCausalLM``): Llama's grouped-query attention with biases on q, k
and v where ``attention_bias`` says, per-head q/k RMSNorm where ``use_qk_norm`` says, RoPE on the first
``partial_rotary_factor`` of each head (its two halves, as Llama's: ``rotary_interleaved`` false), and DeepSeek-V3's
mixture of experts: dense first layers, the sigmoid router with its expert bias, shared experts, the Hub's
multi-token-prediction layers (:mod:`deepseek_moe`). No torch import."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

from bridge_cli.convert import hf_config
from bridge_cli.convert.families.deepseek_moe import ROUTING_KEYS, DeepSeekMoE, sigmoid_router_fixed
from bridge_cli.convert.families.llama_like import INERT_KEYS, LLAMA_KEYS, LLAMA_STYLE
from bridge_cli.convert.families.moe import MOE_INERT_KEYS
from bridge_cli.convert.hf_config import unsupported

FROM_CONFIG = ("add_qkv_bias", "qk_layernorm", "rotary_percent")
"""Model fields config.json sets here (``attention_bias``, ``use_qk_norm``, ``partial_rotary_factor``), which the Llama
layout fixes."""


class Glm4Moe(DeepSeekMoE):
    model_type = "glm4_moe"
    architecture = "Glm4MoeForCausalLM"
    models = ("GLM-4.5, GLM-4.5-Air, GLM-4.6: grouped-query attention with q/k/v biases and per-head q/k norms where "
              "config.json has them, RoPE on part of each head, dense first layers, MoE layers with the sigmoid "
              "router, expert bias and shared experts; the Hub's multi-token-prediction layers as megatron-core's "
              "MTP block")
    limits = ("refuses RoPE scalings, norm_topk_prob false (megatron-core renormalises sigmoid scores), "
              "num_experts_per_tok / topk_group other than 2 with n_group above 1, multi-token-prediction layers "
              "whose embed_tokens or shared_head.head differ from the model's")
    fixed = {key: value for key, value in sigmoid_router_fixed(LLAMA_STYLE).items() if key not in FROM_CONFIG}
    # num_mtp_layers (config.json's num_nextn_predict_layers): mtp_num_layers where the folder holds those layers
    mapped_keys = (*LLAMA_KEYS, *ROUTING_KEYS, "first_k_dense_replace", "attention_bias", "use_qk_norm",
                   "num_mtp_layers")
    assumed: dict = {}
    inert_keys = (*INERT_KEYS, *MOE_INERT_KEYS)

    def fields(self, hf: Mapping[str, Any], where: Path, seq_length=None) -> dict[str, Any]:
        return {**super().fields(hf, where, seq_length), "add_qkv_bias": bool(hf.get("attention_bias")),
                "qk_layernorm": bool(hf.get("use_qk_norm"))}

    def check(self, hf: Mapping[str, Any], where: Path) -> None:
        """Nothing beyond the router's and RoPE's refusals: the biases and q/k norms are switches here."""

    def rotary_percent(self, hf: Mapping[str, Any], where: Path) -> float:
        return hf_config.partial_rotary_factor(hf, where)

    def rope_fields(self, hf: Mapping[str, Any], where: Path) -> dict[str, Any]:
        kind = hf_config.rope_kind(hf_config.rope_settings(hf))
        if kind != "default":
            unsupported(where, f"RoPE scaling {kind!r}: bridge converts a glm4_moe model with plain RoPE, as GLM-4.5 "
                               "and 4.6 are released")
        return {"rotary_base": hf_config.rope_theta(hf, where, 10_000.0), "rope_scaling": False,
                "rope_scaling_factor": 8.0}

    # model fields -> config.json

    def differences(self, model: Mapping[str, Any]) -> list[str]:
        out = super().differences(model)
        if model.get("rope_scaling") or model.get("position_embedding_type") == "yarn":
            out.append("model.rope_scaling=True" if model.get("rope_scaling") else "model.position_embedding_type=yarn")
        return out

    def hf_extras(self, model: Mapping[str, Any]) -> dict[str, Any]:
        return {"partial_rotary_factor": model["rotary_percent"], "attention_bias": bool(model["add_qkv_bias"]),
                "use_qk_norm": bool(model["qk_layernorm"]), **self.layer_config(model), **self.routing_config(model)}
