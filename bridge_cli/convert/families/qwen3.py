"""``qwen3``: Llama's layout with a per-head RMSNorm on queries and keys (megatron-core's qk_layernorm)."""

from __future__ import annotations

from typing import Any, Mapping

from bridge_cli.convert.families.llama_like import LlamaLike, full_attention_only
from bridge_cli.convert.hf_config import unsupported


class Qwen3(LlamaLike):
    """Qwen3 (dense). ``q_norm``/``k_norm`` normalise each head before RoPE, as megatron-core's
    ``q_layernorm``/``k_layernorm`` do; ``head_dim`` is explicit (often not hidden/heads)."""

    model_type = "qwen3"
    architecture = "Qwen3ForCausalLM"
    models = "Qwen3 (dense, 0.6B-32B); per-head q/k RMSNorm, explicit head_dim"
    limits = "refuses attention_bias, sliding-window layers and RoPE scalings other than llama3 and yarn"
    fixed = {**LlamaLike.fixed, "qk_layernorm": True}

    def check(self, hf, where) -> None:
        if hf.get("attention_bias"):
            unsupported(where, "attention_bias: a Qwen3 with it has a bias on o_proj, which megatron-core's "
                               "attention cannot hold without biases on every linear layer")
        full_attention_only(hf, where)

    def hf_extras(self, model: Mapping[str, Any]) -> dict[str, Any]:
        return {"attention_bias": False, "use_sliding_window": False, "max_window_layers": model["num_layers"]}
