"""``olmo2``: OLMo 2 (Olmo2ForCausalLM), Llama's layout with its norms after each sublayer instead of before,
and an RMSNorm over each token's whole query and key projections (as OLMoE's)."""

from __future__ import annotations

from typing import Any, Mapping

from bridge_cli.convert.families.llama_like import LlamaLike, across_heads_qk_norms
from bridge_cli.convert.hf_weights import Architecture, Pair


class Olmo2(LlamaLike):
    """OLMo 2 7B, 13B, 32B (and OLMo 2 1B). ``post_attention_layernorm``/``post_feedforward_layernorm`` normalise
    the attention and MLP outputs before they join the residual (``post_sublayer_norm``), and nothing normalises
    their inputs (``pre_sublayer_norm: false``); ``q_norm``/``k_norm`` cover all heads of a projection
    (``qk_layernorm_across_heads``, :mod:`bridge_cli.models.projection_norm`)."""

    model_type = "olmo2"
    architecture = "Olmo2ForCausalLM"
    models = "OLMo 2 1B, 7B, 13B, 32B; norms after each sublayer, q/k RMSNorm over the whole projection"
    limits = ("refuses attention_bias and RoPE scalings other than llama3 and yarn; needs the torch or local spec; "
              "tensor parallelism needs num_key_value_heads to be a multiple of the TP size")
    fixed = {**LlamaLike.fixed, "qk_layernorm": True, "qk_layernorm_across_heads": True, "post_sublayer_norm": True,
             "pre_sublayer_norm": False}
    pre_norms = None
    post_norms = ("post_attention_layernorm", "post_feedforward_layernorm")

    def hf_extras(self, model: Mapping[str, Any]) -> dict[str, Any]:
        return {"attention_bias": False}

    def attention_pairs(self, arch: Architecture, m: str, p: str) -> list[Pair]:
        return across_heads_qk_norms(super().attention_pairs(arch, m, p), arch, m, p)
