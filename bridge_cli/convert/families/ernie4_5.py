"""``ernie4_5``: Baidu's ERNIE 4.5 dense models (``Ernie4_5ForCausalLM``): Llama's layout with interleaved RoPE.

transformers' ERNIE 4.5 rotates pairs of adjacent dimensions of each whole head (GLM's ``rotate_half`` over
``repeat_interleave``-d cos/sin: megatron-core's ``rotary_interleaved``), has an explicit ``head_dim`` (128 where
config.json leaves it out), ties its embeddings unless config.json says otherwise, and bases RoPE on 500,000. Its
``use_bias`` switch puts biases on q/k/v/o and on the three MLP projections together; the releases have none, and
one with them is refused. Its attention has no dropout, whatever config.json says. No torch import.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping, Optional

from bridge_cli.convert.families.llama_like import INERT_KEYS, LLAMA_KEYS, LlamaLike


class Ernie4_5(LlamaLike):
    """ERNIE-4.5-0.3B (-Base) and their fine-tunes. transformers rotates q and k in fp32 whatever the model's dtype,
    megatron-core in the model's: the same in fp32, a rounding apart in bf16."""

    model_type = "ernie4_5"
    architecture = "Ernie4_5ForCausalLM"
    models = "ERNIE-4.5-0.3B-PT, ERNIE-4.5-0.3B-Base-PT; interleaved RoPE on whole heads, tied embeddings"
    limits = "refuses use_bias and RoPE scalings other than llama3 (YaRN rotates halves, not interleaved pairs)"
    fixed = {**LlamaLike.fixed, "rotary_interleaved": True}
    mapped_keys = tuple(key for key in LLAMA_KEYS if key != "attention_dropout")  # not a field of its config class
    assumed = {"use_bias": False}
    inert_keys = INERT_KEYS

    def fields(self, hf: Mapping[str, Any], where: Path, seq_length: Optional[int] = None) -> dict[str, Any]:
        # transformers' Ernie4_5Attention sets its dropout to 0.0 over any attention_dropout config.json has
        return {**super().fields(hf, where, seq_length), "attention_dropout": 0.0}

    def check(self, hf: Mapping[str, Any], where: Path) -> None:
        """Nothing beyond ``use_bias`` (:attr:`assumed`): transformers' ERNIE 4.5 reads no attention_bias/mlp_bias."""

    def hf_extras(self, model: Mapping[str, Any]) -> dict[str, Any]:
        return {"use_bias": False}
