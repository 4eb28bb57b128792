"""What DeepSeek-V3's layout and the families that took its mixture of experts (GLM-4.5's ``glm4_moe``) share,
whatever their attention: dense MLPs in the first ``first_k_dense_replace`` layers and MoE layers after them, the
sigmoid router with its expert bias, and the Hub's multi-token-prediction layers. No torch import.

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
from typing import Any, Collection, Mapping

from bridge_cli.convert import hf_config
from bridge_cli.convert.families.llama_like import LlamaLike
from bridge_cli.convert.families.moe import MoELike, moe_fixed
from bridge_cli.convert.hf_config import unsupported
from bridge_cli.convert.hf_weights import Architecture, Layout, Pair, moe_layer_pattern

ROUTING_KEYS = ("n_routed_experts", "num_experts_per_tok", "moe_intermediate_size", "n_shared_experts",
                "routed_scaling_factor", "n_group", "topk_group", "norm_topk_prob")
"""The config.json keys of the MoE layers that the families read (``first_k_dense_replace`` too, with the dense
layers' keys)."""
ROUTED = {"moe_router_num_groups", "moe_router_group_topk", "moe_router_topk_scaling_factor",
          "moe_shared_expert_intermediate_size"}
"""MoE fields config.json sets (MOE_FIXED fixes them for the other MoE families)."""


def sigmoid_router_fixed(dense: Mapping[str, Any]) -> dict[str, Any]:
    """The fixed fields of a family whose attention and dense layers fix ``dense`` and whose MoE layers are
    DeepSeek-V3's (the router's sigmoid scores and expert bias; config.json sets the rest of the router)."""
    return {key: value for key, value in moe_fixed(dense, moe_router_score_function="sigmoid",
                                                   moe_router_enable_expert_bias=True).items() if key not in ROUTED}


class DeepSeekMoE(MoELike):
    """The MoE layers, router and MTP layers of DeepSeek-V3's layout; a family adds its attention."""

    experts_key = "n_routed_experts"
    all_layers_moe = False
    mtp = True
    """Whether the family's releases may hold multi-token-prediction layers (DeepSeek-V2's and dots.llm1's do not)."""

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
        if not self.mtp or not depth or f"{self.hf_layers}.{layers}.eh_proj.weight" not in tensors:
            return {"mtp_num_layers": None}
        dense = hf.get("first_k_dense_replace")
        if layers <= dense < layers + depth:
            unsupported(where, f"first_k_dense_replace {dense} with {layers} layers and {depth} multi-token-prediction "
                               "layers: the MTP layers past it are MoE layers, megatron-core builds every MTP "
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
            unsupported(where, f"n_shared_experts {shared!r}: transformers' {self.model_type} MoE layer has at least "
                               "one")
        return {**fields, "moe_shared_expert_intermediate_size": shared * get("moe_intermediate_size")}

    # model fields -> config.json

    def differences(self, model: Mapping[str, Any]) -> list[str]:
        extra_mtp = not self.mtp and model.get("mtp_num_layers")
        mtp = [f"model.mtp_num_layers={model['mtp_num_layers']}"] if extra_mtp else []
        if not model.get("num_moe_experts"):  # a dense model: the router's fields do not matter
            return [line for line in LlamaLike.differences(self, model) if not line.startswith("model.moe_")] + mtp
        out = super().differences(model) + mtp
        pattern = moe_layer_pattern(model.get("moe_layer_freq", 1), model["num_layers"])
        if list(pattern) != sorted(pattern):  # the dense layers come first
            out.append(f"model.moe_layer_freq={model.get('moe_layer_freq')}")
        if not model.get("moe_shared_expert_intermediate_size"):
            out.append("model.moe_shared_expert_intermediate_size=None")
        return out

    def layer_config(self, model: Mapping[str, Any]) -> dict[str, Any]:
        """config.json's keys of where the MoE layers start and of the MTP layers (where the family has them)."""
        layers = model["num_layers"]
        pattern = moe_layer_pattern(model.get("moe_layer_freq", 1), layers) if model.get("num_moe_experts") else ()
        mtp = {"num_nextn_predict_layers": model.get("mtp_num_layers") or 0} if self.mtp else {}
        return {"first_k_dense_replace": layers - sum(pattern), **mtp}

    def routing_config(self, model: Mapping[str, Any]) -> dict[str, Any]:
        """config.json's keys of the MoE layers' experts and router (none for a model of dense layers only)."""
        if not model.get("num_moe_experts"):
            return {}
        expert = model["moe_ffn_hidden_size"]
        return {**self.moe_config(model), "moe_intermediate_size": expert,
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
