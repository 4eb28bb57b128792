"""``olmoe``: Llama's layout with an RMSNorm over each token's whole query and key projections, and
every MLP a mixture of experts."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

from bridge_cli.convert import hf_config
from bridge_cli.convert.families.llama_like import LlamaLike, across_heads_qk_norms
from bridge_cli.convert.families.moe import MOE_INERT_KEYS, MOE_KEYS, MoELike, moe_fixed
from bridge_cli.convert.hf_config import unsupported
from bridge_cli.convert.hf_weights import Architecture, Pair


class Olmoe(MoELike, LlamaLike):
    """OLMoE-1B-7B. ``q_norm``/``k_norm`` normalise all heads of a token's query (key) projection
    together, one weight per value: megatron-core's q/k norms with ``qk_layernorm_across_heads``
    (:mod:`bridge_cli.models.projection_norm`). Experts of FFN size ``intermediate_size``; the router is
    a softmax over the experts, top-k, renormalised only with ``norm_topk_prob``."""

    model_type = "olmoe"
    architecture = "OlmoeForCausalLM"
    models = "OLMoE-1B-7B (0924, 0125); q/k RMSNorm over the whole projection, every layer MoE"
    limits = ("refuses clip_qkv, attention_bias, RoPE scalings other than llama3 and yarn, and norm_topk_prob with "
              "top-1 routing; tensor parallelism needs num_key_value_heads to be a multiple of the TP size")
    mapped_keys = (*LlamaLike.mapped_keys, "num_experts", "norm_topk_prob", *MOE_KEYS)
    assumed = {**LlamaLike.assumed, "clip_qkv": None}
    inert_keys = (*LlamaLike.inert_keys, *MOE_INERT_KEYS)
    fixed = moe_fixed(LlamaLike.fixed, qk_layernorm=True, qk_layernorm_across_heads=True)

    def check(self, hf: Mapping[str, Any], where: Path) -> None:
        super().check(hf, where)
        if hf.get("clip_qkv") is not None:
            unsupported(where, f"clip_qkv {hf['clip_qkv']}: megatron-core does not clamp q, k and v")

    def expert_ffn_size(self, hf: Mapping[str, Any], where: Path) -> int:
        return hf_config.getter(hf, where)("intermediate_size")

    def hf_extras(self, model: Mapping[str, Any]) -> dict[str, Any]:
        return {**super().hf_extras(model), **self.moe_config(model), "intermediate_size": model["moe_ffn_hidden_size"],
                "norm_topk_prob": not model["moe_router_pre_softmax"], "clip_qkv": None}

    def attention_pairs(self, arch: Architecture, m: str, p: str) -> list[Pair]:
        return across_heads_qk_norms(super().attention_pairs(arch, m, p), arch, m, p)
