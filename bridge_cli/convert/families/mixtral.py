"""``mixtral``: Mistral's layout with every MLP a mixture of experts."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

from bridge_cli.convert import hf_config
from bridge_cli.convert.families.mistral import Mistral
from bridge_cli.convert.families.moe import MOE_INERT_KEYS, MOE_KEYS, MoELike, moe_fixed


class Mixtral(MoELike, Mistral):
    """Mixtral 8x7B and 8x22B: ``block_sparse_moe`` with experts ``w1`` (gate), ``w3`` (up), ``w2``
    (down) of FFN size ``intermediate_size``; softmax over the experts, top-k, renormalised
    (megatron-core's softmax after the top-k). A sliding window in every layer, as Mistral's."""

    model_type = "mixtral"
    architecture = "MixtralForCausalLM"
    models = "Mixtral 8x7B, 8x22B; every layer MoE, softmax routing renormalised over the top-k"
    limits = "refuses router_jitter_noise and RoPE scalings other than llama3 and yarn"
    sparse_block = "block_sparse_moe."
    expert_projections = ("w1", "w3", "w2")
    experts_key = "num_local_experts"
    mapped_keys = (*Mistral.mapped_keys, "num_local_experts", *MOE_KEYS)
    assumed = {**Mistral.assumed, "router_jitter_noise": 0.0}
    inert_keys = (*Mistral.inert_keys, *MOE_INERT_KEYS)
    fixed = moe_fixed(Mistral.fixed, moe_router_pre_softmax=False)

    def expert_ffn_size(self, hf: Mapping[str, Any], where: Path) -> int:
        return hf_config.getter(hf, where)("intermediate_size")

    def router_fields(self, hf: Mapping[str, Any], where: Path, topk: int) -> dict[str, Any]:
        return super().router_fields({**hf, "norm_topk_prob": True}, where, topk)

    def hf_extras(self, model: Mapping[str, Any]) -> dict[str, Any]:
        return {**super().hf_extras(model), **self.moe_config(model), "intermediate_size": model["moe_ffn_hidden_size"],
                "router_jitter_noise": 0.0}
