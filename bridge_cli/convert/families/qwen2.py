"""``qwen2``: Llama's layout with biases on q, k and v."""

from __future__ import annotations

from typing import Any, Mapping

from bridge_cli.convert.families.llama_like import LlamaLike, full_attention_only


class Qwen2(LlamaLike):
    """Qwen2 and Qwen2.5 (dense)."""

    model_type = "qwen2"
    architecture = "Qwen2ForCausalLM"
    models = "Qwen2, Qwen2.5 (dense); biases on q/k/v"
    limits = "refuses sliding-window layers and RoPE scalings other than llama3 and yarn"
    fixed = {**LlamaLike.fixed, "add_qkv_bias": True}

    def check(self, hf, where) -> None:
        full_attention_only(hf, where)

    def hf_extras(self, model: Mapping[str, Any]) -> dict[str, Any]:
        return {"use_sliding_window": False, "max_window_layers": model["num_layers"]}
