"""``mistral``: Llama's layout with a sliding window in every layer."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

from bridge_cli.convert.families.llama_like import LlamaLike
from bridge_cli.convert.families.windows import every_layer, window_config


class Mistral(LlamaLike):
    """Mistral 7B v0.1 to v0.3.

    Every layer sees its ``sliding_window`` most recent keys (megatron-core's ``window_size``, all layers), none
    where ``sliding_window`` is null (v0.2, v0.3), so the converted model equals transformers' at every length.
    """

    model_type = "mistral"
    architecture = "MistralForCausalLM"
    models = "Mistral 7B v0.1-v0.3; sliding window in every layer"
    limits = "refuses RoPE scalings other than llama3 and yarn"
    mapped_keys = (*LlamaLike.mapped_keys, "sliding_window")
    fixed = {key: value for key, value in LlamaLike.fixed.items() if key != "window_size"}
    windows = "every_layer"

    def layer_kinds(self, hf: Mapping[str, Any], count: int, where: Path) -> list[str]:
        return every_layer(hf, count)

    def hf_extras(self, model: Mapping[str, Any]) -> dict[str, Any]:
        return {"sliding_window": window_config(model)["sliding_window"]}
