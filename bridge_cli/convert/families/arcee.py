"""``arcee``: Arcee's AFM (ArceeForCausalLM), Llama's layout with an ungated squared-ReLU MLP."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping, Optional

from bridge_cli.convert.families.llama_like import LlamaLike
from bridge_cli.convert.hf_config import unsupported
from bridge_cli.convert.hf_weights import Architecture, Pair


class Arcee(LlamaLike):
    """AFM-4.5B (Base, Instruct). Its MLP is ``down_proj(relu(up_proj(x)) ** 2)`` without a gate: megatron-core's
    ungated ``squared_relu`` MLP, ``up_proj``/``down_proj`` as ``linear_fc1``/``linear_fc2``. The released configs
    scale RoPE with YaRN (bridge_cli/convert/yarn.py, as every family of this layout)."""

    model_type = "arcee"
    architecture = "ArceeForCausalLM"
    models = "AFM-4.5B; ungated squared-ReLU MLP, YaRN RoPE"
    limits = ("refuses attention_bias/mlp_bias, activations other than relu2 and RoPE scalings other than llama3 "
              "and yarn")
    fixed = {**LlamaLike.fixed, "activation_func": "squared_relu", "gated_linear_unit": False}

    def fields(self, hf: Mapping[str, Any], where: Path, seq_length: Optional[int] = None) -> dict[str, Any]:
        # megatron-core fuses a bias-activation for gelu and swiglu only
        return {**super().fields(hf, where, seq_length), "bias_activation_fusion": False}

    def activation(self, hf: Mapping[str, Any], where: Path) -> str:
        if hf.get("hidden_act", "relu2") != "relu2":
            unsupported(where, f"hidden_act {hf['hidden_act']!r}: the arcee family uses relu2 (squared ReLU)")
        return "squared_relu"

    def hf_extras(self, model: Mapping[str, Any]) -> dict[str, Any]:
        return {**super().hf_extras(model), "hidden_act": "relu2"}

    def mlp_pairs(self, arch: Architecture, m: str, p: str) -> list[Pair]:
        h, f = arch.hidden_size, arch.ffn_hidden_size
        return [Pair(m + "linear_fc1.weight", ((p + "up_proj.weight", (f, h)),)),
                Pair(m + "linear_fc2.weight", ((p + "down_proj.weight", (h, f)),))]
