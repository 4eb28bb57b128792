"""``starcoder2``: LayerNorm with biases, a plain (not gated) GELU MLP, and a bias on every linear."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping, Optional

from bridge_cli.convert.families.llama_like import LLAMA_STYLE, LlamaLike
from bridge_cli.convert.families.windows import every_layer, window_config
from bridge_cli.convert.hf_config import unsupported
from bridge_cli.convert.hf_weights import Architecture, Pair


class Starcoder2(LlamaLike):
    """StarCoder2 3B, 7B and 15B.

    Each linear has a bias (megatron-core's ``add_bias_linear``, and ``add_qkv_bias`` for q/k/v); the norms
    are LayerNorms with a bias; ``c_fc``/``c_proj`` are megatron-core's ``linear_fc1``/``linear_fc2`` of an
    ungated MLP; its ``gelu_pytorch_tanh`` is megatron-core's ``fast_gelu``, which runs unfused (megatron-core
    fuses a bias only into ``gelu``). A sliding window in every layer, as Mistral's.
    """

    model_type = "starcoder2"
    architecture = "Starcoder2ForCausalLM"
    models = "StarCoder2 3B, 7B, 15B; LayerNorm, tanh GELU, biases on every linear"
    limits = ("refuses use_bias=false, activations other than gelu_pytorch_tanh and RoPE scalings other than llama3 "
              "and yarn")
    mapped_keys = (*(key for key in LlamaLike.mapped_keys if key != "rms_norm_eps"), "norm_epsilon",
                   "sliding_window")
    assumed = {"use_bias": True}
    inert_keys = (*LlamaLike.inert_keys, "residual_dropout", "embedding_dropout")
    fixed = {**{key: value for key, value in LLAMA_STYLE.items() if key != "window_size"}, "normalization": "LayerNorm",
             "activation_func": "fast_gelu", "gated_linear_unit": False, "add_bias_linear": True, "add_qkv_bias": True}
    windows = "every_layer"
    norm_bias = True
    epsilon_key = "norm_epsilon"

    def fields(self, hf: Mapping[str, Any], where: Path, seq_length: Optional[int] = None) -> dict[str, Any]:
        return {**super().fields(hf, where, seq_length), "bias_activation_fusion": False}

    def activation(self, hf: Mapping[str, Any], where: Path) -> str:
        if hf["hidden_act"] != "gelu_pytorch_tanh":
            unsupported(where, f"hidden_act {hf['hidden_act']!r}: the starcoder2 family uses gelu_pytorch_tanh")
        return "fast_gelu"

    def check(self, hf: Mapping[str, Any], where: Path) -> None:
        if not hf["use_bias"]:
            unsupported(where, "use_bias false: megatron-core puts the biases of q/k/v and of the other linears "
                        "under separate switches, and this family fixes both on")

    def layer_kinds(self, hf: Mapping[str, Any], count: int, where: Path) -> list[str]:
        return every_layer(hf, count)

    def hf_config(self, model: Mapping[str, Any]) -> dict[str, Any]:
        config = super().hf_config(model)
        del config["rms_norm_eps"]
        return {**config, "hidden_act": "gelu_pytorch_tanh", "norm_epsilon": model["layernorm_epsilon"], "use_bias": True,
                # token ids belong to the tokenizer (transformers' defaults, 50256, would not fit a small vocabulary)
                "sliding_window": window_config(model)["sliding_window"], "residual_dropout": 0.0,
                "embedding_dropout": 0.0,
                "bos_token_id": None, "eos_token_id": None}

    def hf_extras(self, model: Mapping[str, Any]) -> dict[str, Any]:
        return {}

    def attention_pairs(self, arch: Architecture, m: str, p: str) -> list[Pair]:
        return [*super().attention_pairs(arch, m, p),
                Pair(m + "linear_proj.bias", ((p + "o_proj.bias", (arch.hidden_size,)),))]

    def mlp_pairs(self, arch: Architecture, m: str, p: str) -> list[Pair]:
        h, f = arch.hidden_size, arch.ffn_hidden_size
        return [Pair(m + "linear_fc1.weight", ((p + "c_fc.weight", (f, h)),)),
                Pair(m + "linear_fc1.bias", ((p + "c_fc.bias", (f,)),)),
                Pair(m + "linear_fc2.weight", ((p + "c_proj.weight", (h, f)),)),
                Pair(m + "linear_fc2.bias", ((p + "c_proj.bias", (h,)),))]
