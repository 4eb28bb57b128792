"""DeepSeek-V2's layout (``DeepseekV2ForCausalLM``: DeepSeek-V2, V2-Chat, V2-Lite, DeepSeek-Coder-V2): DeepSeek-V3's
multi-latent attention, dense first layers and tensors (:mod:`~bridge_cli.convert.families.deepseek_v3`), with
DeepSeek-V2's router and no multi-token-prediction layers. No torch import.

transformers' router (``DeepseekV2TopkRouter``): fp32 logits, the softmax over all experts, top-k (``topk_method``
``greedy``) or top-k within the ``topk_group`` groups of the highest score (``group_limited_greedy``: a group scores
its best expert), times ``routed_scaling_factor``, never renormalised. That is megatron-core's softmax router with
``moe_router_pre_softmax: true`` and ``moe_router_dtype: fp32``; its group-limited top-k scores a group by the sum of
its top ``moe_router_topk // moe_router_group_topk`` experts, which is the best one exactly where that quotient is 1.

transformers' RoPE rotates adjacent channel pairs as complex numbers and keeps them in place; DeepSeek-V3's
``rope_interleave`` takes the even then the odd channels first. Both rotate the same pairs by the same angles in query
and key alike, so the attention scores, and megatron-core's MLA RoPE, are the same.

DeepSeek's own code (the releases' ``trust_remote_code`` model) reads keys transformers' class does not have:
``aux_loss_alpha`` and ``seq_aux`` (its balance loss, megatron-core's ``moe_aux_loss_coeff`` with
``moe_router_load_balancing_type`` ``seq_aux_loss`` or ``aux_loss``: training only), ``moe_layer_freq`` (an MoE layer
every that many, which transformers ignores: 1 in every release, assumed) and ``scoring_func`` (softmax, assumed).
It renormalises the top-k weights with ``norm_topk_prob``, which transformers ignores: false in every release,
assumed, so both agree.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

from bridge_cli.convert import hf_config
from bridge_cli.convert.families.deepseek_moe import ROUTED
from bridge_cli.convert.families.deepseek_v3 import DENSE_FIXED, MLA_KEYS, DeepseekV3
from bridge_cli.convert.families.llama_like import INERT_KEYS
from bridge_cli.convert.families.moe import MOE_INERT_KEYS, moe_fixed
from bridge_cli.convert.hf_config import unsupported

ROUTING_KEYS = ("n_routed_experts", "num_experts_per_tok", "moe_intermediate_size", "n_shared_experts",
                "routed_scaling_factor", "topk_method", "n_group", "topk_group", "aux_loss_alpha", "seq_aux")
"""The config.json keys of the MoE layers that the family reads (the last two DeepSeek's code's, not transformers')."""
TOPK_METHODS = ("greedy", "group_limited_greedy")
"""transformers' DeepSeek-V2 routers."""


class DeepseekV2(DeepseekV3):
    model_type = "deepseek_v2"
    architecture = "DeepseekV2ForCausalLM"
    models = ("DeepSeek-V2, V2-Chat, V2-Lite, DeepSeek-Coder-V2: multi-latent attention (q_lora_rank set or null, YaRN "
              "with mscale/mscale_all_dim), dense first layers, MoE layers with the softmax router (greedy, or "
              "group-limited where it picks as many experts as groups or fewer than twice as many), "
              "routed_scaling_factor, shared experts, DeepSeek's sequence balance loss")
    limits = ("attention_bias, mlp_bias, RoPE scalings other than yarn, YaRN truncate false or mscale_all_dim without "
              "mscale; topk_method other than greedy and group_limited_greedy, group_limited_greedy with "
              "num_experts_per_tok // topk_group other than 1 (megatron-core scores a group by the sum of its top "
              "num_experts_per_tok // topk_group experts, transformers by its best), norm_topk_prob true, "
              "moe_layer_freq other than 1, scoring_func other than softmax")
    fixed = {key: value for key, value in moe_fixed(DENSE_FIXED, moe_router_pre_softmax=True).items()
             if key not in ROUTED}
    mapped_keys = (*MLA_KEYS, *ROUTING_KEYS)
    mtp = False
    assumed = {"attention_bias": False, "mlp_bias": False, "norm_topk_prob": False, "moe_layer_freq": 1,
               "scoring_func": "softmax"}
    # head_dim: the config class sets it to qk_rope_head_dim whatever config.json says; pretraining_tp:
    # transformers 5 ignores it; num_key_value_heads: MLA expands the latent into every head's key and value
    inert_keys = (*INERT_KEYS, "pretraining_tp", "num_key_value_heads", "head_dim", *MOE_INERT_KEYS)

    def router_fields(self, hf: Mapping[str, Any], where: Path, topk: int) -> dict[str, Any]:
        get = hf_config.getter(hf, where)
        experts, shared = get("n_routed_experts"), hf.get("n_shared_experts")
        method = hf.get("topk_method") or "greedy"
        if method not in TOPK_METHODS:
            hint = " (DeepSeek-V3's sigmoid router: convert it as deepseek_v3)" if method == "noaux_tc" else ""
            unsupported(where, f"topk_method {method!r}{hint}: transformers' DeepSeek-V2 routes with "
                               f"{' or '.join(TOPK_METHODS)}")
        if hf.get("norm_topk_prob"):
            unsupported(where, "norm_topk_prob true: transformers' DeepSeek-V2 router does not renormalise the top-k "
                               "weights and DeepSeek's own code does, so the two models differ")
        scale = hf.get("routed_scaling_factor")
        if not isinstance(scale, (int, float)) or scale <= 0:
            unsupported(where, f"routed_scaling_factor {scale!r}: a positive number is needed")
        if not isinstance(shared, int) or shared < 1:
            unsupported(where, f"n_shared_experts {shared!r}: transformers' DeepSeek-V2 MoE layer has at least one")
        alpha = hf.get("aux_loss_alpha") or 0.0
        fields = {"moe_router_score_function": "softmax", "moe_router_pre_softmax": True,
                  "moe_router_enable_expert_bias": False, "moe_router_dtype": "fp32",
                  "moe_router_topk_scaling_factor": float(scale), "moe_router_num_groups": None,
                  "moe_router_group_topk": None, "moe_aux_loss_coeff": float(alpha),
                  "moe_router_load_balancing_type": "seq_aux_loss" if hf.get("seq_aux") else "aux_loss",
                  "moe_shared_expert_intermediate_size": shared * get("moe_intermediate_size")}
        groups = hf.get("n_group") or 1
        if method == "greedy" or groups == 1:  # transformers' greedy router ignores n_group and topk_group
            return fields
        group_topk = get("topk_group")
        if experts % groups or not isinstance(group_topk, int) or not 1 <= group_topk <= groups:
            unsupported(where, f"n_group {groups}, topk_group {group_topk!r} with {experts} experts: n_group must "
                               "divide n_routed_experts, and topk_group be 1 to n_group")
        if topk // group_topk != 1:
            unsupported(where, f"topk_method group_limited_greedy with num_experts_per_tok {topk} and topk_group "
                               f"{group_topk}: transformers scores a group by its best expert, megatron-core by the "
                               f"sum of its top num_experts_per_tok // topk_group ({topk // group_topk}), so that "
                               "quotient must be 1")
        if group_topk * (experts // groups) < topk:
            unsupported(where, f"topk_group {group_topk} groups of {experts // groups} experts hold fewer than "
                               f"num_experts_per_tok ({topk}): transformers then picks experts outside them")
        return {**fields, "moe_router_num_groups": groups, "moe_router_group_topk": group_topk}

    def check(self, hf: Mapping[str, Any], where: Path) -> None:
        if hf.get("attention_bias") or hf.get("mlp_bias"):
            unsupported(where, "attention_bias/mlp_bias: megatron-core's MLA and MLPs have no biases")
        freq = hf.get("moe_layer_freq", 1)
        if freq != 1:
            unsupported(where, f"moe_layer_freq {freq!r}: transformers makes every layer from first_k_dense_replace "
                               "on an MoE layer, DeepSeek's own code every moe_layer_freq-th, so the two differ")
        if hf.get("scoring_func", "softmax") != "softmax":
            unsupported(where, f"scoring_func {hf['scoring_func']!r}: DeepSeek-V2's router takes the softmax")

    # model fields -> config.json

    def differences(self, model: Mapping[str, Any]) -> list[str]:
        out = super().differences(model)
        if model.get("num_moe_experts"):
            topk, groups = model["moe_router_topk"], model.get("moe_router_group_topk")
            if groups and topk // groups != 1:
                out.append(f"model.moe_router_group_topk={groups}")
            balancing = model.get("moe_router_load_balancing_type")
            if balancing not in ("aux_loss", "seq_aux_loss", "none"):
                out.append(f"model.moe_router_load_balancing_type={balancing}")
        return out

    def hf_config(self, model: Mapping[str, Any]) -> dict[str, Any]:
        return {key: value for key, value in super().hf_config(model).items()
                if key != "rope_interleave"}

    def hf_extras(self, model: Mapping[str, Any]) -> dict[str, Any]:
        if not model.get("num_moe_experts"):
            return {"attention_bias": False, **self.layer_config(model)}
        expert, groups = model["moe_ffn_hidden_size"], model.get("moe_router_num_groups")
        config = {key: value for key, value in self.moe_config(model).items() if key != "router_aux_loss_coef"}
        coeff = model.get("moe_aux_loss_coeff")
        return {"attention_bias": False, **self.layer_config(model), **config, "moe_intermediate_size": expert,
                "n_shared_experts": model["moe_shared_expert_intermediate_size"] // expert,
                "routed_scaling_factor": float(model.get("moe_router_topk_scaling_factor") or 1.0),
                "topk_method": "group_limited_greedy" if groups else "greedy",
                "n_group": groups or 1, "topk_group": model.get("moe_router_group_topk") or 1,
                "norm_topk_prob": False, "aux_loss_alpha": float(coeff) if isinstance(coeff, (int, float)) else 0.0,
                "seq_aux": model.get("moe_router_load_balancing_type") == "seq_aux_loss"}
