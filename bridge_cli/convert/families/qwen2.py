"""``qwen2``: Llama's layout with biases on q, k and v, and sliding-window layers where config.json puts them."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

from bridge_cli.convert.families.llama_like import LlamaLike
from bridge_cli.convert.families.windows import (QWEN_WINDOW_KEYS, max_window_layers, qwen_layer_types,
                                                 qwen_window_config)


class Qwen2(LlamaLike):
    """Qwen2 and Qwen2.5 (dense). With ``use_sliding_window``, the layers from ``max_window_layers`` on (or those
    ``layer_types`` lists) see their ``sliding_window`` most recent keys."""

    model_type = "qwen2"
    architecture = "Qwen2ForCausalLM"
    models = "Qwen2, Qwen2.5 (dense); biases on q/k/v, sliding-window layers"
    limits = "refuses RoPE scalings other than llama3 and yarn"
    mapped_keys = (*LlamaLike.mapped_keys, *QWEN_WINDOW_KEYS)
    assumed: dict = {}  # Qwen2's q/k/v biases are fixed (no attention_bias/mlp_bias switches)
    fixed = {**{key: value for key, value in LlamaLike.fixed.items() if key != "window_size"}, "add_qkv_bias": True}
    windows = "per_layer"

    def check(self, hf, where) -> None:
        """Nothing to refuse: Qwen2's biases are fixed (no attention_bias/mlp_bias switches)."""

    def layer_kinds(self, hf: Mapping[str, Any], count: int, where: Path) -> list[str]:
        # transformers 5.24 windows none of them where sliding_window is null
        return qwen_layer_types(hf, count, where,
                                lambda i: hf.get("sliding_window") is not None and i >= max_window_layers(hf, where))

    def hf_extras(self, model: Mapping[str, Any]) -> dict[str, Any]:
        return qwen_window_config(model)
