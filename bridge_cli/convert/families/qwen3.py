"""``qwen3``: Llama's layout with a per-head RMSNorm on queries and keys (megatron-core's qk_layernorm)."""

from __future__ import annotations

from typing import Any, Mapping

from bridge_cli.convert.families.llama_like import LlamaLike
from bridge_cli.convert.families.qwen2 import Qwen2
from bridge_cli.convert.families.windows import qwen_window_config
from bridge_cli.convert.hf_config import unsupported


class Qwen3(LlamaLike):
    """Qwen3 (dense). ``q_norm``/``k_norm`` normalise each head before RoPE, as megatron-core's
    ``q_layernorm``/``k_layernorm`` do; ``head_dim`` is explicit (often not hidden/heads). Sliding-window layers
    as Qwen2's."""

    model_type = "qwen3"
    architecture = "Qwen3ForCausalLM"
    models = ("Qwen3 (dense, 0.6B-32B; the -FP8 releases dequantized); per-head q/k RMSNorm, explicit head_dim, "
              "sliding-window layers")
    limits = "refuses attention_bias and RoPE scalings other than llama3 and yarn"
    mapped_keys = Qwen2.mapped_keys
    assumed = {"attention_bias": False}
    fixed = {**{key: value for key, value in LlamaLike.fixed.items() if key != "window_size"}, "qk_layernorm": True}
    windows = "per_layer"
    layer_kinds = Qwen2.layer_kinds

    def check(self, hf, where) -> None:
        if hf.get("attention_bias"):
            unsupported(where, "attention_bias: a Qwen3 with it has a bias on o_proj, which megatron-core's "
                               "attention cannot hold without biases on every linear layer")

    def hf_extras(self, model: Mapping[str, Any]) -> dict[str, Any]:
        return {"attention_bias": False, **qwen_window_config(model)}
