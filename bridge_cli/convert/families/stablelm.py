"""``stablelm``: Llama's layout with LayerNorms (with biases), RoPE on part of each head, optional q/k/v biases."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping, Optional

from bridge_cli.convert import hf_config
from bridge_cli.convert.families.llama_like import LlamaLike
from bridge_cli.convert.hf_config import unsupported


class StableLm(LlamaLike):
    """StableLM 2 (1.6B, 12B) and StableLM-3B-4E1T.

    The norms are LayerNorms with a bias; ``partial_rotary_factor`` is megatron-core's ``rotary_percent``
    (both rotate the first part of each head, its two halves); ``use_qkv_bias`` is ``add_qkv_bias``.
    """

    model_type = "stablelm"
    architecture = "StableLmForCausalLM"
    models = "StableLM 2 1.6B/12B, StableLM-3B-4E1T; LayerNorm, partial RoPE, optional q/k/v biases"
    limits = ("refuses per-head q/k LayerNorms (qk_layernorm: one norm per head, megatron-core shares one), "
              "use_parallel_residual and RoPE scalings other than llama3 and yarn (yarn on whole heads only)")
    mapped_keys = (*(key for key in LlamaLike.mapped_keys if key != "rms_norm_eps"), "layer_norm_eps", "use_qkv_bias")
    assumed = {"qk_layernorm": False, "use_parallel_residual": False}
    inert_keys = (*LlamaLike.inert_keys, "hidden_dropout")
    fixed = {**{key: value for key, value in LlamaLike.fixed.items() if key not in ("rotary_percent", "add_qkv_bias")},
             "normalization": "LayerNorm"}
    norm_bias = True
    epsilon_key = "layer_norm_eps"

    def fields(self, hf: Mapping[str, Any], where: Path, seq_length: Optional[int] = None) -> dict[str, Any]:
        return {**super().fields(hf, where, seq_length), "add_qkv_bias": bool(hf["use_qkv_bias"])}

    def check(self, hf: Mapping[str, Any], where: Path) -> None:
        if hf.get("qk_layernorm"):
            unsupported(where, "qk_layernorm: StableLM normalises each head with its own LayerNorm, megatron-core's "
                        "q/k norm has one weight for all heads")
        if hf.get("use_parallel_residual"):
            unsupported(where, "use_parallel_residual: megatron-core's layer runs the attention and the MLP in turn")

    def rotary_percent(self, hf: Mapping[str, Any], where: Path) -> float:
        return hf_config.partial_rotary_factor(hf, where)

    def hf_config(self, model: Mapping[str, Any]) -> dict[str, Any]:
        config = super().hf_config(model)
        del config["rms_norm_eps"]
        return {**config, "layer_norm_eps": model["layernorm_epsilon"],
                "partial_rotary_factor": model["rotary_percent"], "use_qkv_bias": bool(model["add_qkv_bias"]),
                "qk_layernorm": False, "use_parallel_residual": False,
                "hidden_dropout": 0.0, "bos_token_id": None, "eos_token_id": None}

    def hf_extras(self, model: Mapping[str, Any]) -> dict[str, Any]:
        return {}
