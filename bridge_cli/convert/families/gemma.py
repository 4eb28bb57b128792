"""``gemma``: Gemma (GemmaForCausalLM) on Llama's layout with ``1 + w`` RMSNorms, scaled embeddings and a
tanh-GELU gated MLP (the changes Gemma 2 and 3 build on, :mod:`.gemma3`, without their post-sublayer norms,
sliding windows, soft caps or q/k norms)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

from bridge_cli.convert.families.llama_like import LlamaLike
from bridge_cli.convert.hf_config import unsupported

ACTIVATIONS = ("gelu_pytorch_tanh", "gelu")
"""config.json's hidden_act values: transformers reads the released checkpoints' legacy ``gelu`` as the tanh
approximation too, which megatron-core's fast_gelu computes."""


class Gemma(LlamaLike):
    """Gemma 2B and 7B, CodeGemma."""

    model_type = "gemma"
    architecture = "GemmaForCausalLM"
    models = "Gemma 2B, 7B, CodeGemma; 1 + w RMSNorms, scaled embeddings, tanh-GELU gated MLP"
    limits = "refuses attention_bias, bidirectional attention and RoPE scalings other than llama3 and yarn"
    assumed = {"attention_bias": False, "use_bidirectional_attention": False}
    fixed = {**LlamaLike.fixed, "activation_func": "fast_gelu", "layernorm_zero_centered_gamma": True,
             "scale_embeddings": True}

    def activation(self, hf: Mapping[str, Any], where: Path) -> str:
        act = hf.get("hidden_act") or ACTIVATIONS[0]
        if act not in ACTIVATIONS:
            unsupported(where, f"hidden_act {act!r}: Gemma uses gelu_pytorch_tanh")
        return "fast_gelu"

    def check(self, hf: Mapping[str, Any], where: Path) -> None:
        refuse_gemma_options(hf, where)

    def hf_config(self, model: Mapping[str, Any]) -> dict[str, Any]:
        return {**super().hf_config(model), "hidden_act": ACTIVATIONS[0], "attention_bias": False}

    def hf_extras(self, model: Mapping[str, Any]) -> dict[str, Any]:
        return {}


def refuse_gemma_options(hf: Mapping[str, Any], where: Path) -> None:
    """The config.json options of every Gemma generation that megatron-core's model here cannot compute."""
    if hf.get("use_bidirectional_attention"):
        unsupported(where, "use_bidirectional_attention: bridge trains causal language models")
    if hf.get("attention_bias"):
        unsupported(where, "attention_bias: a bias on o_proj needs biases on every linear layer in megatron-core")
