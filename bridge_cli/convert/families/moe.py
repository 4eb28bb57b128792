"""What the mixture-of-experts families (mixtral, qwen3_moe, olmoe, deepseek_v3) share: the router
and experts of an MoE layer, as config fields and as tensors. No torch import.

A family is a subclass of :class:`MoELike` and of the dense family whose attention it has. Each MoE
layer of megatron-core holds ``mlp.router.weight`` (``[experts, hidden]``, Hugging Face's
``gate.weight``) and one gated MLP per expert (``mlp.experts.local_experts.<j>``); dense layers stay
the dense family's. The router is mapped exactly or refused:

- softmax over all experts, top-k, renormalised (Mixtral; ``norm_topk_prob=true``) is the softmax of
  the top-k logits: megatron-core's default ``moe_router_pre_softmax=false``;
- softmax, top-k, not renormalised (OLMoE, Qwen3-MoE's default) is ``moe_router_pre_softmax=true``;
- the gating GEMM runs in the model's dtype and the softmax in float32 in both, so
  ``moe_router_dtype`` stays unset (null).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

from bridge_cli.convert import hf_config
from bridge_cli.convert.families.llama_like import LlamaLike
from bridge_cli.convert.hf_config import unsupported
from bridge_cli.convert.hf_weights import Architecture, Layout, Pair

MOE_FIXED = {
    "moe_router_score_function": "softmax", "moe_router_topk_scaling_factor": None,
    "moe_router_enable_expert_bias": False, "moe_router_num_groups": None, "moe_router_group_topk": None,
    "moe_shared_expert_intermediate_size": None, "moe_shared_expert_gate": False,
    # token dropping and scaling the expert's input instead of its output change what a layer computes
    "moe_expert_capacity_factor": None, "moe_apply_probs_on_input": False,
}
"""The MoE fields every family here fixes, unless it overrides one."""

MOE_KEYS = ("num_experts_per_tok", "router_aux_loss_coef")
"""The config.json keys of routing every MoE family reads (besides its own names of the experts' count and sizes)."""
MOE_INERT_KEYS = ("output_router_logits",)
"""An MoE config.json key that leaves the logits alone (it adds the router's logits to the output)."""

EXPERT_COUNT_KEYS = ("num_experts", "num_local_experts")
"""config.json's names of the number of routed experts, which transformers treats as one."""


def moe_fixed(dense: Mapping[str, Any], **overrides: Any) -> dict[str, Any]:
    """The fixed fields of an MoE family whose dense layers and attention are those of ``dense``'s family."""
    return {**{key: value for key, value in dense.items() if key != "num_moe_experts"}, **MOE_FIXED, **overrides}


def gated_mlp(m: str, p: str, names: tuple[str, str, str], h: int, f: int) -> list[Pair]:
    """A SwiGLU MLP of FFN size ``f``: megatron-core's ``linear_fc1``/``linear_fc2`` under ``m``,
    Hugging Face's gate, up and down projections (``names``) under ``p``."""
    gate, up, down = names
    return [Pair(m + "linear_fc1.weight", ((f"{p}{gate}.weight", (f, h)), (f"{p}{up}.weight", (f, h))), Layout.GATE_UP),
            Pair(m + "linear_fc2.weight", ((f"{p}{down}.weight", (h, f)),))]


class MoELike(LlamaLike):
    """The MoE part of a family; subclasses set the attributes and override the hooks."""

    sparse_block = "mlp."
    """Hugging Face's name of a layer's MoE block."""
    expert_projections = ("gate_proj", "up_proj", "down_proj")
    """Hugging Face's names of an expert's gate, up and down projections."""
    experts_key = "num_experts"
    """config.json's key of the number of routed experts (export writes it; import reads it or an alias)."""
    all_layers_moe = True
    """Whether every layer of the family's models is an MoE layer (no dense layers)."""

    # config.json -> model fields

    def fields(self, hf: Mapping[str, Any], where: Path, seq_length=None) -> dict[str, Any]:
        fields = super().fields(hf, where, seq_length)
        get = hf_config.getter(hf, where)
        # transformers 5 maps num_experts and num_local_experts onto each other and saves either
        key = next((key for key in (self.experts_key, *EXPERT_COUNT_KEYS) if key in hf), self.experts_key)
        experts, topk = get(key), get("num_experts_per_tok")
        if topk > experts:
            unsupported(where, f"num_experts_per_tok ({topk}) is more than {key} ({experts})")
        if hf.get("router_jitter_noise"):
            unsupported(where, f"router_jitter_noise {hf['router_jitter_noise']}: transformers scales the experts' "
                               "input by the noise too, megatron-core's moe_input_jitter_eps only the router's")
        pattern = self.moe_layers(hf, where, fields["num_layers"])
        return {
            **fields,
            "num_moe_experts": experts,
            "moe_router_topk": topk,
            "moe_ffn_hidden_size": self.expert_ffn_size(hf, where),
            "moe_layer_freq": 1 if all(pattern) else [int(moe) for moe in pattern],
            "moe_router_load_balancing_type": "aux_loss",
            "moe_aux_loss_coeff": float(hf.get("router_aux_loss_coef") or 0.0),
            "moe_router_dtype": None,
            **self.router_fields(hf, where, topk),
        }

    def expert_ffn_size(self, hf: Mapping[str, Any], where: Path) -> int:
        """The FFN size of one routed expert."""
        return hf_config.getter(hf, where)("moe_intermediate_size")

    def moe_layers(self, hf: Mapping[str, Any], where: Path, num_layers: int) -> list[bool]:
        """Per layer, whether it is an MoE layer."""
        return [True] * num_layers

    def router_fields(self, hf: Mapping[str, Any], where: Path, topk: int) -> dict[str, Any]:
        """The router's fields: softmax, renormalised over the top-k or not (``norm_topk_prob``)."""
        if not hf.get("norm_topk_prob", False):
            return {"moe_router_pre_softmax": True}
        if topk == 1:
            unsupported(where, "norm_topk_prob with num_experts_per_tok 1 (each token's expert weighs 1)",
                        "megatron-core's softmax router at top-1 takes the softmax over all experts first.")
        return {"moe_router_pre_softmax": False}

    # model fields -> config.json

    def differences(self, model: Mapping[str, Any]) -> list[str]:
        out = super().differences(model)
        if not model.get("num_moe_experts"):
            out.append(f"model.num_moe_experts={model.get('num_moe_experts')}")
            return out
        balancing = model.get("moe_router_load_balancing_type")
        if "sinkhorn" in (balancing if isinstance(balancing, list) else [balancing]):
            out.append("model.moe_router_load_balancing_type=sinkhorn")
        freq = model.get("moe_layer_freq", 1)
        if self.all_layers_moe and freq != 1 and freq != [1] * model["num_layers"]:
            out.append(f"model.moe_layer_freq={freq}")
        return out

    def moe_config(self, model: Mapping[str, Any]) -> dict[str, Any]:
        """config.json's router keys that the families share."""
        coeff = model.get("moe_aux_loss_coeff")
        return {"num_experts_per_tok": model["moe_router_topk"], self.experts_key: model["num_moe_experts"],
                "router_aux_loss_coef": float(coeff) if isinstance(coeff, (int, float)) else 0.0,
                "output_router_logits": False}

    # tensors

    def feed_forward_pairs(self, arch: Architecture, layer: int, m: str, p: str) -> list[Pair]:
        if not arch.moe_layers[layer]:
            return self.mlp_pairs(arch, m, p)
        h, e = arch.hidden_size, arch.num_experts
        p = p.removesuffix("mlp.") + self.sparse_block
        out = [Pair(m + "router.weight", ((p + "gate.weight", (e, h)),))]
        if arch.expert_bias:
            out.append(Pair(m + "router.expert_bias", ((p + "gate.e_score_correction_bias", (e,)),)))
        for j in range(e):
            out += gated_mlp(f"{m}experts.local_experts.{j}.", f"{p}experts.{j}.", self.expert_projections, h,
                             arch.moe_ffn_hidden_size)
        if arch.shared_expert_size:
            out += gated_mlp(m + "shared_experts.", p + "shared_experts.", ("gate_proj", "up_proj", "down_proj"), h,
                             arch.shared_expert_size)
        return out
