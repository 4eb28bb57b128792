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

The router is megatron-core's with ``moe_router_score_function: sigmoid`` on fp32 logits (``moe_router_dtype:
fp32``), ``e_score_correction_bias`` as its expert bias (``router.expert_bias``, which only chooses the experts),
group-limited top-k (``n_group``/``topk_group`` as ``moe_router_num_groups``/``moe_router_group_topk``: both score
a group by the sum of its top two experts where ``num_experts_per_tok / topk_group`` is 2, megatron-core's rule),
the chosen scores renormalised (``norm_topk_prob``) and times ``routed_scaling_factor``
(``moe_router_topk_scaling_factor``); the ``n_shared_experts`` shared experts are one shared expert of their summed
FFN size, added without a gate.

The ``num_nextn_predict_layers`` multi-token-prediction layers of a Hub checkpoint (``model.layers.<num_hidden_layers
+ k>``, which transformers' model does not build, so its own saves leave them out) are megatron-core's MTP block
(``mtp_num_layers``): ``enorm``, ``hnorm``, ``eh_proj`` (embedding half first, as both concatenate) and
``shared_head.norm`` are ``mtp.layers.<k>.``'s ``enorm``, ``hnorm``, ``eh_proj`` and ``final_layernorm``, the rest a
decoder layer's tensors under ``transformer_layer``, which megatron-core builds like the decoder's last. Each layer's
``embed_tokens`` and ``shared_head.head`` are copies of the model's embedding and output head, which megatron-core's
MTP block shares: import checks they are equal, export writes them back.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Collection, Mapping, Optional

from bridge_cli.convert import hf_config, yarn
from bridge_cli.convert.families.llama_like import INERT_KEYS, LLAMA_STYLE, LlamaLike
from bridge_cli.convert.families.moe import MOE_INERT_KEYS, MoELike, moe_fixed
from bridge_cli.convert.hf_config import unsupported
from bridge_cli.convert.hf_weights import Architecture, Layout, Pair, moe_layer_pattern

MLA_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
            "max_position_embeddings", "hidden_act", "rms_norm_eps", "tie_word_embeddings", "rope_parameters",
            "attention_dropout", "initializer_range", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim",
            "qk_rope_head_dim", "v_head_dim", "first_k_dense_replace")
"""The config.json keys of the attention and the dense layers that the family reads into the model's fields."""
ROUTING_KEYS = ("n_routed_experts", "num_experts_per_tok", "moe_intermediate_size", "n_shared_experts",
                "routed_scaling_factor", "n_group", "topk_group", "norm_topk_prob")
"""The config.json keys of the MoE layers that the family reads."""
DENSE_FIXED = {**LLAMA_STYLE, "add_qkv_bias": False, "multi_latent_attention": True, "qk_layernorm": True}
"""The fixed fields of the attention and the dense layers."""
ROUTED = {"moe_router_num_groups", "moe_router_group_topk", "moe_router_topk_scaling_factor",
          "moe_shared_expert_intermediate_size"}
"""MoE fields config.json sets (MOE_FIXED fixes them for the other MoE families)."""


class DeepseekV3(MoELike):
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
    fixed = {key: value for key, value in moe_fixed(DENSE_FIXED, moe_router_score_function="sigmoid",
                                                    moe_router_enable_expert_bias=True).items()
             if key not in ROUTED}
    # num_mtp_layers (config.json's num_nextn_predict_layers): mtp_num_layers where the folder holds those layers
    mapped_keys = (*MLA_KEYS, *ROUTING_KEYS, "num_mtp_layers")
    assumed = {"attention_bias": False, "rope_interleave": True}
    # pretraining_tp: transformers 5 ignores it; num_key_value_heads: MLA expands the latent into every head's key
    # and value (transformers' SDPA attention reads the head count from them)
    inert_keys = (*INERT_KEYS, "pretraining_tp", "num_key_value_heads", *MOE_INERT_KEYS)
    experts_key = "n_routed_experts"
    all_layers_moe = False

    def fields(self, hf: Mapping[str, Any], where: Path, seq_length=None) -> dict[str, Any]:
        if any(self.moe_layers(hf, where, hf_config.getter(hf, where)("num_hidden_layers"))):
            return super().fields(hf, where, seq_length)
        # every layer dense: the Llama layout's fields, none of the router's
        dense = LlamaLike.fields(self, hf, where, seq_length)
        return {key: value for key, value in dense.items() if not key.startswith("moe_")}

    def tensor_fields(self, hf: Mapping[str, Any], where: Path, fields: Mapping[str, Any],
                      tensors: Collection[str]) -> dict[str, Any]:
        """``mtp_num_layers``: config.json's ``num_nextn_predict_layers`` where the folder holds those layers (the
        Hub's releases), else none (transformers' saves, which drop them)."""
        depth, layers = hf.get("num_nextn_predict_layers") or 0, fields["num_layers"]
        if not depth or f"{self.hf_layers}.{layers}.eh_proj.weight" not in tensors:
            return {"mtp_num_layers": None}
        dense = hf.get("first_k_dense_replace")
        if layers <= dense < layers + depth:
            unsupported(where, f"first_k_dense_replace {dense} with {layers} layers and {depth} multi-token-prediction "
                               "layers: DeepSeek's MTP layers past it are MoE layers, megatron-core builds every MTP "
                               "layer like the decoder's last, a dense one")
        return {"mtp_num_layers": depth}

    def moe_layers(self, hf: Mapping[str, Any], where: Path, num_layers: int) -> list[bool]:
        dense = hf.get("first_k_dense_replace")
        if not isinstance(dense, int) or dense < 0:
            unsupported(where, f"first_k_dense_replace {dense!r}: a count of layers (0 or more) is needed")
        return [i >= dense for i in range(num_layers)]

    def router_fields(self, hf: Mapping[str, Any], where: Path, topk: int) -> dict[str, Any]:
        get = hf_config.getter(hf, where)
        experts, groups, shared = get("n_routed_experts"), hf.get("n_group") or 1, hf.get("n_shared_experts")
        if topk > 1 and not hf.get("norm_topk_prob"):
            unsupported(where, "norm_topk_prob false: megatron-core renormalises the chosen sigmoid scores")
        if topk == 1 and hf.get("norm_topk_prob"):
            unsupported(where, "norm_topk_prob with num_experts_per_tok 1 (each token's expert weighs "
                               "routed_scaling_factor)", "megatron-core's sigmoid router at top-1 keeps the score.")
        scale = hf.get("routed_scaling_factor")
        if not isinstance(scale, (int, float)) or scale <= 0:
            unsupported(where, f"routed_scaling_factor {scale!r}: a positive number is needed")
        fields = {"moe_router_score_function": "sigmoid", "moe_router_enable_expert_bias": True,
                  "moe_router_dtype": "fp32", "moe_router_topk_scaling_factor": float(scale),
                  "moe_router_num_groups": None, "moe_router_group_topk": None}
        if groups > 1:
            group_topk = get("topk_group")
            if experts % groups or topk % group_topk or topk // group_topk != 2:
                unsupported(where, f"n_group {groups}, topk_group {group_topk} with {experts} experts, top-{topk}: "
                                   "transformers scores a group by its top two experts, megatron-core by its top "
                                   "num_experts_per_tok / topk_group, so that ratio must be 2 (and n_group divide "
                                   "n_routed_experts)")
            fields.update(moe_router_num_groups=groups, moe_router_group_topk=group_topk)
        if not isinstance(shared, int) or shared < 1:
            unsupported(where, f"n_shared_experts {shared!r}: transformers' DeepSeek-V3 MoE layer has at least one")
        return {**fields, "moe_shared_expert_intermediate_size": shared * get("moe_intermediate_size")}

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
        if model.get("num_moe_experts"):
            out = super().differences(model)
            pattern = moe_layer_pattern(model.get("moe_layer_freq", 1), model["num_layers"])
            if list(pattern) != sorted(pattern):  # DeepSeek's dense layers come first
                out.append(f"model.moe_layer_freq={model.get('moe_layer_freq')}")
            if not model.get("moe_shared_expert_intermediate_size"):
                out.append("model.moe_shared_expert_intermediate_size=None")
        else:  # a dense model: the router's fields do not matter
            out = [line for line in LlamaLike.differences(self, model) if not line.startswith("model.moe_")]
        if model.get("apply_rope_fusion"):
            out.append("model.apply_rope_fusion=True")
        return out

    def hf_config(self, model: Mapping[str, Any]) -> dict[str, Any]:
        config = {key: value for key, value in super().hf_config(model).items()
                  if key not in ("head_dim", "mlp_bias", "rope_scaling")}
        layers = model["num_layers"]
        pattern = moe_layer_pattern(model.get("moe_layer_freq", 1), layers) if model.get("num_moe_experts") else ()
        return {**config, "num_key_value_heads": model["num_attention_heads"],
                "q_lora_rank": model["q_lora_rank"], "kv_lora_rank": model["kv_lora_rank"],
                "qk_nope_head_dim": model["qk_head_dim"], "qk_rope_head_dim": model["qk_pos_emb_head_dim"],
                "v_head_dim": model["v_head_dim"], "first_k_dense_replace": layers - sum(pattern),
                "rope_interleave": True, "rope_scaling": self.hf_rope_scaling(model),
                "num_nextn_predict_layers": model.get("mtp_num_layers") or 0}

    def hf_rope_scaling(self, model: Mapping[str, Any]) -> Optional[dict[str, Any]]:
        if model.get("rope_type", "yarn") != "yarn":
            return None
        mscale_all_dim = model["mscale_all_dim"]
        return {"rope_type": "yarn", "factor": model["rotary_scaling_factor"],
                "original_max_position_embeddings": model["original_max_position_embeddings"],
                "beta_fast": model["beta_fast"], "beta_slow": model["beta_slow"],
                **({"mscale": model["mscale"], "mscale_all_dim": mscale_all_dim} if mscale_all_dim else {})}

    def hf_extras(self, model: Mapping[str, Any]) -> dict[str, Any]:
        if not model.get("num_moe_experts"):
            return {"attention_bias": False}
        expert = model["moe_ffn_hidden_size"]
        return {"attention_bias": False, **self.moe_config(model), "moe_intermediate_size": expert,
                "n_shared_experts": model["moe_shared_expert_intermediate_size"] // expert,
                "routed_scaling_factor": float(model.get("moe_router_topk_scaling_factor") or 1.0),
                "n_group": model.get("moe_router_num_groups") or 1, "topk_group": model.get("moe_router_group_topk") or 1,
                "norm_topk_prob": True}

    # tensors

    def pairs(self, arch: Architecture) -> list[Pair]:
        """The Llama layout's, and the multi-token-prediction layers' between the final norm and the output layer
        (megatron-core's order); their copies of the embedding and output head go with the model's."""
        out = super().pairs(arch)
        if not arch.mtp_layers:
            return out
        hf = [f"{self.hf_layers}.{arch.num_layers + k}." for k in range(arch.mtp_layers)]
        embeds, heads = [p + "embed_tokens.weight" for p in hf], [p + "shared_head.head.weight" for p in hf]
        embedding, *body = out
        output = [] if arch.tied else [body.pop()]
        mtp = [pair for k, p in enumerate(hf) for pair in self.mtp_pairs(arch, f"mtp.layers.{k}.", p)]
        return [self.shared(embedding, embeds + (heads if arch.tied else []), arch), *body, *mtp,
                *(self.shared(pair, heads, arch) for pair in output)]

    @staticmethod
    def shared(pair: Pair, copies: list[str], arch: Architecture) -> Pair:
        """``pair`` (the embedding or the output layer) with the Hugging Face ``copies`` of its tensor."""
        return Pair(pair.mcore, (*pair.hf, *((name, (arch.vocab_size, arch.hidden_size)) for name in copies)),
                    Layout.SHARED)

    def mtp_pairs(self, arch: Architecture, m: str, p: str) -> list[Pair]:
        """One multi-token-prediction layer: megatron-core names under ``m``, Hugging Face's under ``p``; its
        transformer layer is built like the decoder's last."""
        h = arch.hidden_size
        return [*self.norm_pairs(arch, m + "enorm", p + "enorm"), *self.norm_pairs(arch, m + "hnorm", p + "hnorm"),
                Pair(m + "eh_proj.weight", ((p + "eh_proj.weight", (h, 2 * h)),)),
                *self.layer_pairs(arch, arch.num_layers - 1, m + "transformer_layer.", p),
                *self.norm_pairs(arch, m + "final_layernorm", p + "shared_head.norm")]

    def feed_forward_pairs(self, arch: Architecture, layer: int, m: str, p: str) -> list[Pair]:
        if not arch.num_experts:  # every layer dense
            return self.mlp_pairs(arch, m, p)
        return super().feed_forward_pairs(arch, layer, m, p)

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
