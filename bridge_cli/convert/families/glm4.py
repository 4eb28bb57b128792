"""``glm4``: GLM-4 (Glm4ForCausalLM): Llama's layout with norms both before and after each sublayer, biases on
q/k/v, ``gate_up_proj`` fused as Phi-3's, and RoPE on the first half of each head with its pairs interleaved."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

from bridge_cli.convert.families.llama_like import LlamaLike
from bridge_cli.convert.families.phi3 import Phi3
from bridge_cli.convert.hf_config import unsupported


class Glm4(Phi3):
    """GLM-4-9B-0414, GLM-4-32B-0414 and GLM-Z1. ``post_self_attn_layernorm``/``post_mlp_layernorm`` normalise the
    attention and MLP outputs before they join the residual (``post_sublayer_norm``), next to the usual input
    norms; transformers rotates pairs of adjacent dimensions (``rotary_interleaved``) over ``partial_rotary_factor``
    of each head (``rotary_percent``)."""

    model_type = "glm4"
    architecture = "Glm4ForCausalLM"
    models = "GLM-4-0414 (9B, 32B), GLM-Z1; sandwich norms, q/k/v biases, interleaved partial RoPE"
    limits = "refuses attention_bias=false and RoPE scalings other than llama3"
    rope_hint = ""
    mapped_keys = LlamaLike.mapped_keys
    assumed = {"attention_bias": True}
    inert_keys = LlamaLike.inert_keys
    fixed = {**Phi3.fixed, "add_qkv_bias": True, "post_sublayer_norm": True, "rotary_interleaved": True,
             "window_size": None}
    windows = None
    post_norms = ("post_self_attn_layernorm", "post_mlp_layernorm")

    def check(self, hf: Mapping[str, Any], where: Path) -> None:
        if not hf.get("attention_bias", True):
            unsupported(where, "attention_bias false: this family fixes the q/k/v biases on")

    layer_kinds = LlamaLike.layer_kinds  # no sliding window (Phi-3 has one)

    def hf_extras(self, model: Mapping[str, Any]) -> dict[str, Any]:
        # token ids belong to the tokenizer (GLM-4's defaults would not fit a smaller vocabulary)
        return {"partial_rotary_factor": model["rotary_percent"], "attention_bias": True, "pad_token_id": None,
                "eos_token_id": None}

    attention_pairs = LlamaLike.attention_pairs  # separate q, k and v (Phi-3 fuses them)
