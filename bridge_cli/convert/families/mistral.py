"""``mistral``: Llama's layout with a sliding window, which caps the sequence length instead."""

from __future__ import annotations

from typing import Any, Mapping, Optional

from bridge_cli.convert.families.llama_like import LlamaLike


class Mistral(LlamaLike):
    """Mistral 7B v0.1 to v0.3.

    Up to its ``sliding_window`` tokens, sliding-window attention is full causal attention, so the
    import caps model.seq_length there and the converted model is exact at every length it trains on.
    """

    model_type = "mistral"
    architecture = "MistralForCausalLM"
    models = "Mistral 7B v0.1-v0.3"
    limits = "model.seq_length is capped at sliding_window; refuses RoPE scalings other than llama3 and yarn"

    def window(self, hf: Mapping[str, Any]) -> Optional[int]:
        return hf.get("sliding_window")

    def hf_extras(self, model: Mapping[str, Any]) -> dict[str, Any]:
        # megatron-core attends over the whole sequence
        return {"sliding_window": None}
