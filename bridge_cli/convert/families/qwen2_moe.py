"""``qwen2_moe``: Qwen2's attention (biases on q, k and v) with mixture-of-experts MLPs that add a gated shared
expert."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

from bridge_cli.convert import hf_config
from bridge_cli.convert.families.moe import MOE_INERT_KEYS, MOE_KEYS, MoELike, gated_mlp, moe_fixed
from bridge_cli.convert.families.qwen2 import Qwen2
from bridge_cli.convert.families.qwen3_moe import qwen_moe_config, qwen_moe_layers
from bridge_cli.convert.families.windows import max_window_layers, qwen_layer_types
from bridge_cli.convert.hf_weights import Architecture, Pair


class Qwen2Moe(MoELike, Qwen2):
    """Qwen1.5-MoE-A2.7B and Qwen2-57B-A14B. Each MoE layer adds ``shared_expert`` (FFN size
    ``shared_expert_intermediate_size``) times ``sigmoid(shared_expert_gate(x))`` to the routed experts:
    megatron-core's shared experts with ``moe_shared_expert_gate`` (``gate_weight``). Dense layers and the
    router as Qwen3-MoE's."""

    model_type = "qwen2_moe"
    architecture = "Qwen2MoeForCausalLM"
    models = "Qwen1.5-MoE-A2.7B, Qwen2-57B-A14B; Qwen2 attention, a gated shared expert in every MoE layer"
    limits = "refuses RoPE scalings other than llama3 and yarn, and norm_topk_prob with top-1 routing"
    all_layers_moe = False
    mapped_keys = (*Qwen2.mapped_keys, "num_experts", "moe_intermediate_size", "shared_expert_intermediate_size",
                   "norm_topk_prob", "decoder_sparse_step", "mlp_only_layers", *MOE_KEYS)
    assumed = {"qkv_bias": True}
    inert_keys = (*Qwen2.inert_keys, *MOE_INERT_KEYS)
    fixed = {key: value for key, value in moe_fixed(Qwen2.fixed, moe_shared_expert_gate=True).items()
             if key != "moe_shared_expert_intermediate_size"}  # config.json's shared_expert_intermediate_size

    def fields(self, hf: Mapping[str, Any], where: Path, seq_length=None) -> dict[str, Any]:
        size = hf_config.getter(hf, where)("shared_expert_intermediate_size")
        return {**super().fields(hf, where, seq_length), "moe_shared_expert_intermediate_size": size}

    def layer_kinds(self, hf: Mapping[str, Any], count: int, where: Path) -> list[str]:
        # every other layer from the first, below max_window_layers (Qwen2's are those from it on)
        return qwen_layer_types(hf, count, where, lambda i: i % 2 == 0 and i < max_window_layers(hf, where))

    def moe_layers(self, hf: Mapping[str, Any], where: Path, num_layers: int) -> list[bool]:
        return qwen_moe_layers(hf, where, num_layers, "qwen2")

    def differences(self, model: Mapping[str, Any]) -> list[str]:
        out = super().differences(model)
        if model.get("num_moe_experts") and not model.get("moe_shared_expert_intermediate_size"):
            out.append("model.moe_shared_expert_intermediate_size=None")
        return out

    def hf_extras(self, model: Mapping[str, Any]) -> dict[str, Any]:
        return {**super().hf_extras(model), **self.moe_config(model), **qwen_moe_config(model), "qkv_bias": True,
                "shared_expert_intermediate_size": model["moe_shared_expert_intermediate_size"]}

    def feed_forward_pairs(self, arch: Architecture, layer: int, m: str, p: str) -> list[Pair]:
        if not arch.moe_layers[layer]:
            return self.mlp_pairs(arch, m, p)
        # MoELike's pairs name the shared expert as DeepSeek's checkpoints do (shared_experts.); Qwen's is singular
        routed = [pair for pair in super().feed_forward_pairs(arch, layer, m, p)
                  if not pair.mcore_names[0].startswith(m + "shared_experts.")]
        h = arch.hidden_size
        return [*routed, *gated_mlp(m + "shared_experts.", p + "shared_expert.", ("gate_proj", "up_proj", "down_proj"),
                                    h, arch.shared_expert_size),
                Pair(m + "shared_experts.gate_weight", ((p + "shared_expert_gate.weight", (1, h)),))]
